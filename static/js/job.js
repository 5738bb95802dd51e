// Job detail page: everything after the first paint arrives over /ws/jobs/<id>/ (no metric polling).
// The only HTTP GET it makes is of the job itself, after a burst of `status` messages or of events that
// change what the job JSON says (stragglers, hangs, restarts, rollbacks), to refresh attempts.
// Staff also get Roll back / Pin buttons on the checkpoints (POSTs to the API with the CSRF token).
import { LiveSocket, bindIndicator } from './live.js';
import { SampleStore } from './store.js';
import { lossChart, throughputChart, breakdownChart, rankStepChart, bytesChart, shareChart,
  attemptMarkers } from './charts.js';
import { LogPane } from './logs.js';
import { KeptLogs } from './keptlogs.js';
import { addUserCharts, renderTelemetryNote } from './usercharts.js';
import { renderPlanMeasured } from './planpanel.js';
import { ProfilePanel } from './profile.js';
import { $, $$, el, TERMINAL, fmtNum, fmtSeconds, fmtBytes, fmtClock, fmtDateTime, frameThrottle, getJSON,
  readJSONScript, statusBadge, isNum, postJSON, errorText, replaceKeepingOpen } from './util.js';

const cfg = readJSONScript('job-config');
const store = new SampleStore({ maxSteps: 2000 });
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
const state = {
  job: null,
  status: cfg.status,
  step: cfg.step,
  world: cfg.world,
  events: new Map(),       // id -> event
  checkpoints: new Map(),  // id -> checkpoint (after a rollback two checkpoints can share a step)
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
  const step = Math.max(state.step || 0, store.lastStep || 0);
  state.step = step;
  $('#job-step').textContent = `${step} / ${total}`;
  const pct = total ? Math.min(100, (100 * step) / total) : 0;
  const bar = $('#job-progress');
  bar.style.width = `${pct.toFixed(1)}%`;
  bar.parentElement.setAttribute('aria-valuenow', pct.toFixed(0));
  const sps = store.recentSum('samples_per_s', state.world);
  const tps = store.recentSum('tokens_per_s', state.world);
  $('#job-throughput').textContent = isNum(sps) ? fmtNum(sps) : '–';
  $('#job-tokens').textContent = isNum(tps) ? `${fmtNum(tps)} tokens/s` : '';
  const loss = store.latest('loss');
  $('#job-loss').textContent = isNum(loss) ? fmtNum(loss, 4) : '–';
  const stepS = store.latest('step_s');
  $('#job-step-time').textContent = isNum(stepS) ? fmtSeconds(stepS) : '–';
  renderPlanMeasured(store);
}

// ---------------------------------------------------------------- queue position, predicted start

// A predicted start as "in ~4 min" (jobs/views.py _eta_text says the same for the first paint).
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

// ---------------------------------------------------------------- attempts, checkpoints, events

function ranksCell(ranks) {
  if (!ranks || !ranks.length) return el('span', { class: 'muted' }, '–');
  return el('ul', { class: 'ranks' }, ranks.map((r) => el('li', {},
    el('b', {}, `r${r.rank}`), ` ${r.node}`, r.pid ? el('span', { class: 'muted' }, ` pid ${r.pid}`) : '',
    r.role ? el('div', { class: 'rank-role', dataset: { rank: r.rank } },
      `${r.role} · params ${fmtBytes(r.param_bytes)}${r.optim_bytes ? ` · optim ${fmtBytes(r.optim_bytes)}` : ''}`) : '')));
}

function resumedCell(a, marker) {
  if (a.resumed_from_step === null || a.resumed_from_step === undefined) return 'start';
  return [`step ${a.resumed_from_step}`, marker ? el('span', { class: 'muted' }, ` (${marker.label})`) : ''];
}

function failureRow(a) {
  const f = a.failure || {};
  if (!(f.message || f.traceback || f.class)) return null;
  const where = [f.rank !== undefined && f.rank !== null ? `rank ${f.rank}` : '', f.node || ''].filter(Boolean).join(' on ');
  return el('tr', { class: 'failure-row', dataset: { failure: a.id } }, el('td', {}), el('td', { colspan: 6 },
    el('details', { dataset: { key: `tb-${a.id}` } },
      el('summary', {}, el('b', {}, f.class || 'failure'), where ? ` (${where})` : '', ': ', f.message || ''),
      el('pre', { class: 'tb' }, f.traceback || '(no traceback captured)')),
    f.suggestion ? el('p', { class: 'suggestion' }, el('b', {}, 'Suggestion: '), f.suggestion) : ''));
}

