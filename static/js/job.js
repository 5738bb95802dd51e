// Job detail page: everything after the first paint arrives over /ws/jobs/<id>/ (no metric polling).
// The only HTTP request it makes is one GET of the job on a `status` message, to refresh attempts.
import { LiveSocket, bindIndicator } from './live.js';
import { SampleStore } from './store.js';
import { lossChart, throughputChart, breakdownChart, rankStepChart } from './charts.js';
import { LogPane } from './logs.js';
import { $, $$, el, TERMINAL, fmtNum, fmtSeconds, fmtBytes, fmtClock, fmtDateTime, frameThrottle, getJSON,
  readJSONScript, statusBadge, isNum } from './util.js';

const cfg = readJSONScript('job-config');
const store = new SampleStore({ maxSteps: 2000 });
const charts = {
  loss: lossChart($('#chart-loss')),
  throughput: throughputChart($('#chart-throughput')),
  breakdown: breakdownChart($('#chart-breakdown')),
  ranks: rankStepChart($('#chart-ranks')),
};
const logs = new LogPane($('#log-tabs'), $('#log-pane'));
const state = {
  job: null,
  status: cfg.status,
  step: cfg.step,
  world: cfg.world,
  events: new Map(),       // id -> event
  checkpoints: new Map(),  // step -> checkpoint
  statusMessages: 0,
  jobFetches: 0,
};

// ---------------------------------------------------------------- header

function setStatus(status, reason) {
  if (status) {
    state.status = status;
    const badge = $('#job-status');
    badge.replaceChildren(statusBadge(status));
    document.body.dataset.jobStatus = status;
  }
  if (reason !== undefined && reason !== null) $('#job-reason').textContent = reason;
  const cancel = $('#cancel-form');
  if (cancel) cancel.hidden = !cfg.can_cancel || TERMINAL.has(state.status) || state.status === 'STOPPING';
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
}

// ---------------------------------------------------------------- attempts, checkpoints, events

function ranksCell(ranks) {
  if (!ranks || !ranks.length) return el('span', { class: 'muted' }, '–');
  return el('ul', { class: 'ranks' }, ranks.map((r) => el('li', {},
    el('b', {}, `r${r.rank}`), ` ${r.node}`, r.pid ? el('span', { class: 'muted' }, ` pid ${r.pid}`) : '')));
}

function renderAttempts(attempts) {
  const body = $('#attempts-body');
  if (!body) return;
  const rows = [];
  const sorted = [...(attempts || [])].sort((a, b) => b.number - a.number);
  for (const a of sorted) {
    const f = a.failure || {};
    rows.push(el('tr', { dataset: { attempt: a.id } },
      el('td', {}, `#${a.number}`),
      el('td', {}, statusBadge(a.status)),
      el('td', {}, a.outcome || (a.status === 'ENDED' ? '' : '…'), a.stop_reason ? el('div', { class: 'muted' }, a.stop_reason) : ''),
      el('td', {}, ranksCell(a.ranks)),
      el('td', {}, a.resumed_from_step === null || a.resumed_from_step === undefined ? 'start' : `step ${a.resumed_from_step}`),
      el('td', {}, el('time', { datetime: a.started_at || '' }, fmtDateTime(a.started_at))),
      el('td', {}, el('time', { datetime: a.ended_at || '' }, fmtDateTime(a.ended_at)))));
    if (f.message || f.traceback || f.class) {
      const where = [f.rank !== undefined && f.rank !== null ? `rank ${f.rank}` : '', f.node || ''].filter(Boolean).join(' on ');
      rows.push(el('tr', { class: 'failure-row' }, el('td', {}), el('td', { colspan: 6 },
        el('details', {}, el('summary', {}, el('b', {}, f.class || 'failure'), where ? ` (${where})` : '', ': ', f.message || ''),
          el('pre', { class: 'tb' }, f.traceback || '(no traceback captured)')))));
    }
  }
  if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 7, class: 'muted' }, 'No attempt yet: the job is waiting for slots.')));
  body.replaceChildren(...rows);
}

