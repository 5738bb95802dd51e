// Job detail page: everything after the first paint arrives over /ws/jobs/<id>/ (no metric polling).
// The only HTTP GET it makes is of the job itself, after a burst of `status` messages or of events that
// change what the job JSON says (stragglers, hangs, restarts, rollbacks), to refresh attempts.
// This module wires the page (header, queue, alerts, charts, logs, the socket); the attempts and
// checkpoints tables (with the staff's Roll back / Pin) are in jobtables.js, the events in timeline.js.
import { LiveSocket, bindIndicator } from './live.js';
import { SampleStore, StepStore } from './store.js';
import { lossChart, throughputChart, breakdownChart, rankStepChart, bytesChart, shareChart,
  attemptMarkers } from './charts.js';
import { LogPane } from './logs.js';
import { KeptLogs } from './keptlogs.js';
import { addUserCharts, renderTelemetryNote } from './usercharts.js';
import { renderPlanMeasured } from './planpanel.js';
import { ProfilePanel } from './profile.js';
import { CheckpointTable, renderAttempts } from './jobtables.js';
import { Timeline } from './timeline.js';
import { $, $$, el, TERMINAL, fmtNum, fmtSeconds, fmtClock, fmtDateTime, frameThrottle, getJSON,
  readJSONScript, statusBadge, isNum } from './util.js';

const cfg = readJSONScript('job-config');
const store = new SampleStore({ maxSteps: 2000 });  // the named ranks' per-rank samples (every rank of a small job)
const steps = new StepStore({ maxSteps: 3000 });     // every rank's min/mean/max per step (or bucket of steps)
const drill = { rank: null, values: {}, fetches: 0 };  // the rank picked for drill-down: chart key -> Map(step -> value)
const charts = {
  loss: lossChart($('#chart-loss')),
  throughput: throughputChart($('#chart-throughput')),
  breakdown: breakdownChart($('#chart-breakdown')),
  ranks: rankStepChart($('#chart-ranks')),
  bytes: bytesChart($('#chart-bytes')),
};
if ($('#chart-share')) charts.share = shareChart($('#chart-share'));
const logs = new LogPane($('#log-tabs'), $('#log-pane'));
const kept = new KeptLogs($('#kept-logs'), cfg.id);  // a finished job's logs, paged from the kept files
const profile = new ProfilePanel($('#profile-card'), cfg.id, { onApplied: (job) => { applyJob(job); refreshJobSoon(); } });
const timeline = new Timeline();  // the events (static/js/timeline.js)
const checkpoints = new CheckpointTable({  // the checkpoints and the staff's actions (static/js/jobtables.js)
  jobId: cfg.id, isStaff: cfg.is_staff, attempts: () => (state.job && state.job.attempts) || [],
  onRolledBack: (job) => { if (job) applyJob(job); refreshJobSoon(); },
});
const state = {
  job: null,
  status: cfg.status,
  step: cfg.step,
  world: cfg.world,
  events: timeline.items,  // id -> event
  checkpoints: checkpoints.items,  // id -> checkpoint (after a rollback two checkpoints can share a step)
  markers: [],             // [{step, label}] rollback/restart lines on the charts
  statusMessages: 0,
  eventRefreshes: 0,       // events that asked for a job refresh (straggler, rollback, ...)
  jobFetches: 0,
  hasTelemetry: !!cfg.has_telemetry,  // a sample exists for the job (server) or arrived here
};
// Events after which the job JSON (stragglers, health, attempts) is stale.
const REFRESH_KINDS = new Set(['straggler', 'straggler_cleared', 'hang_detected', 'rollback', 'restart',
  'preempt_requested', 'preempted', 'preempt_forced', 'recommendation_applied']);

// ---------------------------------------------------------------- header

function setStatus(status, reason) {
  if (status) {
    state.status = status;
    const badge = $('#job-status');
    badge.replaceChildren(statusBadge(status));
    document.body.dataset.jobStatus = status;
  }
  if (reason !== undefined && reason !== null) {
    const p = $('#job-reason');
    p.textContent = reason;
    p.classList.toggle('preempt', reason.startsWith('preempt'));
  }
  const queued = $('#queue-stat');
  if (queued) queued.hidden = state.status !== 'QUEUED';
  if (TERMINAL.has(state.status) && $('#job-alerts')) $('#job-alerts').hidden = true;
  const cancel = $('#cancel-form');
  if (cancel) cancel.hidden = !cfg.can_cancel || TERMINAL.has(state.status) || state.status === 'STOPPING';
  if (TERMINAL.has(state.status)) kept.show();
  renderTelemetry();
}