function outcomeClass(outcome) {
  if (!outcome) return '';
  if (outcome === 'succeeded') return 'ok';
  if (outcome.startsWith('failed') || outcome === 'lost') return 'bad';
  return 'warn';  // rolled_back, preempted, cancelled
}

function renderAttempts(attempts) {
  const body = $('#attempts-body');
  if (!body) return;
  const rows = [];
  const markers = new Map(state.markers.map((m) => [m.attempt, m]));
  const sorted = [...(attempts || [])].sort((a, b) => b.number - a.number);
  for (const a of sorted) {
    rows.push(el('tr', { dataset: { attempt: a.id, number: a.number, outcome: a.outcome || '' } },
      el('td', {}, `#${a.number}`),
      el('td', {}, statusBadge(a.status)),
      el('td', {}, el('span', { class: `outcome o-${outcomeClass(a.outcome)}` },
        a.outcome || (a.status === 'ENDED' ? '' : '…')),
        a.stop_reason ? el('div', { class: 'muted' }, a.stop_reason) : ''),
      el('td', {}, ranksCell(a.ranks)),
      el('td', {}, resumedCell(a, markers.get(a.number))),
      el('td', {}, el('time', { datetime: a.started_at || '' }, fmtDateTime(a.started_at))),
      el('td', {}, el('time', { datetime: a.ended_at || '' }, fmtDateTime(a.ended_at)))));
    const failure = failureRow(a);
    if (failure) rows.push(failure);
  }
  if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 7, class: 'muted' }, 'No attempt yet: the job is waiting for slots.')));
  replaceKeepingOpen(body, rows);
}

// ---------------------------------------------------------------- checkpoints (+ staff actions)

function checkpointState(c) {
  if (c.deleted) return 'deleted';
  if (c.superseded) return 'superseded';
  return 'active';
}

// Checkpoint JSON names its attempt by id (as metrics and events do); the table shows the attempt's number.
function attemptLabel(c) {
  const attempts = (state.job && state.job.attempts) || [];
  const a = attempts.find((x) => x.id === c.attempt);
  if (a) return `#${a.number}`;
  if (isNum(c.attempt_number)) return `#${c.attempt_number}`;
  return '–';
}

function checkpointActions(c) {
  if (!cfg.is_staff) return null;
  const buttons = [];
  if (!c.deleted) {
    buttons.push(el('button', { type: 'button', class: 'small warn', dataset: { action: 'rollback', id: c.id } },
      'Roll back'));
    buttons.push(el('button', { type: 'button', class: 'small ghost', dataset: { action: 'pin', id: c.id } },
      c.pinned ? 'Unpin' : 'Pin'));
  }
  return el('td', { class: 'actions-cell' }, buttons);
}

function checkpointRow(c) {
  const st = checkpointState(c);
  const dataset = { checkpoint: c.id, step: c.step, state: st, pinned: c.pinned ? '1' : '' };
  return el('tr', { class: `ck-${st}`, dataset },
    el('td', {}, `step ${c.step}`),
    el('td', {}, attemptLabel(c)),
    el('td', {}, el('time', { datetime: c.created_at || '', title: fmtDateTime(c.created_at) },
      fmtClock(c.created_at))),
    el('td', { class: 'num' }, fmtBytes(c.size_bytes)),
    el('td', { class: 'num' }, `${fmtSeconds(c.blocking_s)} / ${fmtSeconds(c.save_s)}`),
    el('td', { class: 'ck-badges' }, el('span', { class: `badge b-${st}` }, st),
      c.pinned ? el('span', { class: 'badge b-pinned' }, 'pinned') : ''),
    checkpointActions(c));
}

function renderCheckpoints() {
  const list = $('#checkpoints-body');
  const items = [...state.checkpoints.values()].sort((a, b) => b.step - a.step || (b.id || 0) - (a.id || 0));
  if (!items.length) {
    const colspan = cfg.is_staff ? 7 : 6;
    list.replaceChildren(el('tr', {}, el('td', { colspan, class: 'muted empty-state' }, 'No checkpoints yet.')));
    return;
  }
  list.replaceChildren(...items.map(checkpointRow));
}

function addCheckpoint(c) {
  if (!c || !Number.isInteger(c.step)) return;
  const key = c.id ?? `step:${c.step}`;
  state.checkpoints.set(key, { ...state.checkpoints.get(key), ...c });
}