function renderCheckpoints() {
  const list = $('#checkpoints-body');
  const items = [...state.checkpoints.values()].sort((a, b) => b.step - a.step);
  if (!items.length) {
    list.replaceChildren(el('tr', {}, el('td', { colspan: 5, class: 'muted empty-state' }, 'No checkpoints yet.')));
    return;
  }
  list.replaceChildren(...items.map((c) => el('tr', { class: c.superseded ? 'muted' : '' },
    el('td', {}, `step ${c.step}`), el('td', {}, fmtBytes(c.size_bytes)),
    el('td', {}, fmtSeconds(c.blocking_s)), el('td', {}, fmtSeconds(c.save_s)),
    el('td', {}, el('time', { datetime: c.created_at || '' }, fmtClock(c.created_at))))));
}

function eventKindClass(kind) {
  if (/fail|lost|error|crash/i.test(kind)) return 'ev-bad';
  if (/succeed|finish|start|running/i.test(kind)) return 'ev-ok';
  if (/cancel|stop|queue|restart|retry/i.test(kind)) return 'ev-warn';
  return '';
}

function renderEvents() {
  const list = $('#events');
  const items = [...state.events.values()].sort((a, b) => (b.id || 0) - (a.id || 0)).slice(0, 200);
  if (!items.length) {
    list.replaceChildren(el('li', { class: 'muted' }, 'No events yet.'));
    return;
  }
  list.replaceChildren(...items.map((e) => el('li', { class: eventKindClass(e.kind || ''), dataset: { id: e.id } },
    el('time', { datetime: e.created_at || '' }, fmtClock(e.created_at)),
    el('span', { class: 'ev-kind' }, e.kind || ''), el('span', { class: 'ev-msg' }, e.message || ''))));
}

function addEvent(e) {
  if (!e) return;
  state.events.set(e.id ?? `${e.kind}:${e.created_at}`, e);
}

function addCheckpoint(c) {
  if (!c || !Number.isInteger(c.step)) return;
  state.checkpoints.set(c.step, { ...state.checkpoints.get(c.step), ...c });
}

// ---------------------------------------------------------------- socket messages

const redrawCharts = frameThrottle(() => {
  const ctx = { store, world: state.world };
  for (const c of Object.values(charts)) c.update(ctx);
  renderHeader();
}, 100);
const redrawEvents = frameThrottle(renderEvents, 200);

let fetchTimer = null;
function refreshJobSoon() {
  // One GET per burst of status messages: attempts/ranks/failure live on the job, not in the message.
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
  const res = (job.spec && job.spec.resources) || {};
  if (res.nodes && res.procs_per_node) state.world = res.nodes * res.procs_per_node;
  if (isNum(job.step)) state.step = Math.max(state.step || 0, job.step);
  setStatus(job.status, job.status_reason || '');
  $('#job-restarts').textContent = String(job.restarts ?? 0);
  const qp = $('#job-queue');
  if (qp) qp.textContent = job.queue_position ? `#${job.queue_position} in queue` : '';
  renderAttempts(job.attempts);
  renderHeader();
}

function onMessage(msg) {
  switch (msg.type) {
    case 'snapshot':
      applyJob(msg.job);
      store.merge(msg.samples, { downsampled: !!msg.downsampled });
      logs.reset(msg.logs || []);
      for (const e of msg.events || []) addEvent(e);
      for (const c of msg.checkpoints || []) addCheckpoint(c);
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
renderHeader();

const socket = new LiveSocket(`/ws/jobs/${cfg.id}/`, { onMessage, onState: bindIndicator($('#live-indicator')) }).start();

// For the browser tests and for poking around in the console.
window.trainyard = {
  store, charts, socket, logs, state,
  stats: () => store.stats(),
  chartSteps: (name) => charts[name].seriesSteps(),
};