function renderTelemetry() {
  const attempts = (state.job && state.job.attempts) || [];
  const current = attempts.reduce((a, b) => (!a || b.number > a.number ? b : a), null);
  renderTelemetryNote($('#telemetry-note'), $('#charts'), { status: state.status, hasTelemetry: state.hasTelemetry,
    runningSince: current && current.status === 'RUNNING' ? current.started_at : null });
}

function renderHeader() {
  const total = cfg.total_steps || 0;
  const step = Math.max(state.step || 0, store.lastStep || 0, steps.lastStep || 0);
  state.step = step;
  $('#job-step').textContent = `${step} / ${total}`;
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  const bar = $('#job-progress');
  bar.style.width = `${pct.toFixed(1)}%`;
  bar.parentElement.setAttribute('aria-valuenow', pct.toFixed(0));
  const sps = steps.recentTotal('samples_per_s', state.world);
  const tps = steps.recentTotal('tokens_per_s', state.world);
  $('#job-throughput').textContent = isNum(sps) ? fmtNum(sps) : '–';
  $('#job-tokens').textContent = isNum(tps) ? `${fmtNum(tps)} tokens/s` : '';
  const loss = steps.latest('loss');
  $('#job-loss').textContent = isNum(loss) ? fmtNum(loss, 4) : '–';
  const stepS = steps.latest('step_s');
  $('#job-step-time').textContent = isNum(stepS) ? fmtSeconds(stepS) : '–';
  renderPlanMeasured(steps);
}

// ---------------------------------------------------------------- queue position, predicted start

// A predicted start as "in ~4 min" (jobs/runs/views.py _eta_text says the same for the first paint).
function fmtIn(iso, now = Date.now()) {
  if (!iso) return 'unknown';
  const t = new Date(iso).getTime();
  if (Number.isNaN(t)) return 'unknown';
  const s = (t - now) / 1000;
  if (s < 30) return 'any moment';
  if (s < 90) return 'in ~1 min';
  if (s < 5400) return `in ~${Math.round(s / 60)} min`;
  if (s < 48 * 3600) return `in ~${(s / 3600).toFixed(1)} h`;
  return `in ~${Math.round(s / 86400)} days`;
}

function renderEta() {
  const eta = $('#job-eta');
  if (!eta) return;
  const at = eta.dataset.at || '';
  eta.textContent = fmtIn(at);
  eta.title = at ? fmtDateTime(at) : 'no prediction yet';
}

function renderQueue(job) {
  const pos = $('#job-queue-pos');
  if (pos) pos.textContent = job.queue_position ? `#${job.queue_position}` : '–';
  const eta = $('#job-eta');
  if (eta) eta.dataset.at = job.predicted_start_at || '';
  renderEta();
  const borrowing = $('#job-borrowing');
  if (borrowing) borrowing.hidden = job.borrowing !== true;
}

// ---------------------------------------------------------------- stragglers and health

function stragglerAlert(s) {
  const pct = isNum(s.ratio) ? Math.round((s.ratio - 1) * 100) : null;
  const detail = [
    isNum(s.work_s) && isNum(s.median_s) ? `${fmtSeconds(s.work_s)} vs ${fmtSeconds(s.median_s)} a step` : '',
    isNum(s.since_step) ? `since step ${s.since_step}` : ''].filter(Boolean).join(', ');
  return el('div', { class: 'alert warn', dataset: { rank: s.rank, node: s.node || '' } },
    el('b', {}, 'Straggler: '),
    `rank ${s.rank} on ${s.node || '?'} is ${pct === null ? 'slower than' : `${pct}% slower than`} the median`,
    detail ? el('span', { class: 'muted' }, ` (${detail})`) : '');
}