function setNote(text, bad = false) {
  const note = $('#checkpoint-note');
  if (!note) return;
  note.textContent = text || '';
  note.hidden = !text;
  note.classList.toggle('bad', bad);
  if (bad) note.setAttribute('role', 'alert'); else note.removeAttribute('role');
}

let pendingRollback = null;

function askRollback(c) {
  pendingRollback = c;
  setNote('');
  $('#rollback-question').textContent =
    `Roll back job ${cfg.id} to step ${c.step}? The running attempt stops; later checkpoints are superseded.`;
  $('#rollback-confirm').hidden = false;
  $('#rollback-yes').disabled = false;
  $('#rollback-yes').focus();
}

function closeRollback() {
  pendingRollback = null;
  $('#rollback-confirm').hidden = true;
}

async function confirmRollback() {
  const c = pendingRollback;
  if (!c) return;
  $('#rollback-yes').disabled = true;
  const r = await postJSON(`/api/v1/jobs/${cfg.id}/rollback/`, { checkpoint: c.id });
  closeRollback();
  if (!r.ok) {
    setNote(`Roll back to step ${c.step} refused: ${errorText(r.data, r.status)}`, true);
    return;
  }
  setNote(`Rollback to step ${c.step} requested: the job restarts from that checkpoint.`);
  if (r.data && r.data.id === cfg.id) applyJob(r.data);
  refreshJobSoon();
}

async function togglePin(c, button) {
  button.disabled = true;
  const r = await postJSON(`/api/v1/jobs/${cfg.id}/checkpoints/${c.id}/pin/`, { pinned: !c.pinned });
  button.disabled = false;
  if (!r.ok) {
    setNote(`${c.pinned ? 'Unpin' : 'Pin'} of step ${c.step} refused: ${errorText(r.data, r.status)}`, true);
    return;
  }
  setNote('');
  addCheckpoint(r.data && Number.isInteger(r.data.step) ? r.data : { ...c, pinned: !c.pinned });
  renderCheckpoints();
}

function bindCheckpointActions() {
  if (!cfg.is_staff) return;
  $('#checkpoints-body').addEventListener('click', (ev) => {
    const b = ev.target.closest('button[data-action]');
    if (!b) return;
    const c = [...state.checkpoints.values()].find((x) => String(x.id) === b.dataset.id);
    if (!c) return;
    if (b.dataset.action === 'rollback') askRollback(c);
    else if (b.dataset.action === 'pin') togglePin(c, b);
  });
  $('#rollback-yes').addEventListener('click', confirmRollback);
  $('#rollback-no').addEventListener('click', closeRollback);
}

// ---------------------------------------------------------------- timeline

const KIND_CLASS = {
  attempt_started: 'ok', running: 'ok', succeeded: 'ok', straggler_cleared: 'ok', node_cleared: 'ok',
  failed: 'bad', hang_detected: 'bad', node_quarantined: 'bad', lost: 'bad',
  restart: 'warn', rollback: 'warn', straggler: 'warn', preempted: 'warn', cancelled: 'warn',
  preempt_requested: 'warn', preempt_forced: 'warn',
  checkpoint: 'info', checkpoint_saved: 'info', checkpoint_deleted: 'info', resumed: 'info',
};

// failures red, restarts/rollbacks amber, checkpoints/resumes blue, success green
function eventClass(e) {
  const kind = e.kind || '';
  if (kind === 'attempt_ended') return outcomeClass(e.data && e.data.outcome) || 'warn';
  if (KIND_CLASS[kind]) return KIND_CLASS[kind];
  if (/fail|lost|error|crash|hang|quarantin/i.test(kind)) return 'bad';
  if (/checkpoint|resum/i.test(kind)) return 'info';
  if (/rollback|restart|retry|preempt|cancel|stop|straggler|queue|drain/i.test(kind)) return 'warn';
  if (/succeed|finish|start|running|clear/i.test(kind)) return 'ok';
  return '';
}

function evidenceOf(e) {
  const data = e.data || {};
  const nonEmpty = (x) => !!x && typeof x === 'object' && Object.keys(x).length > 0;
  if (nonEmpty(data.evidence)) return data.evidence;
  return nonEmpty(data) ? data : null;
}

// Preemptions say why (and for whom, and where the job resumes) on a line of their own.
function preemptDetail(e) {
  if (!/^preempt/.test(e.kind || '')) return null;
  const d = e.data || {};
  const parts = [];
  if (d.reason && !(e.message || '').includes(d.reason)) {
    parts.push(el('span', { class: 'ev-reason' }, `why: ${d.reason}`));
  }
  if (isNum(d.for_job)) {
    parts.push(el('span', {}, 'for ', el('a', { href: `/jobs/${d.for_job}/` }, `job ${d.for_job}`)));
  }
  if (isNum(d.grace_s)) parts.push(`grace ${fmtSeconds(d.grace_s)}`);
  if (isNum(d.resume_step)) parts.push(d.resume_step ? `resumes from step ${d.resume_step}` : 'restarts from step 0');
  if (!parts.length) return null;
  return el('div', { class: 'ev-detail' }, parts.flatMap((p, i) => (i ? [' · ', p] : [p])));
}

function eventNode(e) {
  const cls = eventClass(e);
  const evidence = evidenceOf(e);
  return el('li', { class: cls ? `ev-${cls}` : '', dataset: { id: e.id ?? '', kind: e.kind || '' } },
    el('time', { datetime: e.created_at || '', title: fmtDateTime(e.created_at) }, fmtClock(e.created_at)),
    el('span', { class: `ev-kind kb-${cls || 'plain'}` }, e.kind || ''),
    el('span', { class: 'ev-msg' }, e.message || ''),
    preemptDetail(e),
    evidence ? el('details', { class: 'ev-evidence' }, el('summary', {}, 'evidence'),
      el('pre', {}, JSON.stringify(evidence, null, 2))) : '');
}

// Events never change once written, so each keeps its <li> (and any evidence the user expanded).
const eventNodes = new Map();

function renderEvents() {
  const list = $('#events');
  const items = [...state.events.entries()].sort(([, a], [, b]) => (b.id || 0) - (a.id || 0)).slice(0, 200);
  if (!items.length) {
    list.replaceChildren(el('li', { class: 'muted' }, 'No events yet.'));
    return;
  }
  list.replaceChildren(...items.map(([key, e]) => {
    if (!eventNodes.has(key)) eventNodes.set(key, eventNode(e));
    return eventNodes.get(key);
  }));
}

function addEvent(e) {
  if (!e) return;
  state.events.set(e.id ?? `${e.kind}:${e.created_at}`, e);
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
  if (store.metricNames.size) addUserCharts($('#charts'), store, charts);
  if (store.steps.length && !state.hasTelemetry) {
    state.hasTelemetry = true;
    renderTelemetry();
  }
  const ctx = { store, world: state.world, markers: state.markers };
  for (const c of Object.values(charts)) c.update(ctx);
  renderHeader();
}, 100);
const redrawEvents = frameThrottle(renderEvents, 200);

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
  renderAttempts(job.attempts);
  renderAlerts(job);
  profile.render(job.profile, job.status);
  renderCheckpoints();  // attempt numbers come from the job
  renderHeader();
  redrawCharts();
}

function onMessage(msg) {
  switch (msg.type) {
    case 'snapshot':
      for (const e of msg.events || []) addEvent(e);  // before the job: chart markers read rollback events
      for (const c of msg.checkpoints || []) addCheckpoint(c);
      applyJob(msg.job);
      store.merge(msg.samples, { downsampled: !!msg.downsampled });
      logs.reset(msg.logs || []);  // the live pane (hidden once the kept logs show)
      renderCheckpoints();
      redrawEvents();
      redrawCharts();
      break;
    case 'telemetry':
      store.merge(msg.samples);
      redrawCharts();
      break;
    case 'window':
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
      addEvent(msg.event);
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
      addCheckpoint(msg.checkpoint || msg);
      renderCheckpoints();
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
for (const e of readJSONScript('job-events') || []) addEvent(e);
for (const c of readJSONScript('job-checkpoints') || []) addCheckpoint(c);
setStatus(cfg.status);
renderEta();
setInterval(renderEta, 15000);
setInterval(renderTelemetry, 10000);  // "no telemetry yet" once a running attempt has been quiet for a while  // the prediction only moves when the server says so; "in ~N min" ticks here
renderHeader();
renderEvents();
renderCheckpoints();
bindCheckpointActions();

const socket = new LiveSocket(`/ws/jobs/${cfg.id}/`, { onMessage, onState: bindIndicator($('#live-indicator')) }).start();

// For the browser tests and for poking around in the console.
window.trainyard = {
  store, charts, socket, logs, kept, profile, state, onMessage,
  stats: () => store.stats(),
  chartSteps: (name) => charts[name].seriesSteps(),
};