function renderAlerts(job) {
  const box = $('#job-alerts');
  if (!box) return;
  // A straggler is news only while the job runs (the server lists the current attempt's).
  const live = !TERMINAL.has(job.status);
  const alerts = live ? (job.stragglers || []).map(stragglerAlert) : [];
  box.replaceChildren(...alerts);
  box.hidden = !alerts.length;
  const hang = $('#job-hang');
  const h = job.health || {};
  if (!hang) return;
  const source = h.hang_timeout_source === 'auto' ? ' (auto)' : '';
  hang.textContent = isNum(h.hang_timeout_s) ? `hang timeout ${fmtSeconds(h.hang_timeout_s)}${source}` : '';
}

// ---------------------------------------------------------------- socket messages

const redrawCharts = frameThrottle(() => {
  if (store.metricNames.size || steps.metricNames.size) {
    addUserCharts($('#charts'), { metricNames: new Set([...store.metricNames, ...steps.metricNames]) }, charts);
  }
  if ((store.steps.length || steps.steps.length) && !state.hasTelemetry) {
    state.hasTelemetry = true;
    renderTelemetry();
  }
  renderNamed();
  const ctx = { store, steps, drill, world: state.world, markers: state.markers };
  for (const c of Object.values(charts)) c.update(ctx);
  renderHeader();
}, 100);
// The named ranks under the step-time chart: "Slowest: rank 17 (40 of 200 steps) ...".
function renderNamed() {
  const box = $('#named-ranks');
  if (!box) return;
  const n = steps.named;
  const names = (list) => (list || []).map((x) => `rank ${x.rank}`).join(', ');
  box.dataset.slowest = n ? (n.slowest || []).map((x) => x.rank).join(',') : '';
  box.dataset.fastest = n ? (n.fastest || []).map((x) => x.rank).join(',') : '';
  if (!n || n.all || !(n.slowest || []).length) {
    box.textContent = n && n.all ? 'every rank drawn' : '';
    return;
  }
  box.textContent = `Slowest: ${names(n.slowest)} · fastest: ${names(n.fastest)} (most often the step's extreme over the last ${n.window} steps)`;
}

// Drill-down: one rank's series of each per-rank chart from GET /api/v1/jobs/<id>/series/ (bucketed in
// the database; the socket sends only the named ranks' samples). `rank` null clears it.
const DRILL_METRICS = { loss: 'loss', step_s: 'step_s', bytes_sent: 'bytes_sent', share: 'share' };
async function pickRank(rank) {
  const status = $('#rank-pick-status');
  drill.rank = Number.isInteger(rank) && rank >= 0 ? rank : null;
  drill.values = {};
  if (drill.rank === null) {
    if (status) status.textContent = '';
    redrawCharts();
    return;
  }
  const wanted = { ...DRILL_METRICS };
  for (const name of new Set([...store.metricNames, ...steps.metricNames])) wanted[`metric:${name}`] = name;
  if (status) status.textContent = `loading rank ${drill.rank}…`;
  const picked = drill.rank;
  await Promise.all(Object.entries(wanted).map(async ([key, metric]) => {
    try {
      const data = await getJSON(`/api/v1/jobs/${cfg.id}/series/?metric=${encodeURIComponent(metric)}&rank=${picked}`);
      if (drill.rank === picked) drill.values[key] = new Map((data.buckets || []).map((b) => [b.x, b.last]));
    } catch (err) {
      console.warn('trainyard: could not read rank', picked, metric, err);
    }
  }));
  drill.fetches += 1;
  if (status && drill.rank === picked) {
    const n = drill.values.step_s ? drill.values.step_s.size : 0;
    status.textContent = n ? `rank ${picked}: ${n} points` : `rank ${picked}: no samples kept`;
  }
  redrawCharts();
}

const pickForm = $('#rank-pick');
if (pickForm) {
  pickForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const v = pickForm.querySelector('input').value.trim();
    pickRank(v === '' ? null : Number(v));
  });
}

const redrawEvents = frameThrottle(() => timeline.render(), 200);

let fetchTimer = null;
function refreshJobSoon() {
  // One GET per burst of status messages/events: attempts, ranks, failures and stragglers live on the
  // job, not in the message.
  clearTimeout(fetchTimer);
  fetchTimer = setTimeout(async () => {
    state.jobFetches += 1;
    try {
      applyJob(await getJSON(`/api/v1/jobs/${cfg.id}/`));
    } catch (err) {
      console.warn('trainyard: could not refresh the job', err);
    }
  }, 250);
}

function applyJob(job) {
  if (!job) return;
  state.job = job;
  if (job.has_telemetry) state.hasTelemetry = true;
  const res = (job.spec && job.spec.resources) || {};
  if (res.nodes && res.procs_per_node) state.world = res.nodes * res.procs_per_node;
  if (isNum(job.step)) state.step = Math.max(state.step || 0, job.step);
  setStatus(job.status, job.status_reason || '');
  $('#job-restarts').textContent = String(job.restarts ?? 0);
  renderQueue(job);
  state.markers = attemptMarkers(job.attempts, [...state.events.values()]);
  renderAttempts(job.attempts, state.markers);
  renderAlerts(job);
  profile.render(job.profile, job.status);
  checkpoints.render();  // attempt numbers come from the job
  renderHeader();
  redrawCharts();
}

function onMessage(msg) {
  switch (msg.type) {
    case 'snapshot':
      for (const e of msg.events || []) timeline.add(e);  // before the job: chart markers read rollback events
      for (const c of msg.checkpoints || []) checkpoints.add(c);
      applyJob(msg.job);
      steps.merge(msg.steps);
      steps.setNamed(msg.named);
      store.merge(msg.samples, { downsampled: !!msg.downsampled });
      logs.reset(msg.logs || []);  // the live pane (hidden once the kept logs show)
      checkpoints.render();
      redrawEvents();
      redrawCharts();
      break;
    case 'telemetry':
      steps.merge(msg.steps);
      steps.setNamed(msg.named);
      store.merge(msg.samples);
      redrawCharts();
      break;
    case 'window':
      steps.merge(msg.steps);
      steps.setNamed(msg.named);
      store.merge(msg.samples, { downsampled: msg.downsampled !== false });
      if (Array.isArray(msg.logs)) logs.reset(msg.logs);  // log lines skipped while behind
      redrawCharts();
      break;
    case 'status':
      state.statusMessages += 1;
      if (isNum(msg.step)) state.step = Math.max(state.step || 0, msg.step);
      setStatus(msg.status, msg.status_reason);
      renderHeader();
      refreshJobSoon();
      break;
    case 'log':
      logs.add(msg.rank, (msg.lines || []).map((line) => ({ rank: msg.rank, attempt: msg.attempt,
        stream: msg.stream, line })));
      break;
    case 'event':
      timeline.add(msg.event);
      redrawEvents();
      if (msg.event && REFRESH_KINDS.has(msg.event.kind)) {
        state.eventRefreshes += 1;
        refreshJobSoon();
      }
      break;
    case 'profile':
      profile.render({ ...msg.profile, attempt: msg.attempt }, state.status);
      break;
    case 'checkpoint':
      checkpoints.add(msg.checkpoint || msg);
      checkpoints.render();
      break;
    default:
      break; // unknown types are ignored: newer servers may send more
  }
}

// ---------------------------------------------------------------- start

for (const t of $$('time[datetime]')) {
  const v = t.getAttribute('datetime');
  if (v) t.textContent = t.closest('#events') ? fmtClock(v) : fmtDateTime(v);
}
// Server-rendered events and checkpoints seed the state so a snapshot merges instead of duplicating.
for (const e of readJSONScript('job-events') || []) timeline.add(e);
for (const c of readJSONScript('job-checkpoints') || []) checkpoints.add(c);
setStatus(cfg.status);
renderEta();
setInterval(renderEta, 15000);
setInterval(renderTelemetry, 10000);  // "no telemetry yet" once a running attempt has been quiet for a while  // the prediction only moves when the server says so; "in ~N min" ticks here
renderHeader();
timeline.render();
checkpoints.render();
checkpoints.bind();

const socket = new LiveSocket(`/ws/jobs/${cfg.id}/`, { onMessage, onState: bindIndicator($('#live-indicator')) }).start();

// For the browser tests and for poking around in the console.
window.trainyard = {
  store, steps, drill, pickRank, charts, socket, logs, kept, profile, state, onMessage,
  stats: () => store.stats(),
  chartSteps: (name) => charts[name].seriesSteps(),
};
