// The experiment page's live part (issue 25, section 2). The server renders
//   <div id="experiment-app" data-api="/api/v1/experiments/<id>/" data-experiment="<id>"></div>
// and loads this module, which reads the experiment JSON (DESIGN.md section 4, "Experiments":
// {id, name, status, search: {metric, mode, space, ...}, best: {job, values, metric} | null,
//  trials: [{job, values, status, metric, rung, steps}]}) and renders into that element:
//   - the trial table (values, status, best metric, steps, rung reached), sortable by any column;
//   - best-so-far over time, and every trial's metric curve overlaid (bucketed series API, at most
//     1,500 points a curve; static/js/overlay.js);
//   - parallel coordinates of the hyperparameters coloured by the metric (static/js/parcoords.js);
//   - "Submit best as a job": the best trial's spec POSTed to /api/v1/jobs/ (CSRF token, session).
// Live: a job socket (/ws/jobs/<id>/, static/js/live.js) per RUNNING trial appends its points as they
// arrive; the experiment JSON is re-read every POLL_MS and soon after a trial's status message, and
// the curves re-read from the series API when trials appear or change status.
import { LiveSocket } from './live.js';
import { overlayChart, fetchSeries, curveOf } from './overlay.js';
import { parallelCoordinates, metricColors } from './parcoords.js';
import { el, getJSON, postJSON, errorText, statusBadge, fmtNum, fmtDateTime, isNum, TERMINAL } from './util.js';

const POLL_MS = 5000;
const SERIES_REFRESH_MS = 30000; // curves of running trials re-read at least this often (sockets fill in between)
const MAX_LIVE = 8;              // job sockets open at once (each counts against TRAINYARD_MAX_SOCKETS_PER_USER)
const BEST_POINTS = 300;         // points a trial contributes to best-so-far over time
const COMPARE_MAX = 20;          // jobs the compare page takes (jobs/runs/views_compare.py MAX_COMPARE_JOBS)

const app = document.getElementById('experiment-app');

function ensureStyles() {
  for (const href of ['../vendor/uplot-1.6.32/uPlot.min.css', '../css/compare.css']) {
    const url = new URL(href, import.meta.url).href;
    if (![...document.querySelectorAll('link[rel=stylesheet]')].some((l) => l.href === url)) {
      document.head.append(el('link', { rel: 'stylesheet', href: url }));
    }
  }
}

const upper = (s) => String(s || '').toUpperCase();
const finished = (status) => TERMINAL.has(upper(status)) || upper(status) === 'EARLY_STOPPED';
const show = (v) => (v === null || v === undefined ? '–' : isNum(v) ? fmtNum(v, 4) : typeof v === 'string' ? v : JSON.stringify(v));

// ---------------------------------------------------------------- layout

function card(id, title, sub, ...body) {
  return el('section', { class: 'card', id }, el('h2', {}, title, sub ? ' ' : '', sub ? el('small', {}, sub) : ''), ...body);
}

function chartCard(id, title, sub) {
  return el('section', { class: 'card chart', id, dataset: { points: '0' } },
    el('div', { class: 'chart-head' }, el('h2', {}, title, ' ', el('small', {}, sub))),
    el('div', { class: 'chart-plot' }, el('p', { class: 'chart-empty' }, 'No trial has reported yet.')));
}

function layout() {
  // The server-rendered best trial and trial table are the page without this script: replaced here.
  const fallback = document.getElementById('experiment-static');
  if (fallback) fallback.hidden = true;
  app.replaceChildren(
    el('section', { class: 'card exp-best', id: 'exp-best' },
      el('span', { id: 'exp-status' }), el('span', { id: 'exp-best-text', class: 'muted' }, 'No best trial yet.'),
      el('button', { type: 'button', id: 'exp-submit-best', disabled: true }, 'Submit best as a job'),
      el('span', { id: 'exp-submit-result', 'aria-live': 'polite' }),
      el('a', { id: 'exp-compare', href: '#', hidden: true }, 'Compare the best trials')),
    card('exp-trials-card', 'Trials', 'click a column to sort',
      el('div', { class: 'table-scroll' }, el('table', { class: 'exp-trials', id: 'exp-trials' },
        el('thead', {}, el('tr')), el('tbody')))),
    el('div', { class: 'exp-grid' },
      chartCard('exp-curves', 'Every trial', 'the metric per step, coloured by each trial\'s best'),
      chartCard('exp-best-so-far', 'Best so far', 'over time since the first report')),
    card('exp-parcoords', 'Hyperparameters', 'one line per trial, coloured by its metric',
      el('div', { id: 'exp-parcoords-plot' })),
    el('p', { class: 'note', id: 'exp-note', hidden: true }));
}

// ---------------------------------------------------------------- state

const state = {
  exp: null,
  fetches: 0,
  seriesFetches: 0,
  seriesAt: 0,
  seriesKey: '',
  series: new Map(),   // job id -> {job, buckets, first_ts, ...} over step
  timeSeries: [],      // over time, for best-so-far
  live: new Map(),     // job id -> LiveSocket
  livePoints: 0,       // points appended from sockets
  sort: { key: 'job', dir: 1 },
  submitted: null,
};

function note(text) {
  const n = document.getElementById('exp-note');
  n.hidden = !text;
  n.textContent = text || '';
}

// ---------------------------------------------------------------- the trial table

function hyperparameters(exp) {
  const names = Object.keys((exp.search && exp.search.space) || {});
  for (const t of exp.trials || []) for (const k of Object.keys(t.values || {})) if (!names.includes(k)) names.push(k);
  return names;
}

function sortValue(t, key) {
  if (key.startsWith('v:')) return (t.values || {})[key.slice(2)];
  return t[key];
}

function compare(a, b) {
  const na = a === null || a === undefined, nb = b === null || b === undefined;
  if (na || nb) return na && nb ? 0 : na ? 1 : -1;  // no value: last, either way
  if (isNum(a) && isNum(b)) return a - b;
  return String(a).localeCompare(String(b));
}

function renderTable(exp) {
  const table = document.getElementById('exp-trials');
  const params = hyperparameters(exp);
  const metric = (exp.search && exp.search.metric) || 'metric';
  const cols = [['job', 'Trial'], ...params.map((p) => [`v:${p}`, p]), ['status', 'Status'],
    ['metric', `${metric} (best)`], ['steps', 'Steps'], ['rung', 'Rung']];
  const { key, dir } = state.sort;
  table.tHead.rows[0].replaceChildren(...cols.map(([k, title]) => el('th', {
    'data-sort': k, class: k === 'job' || k === 'status' ? null : 'num',
    'aria-sort': k === key ? (dir > 0 ? 'ascending' : 'descending') : null }, title)));
  const trials = [...(exp.trials || [])];
  trials.sort((a, b) => {
    const c = compare(sortValue(a, key), sortValue(b, key));
    // no value stays last whichever the direction; ties by trial
    if (sortValue(a, key) === null || sortValue(a, key) === undefined
      || sortValue(b, key) === null || sortValue(b, key) === undefined) return c || a.job - b.job;
    return dir * c || a.job - b.job;
  });
  const best = exp.best && exp.best.job;
  table.tBodies[0].replaceChildren(...trials.map((t) => el('tr', { 'data-job': t.job, 'data-status': t.status,
    class: t.job === best ? 'best' : null },
  el('td', {}, el('a', { href: `/jobs/${t.job}/` }, `#${t.job}`)),
  ...params.map((p) => el('td', { class: 'num' }, show((t.values || {})[p]))),
  el('td', {}, statusBadge(t.status), continueButton(exp, t)),
  el('td', { class: 'num' }, show(t.metric)),
  el('td', { class: 'num' }, show(t.steps)),
  el('td', { class: 'num' }, show(t.rung)))));
}

// An early-stopped trial's owner (or staff: data-can-change) may continue it from its checkpoint.
function continueButton(exp, t) {
  if (app.dataset.canChange !== '1' || t.status !== 'early_stopped' || exp.status === 'stopped' || !t.job) return '';
  const button = el('button', { type: 'button', class: 'exp-continue', 'data-job': t.job }, 'Continue');
  button.addEventListener('click', async () => {
    button.disabled = true;
    try {
      const r = await postJSON(`${app.dataset.api}trials/${t.job}/continue/`);
      if (!r.ok) throw new Error(errorText(r.data, r.status));
      refresh();
    } catch (err) {
      button.disabled = false;
      note(`Trial #${t.job} could not be continued: ${err.message}`);
    }
  });
  return button;
}

function bindSort() {
  document.getElementById('exp-trials').tHead.addEventListener('click', (ev) => {
    const th = ev.target.closest('th[data-sort]');
    if (!th) return;
    const k = th.dataset.sort;
    state.sort = { key: k, dir: state.sort.key === k ? -state.sort.dir : 1 };
    if (state.exp) renderTable(state.exp);
  });
}

// ---------------------------------------------------------------- header, best, submit

function renderHeader(exp) {
  document.getElementById('exp-status').replaceChildren(statusBadge(exp.status));
  const text = document.getElementById('exp-best-text');
  const button = document.getElementById('exp-submit-best');
  const b = exp.best;
  if (b && b.job) {
    const vals = Object.entries(b.values || {}).map(([k, v]) => `${k}=${show(v)}`).join(', ');
    text.replaceChildren('Best: ', el('a', { href: `/jobs/${b.job}/` }, `#${b.job}`),
      ` ${(exp.search && exp.search.metric) || 'metric'} ${show(b.metric)}`, vals ? ` (${vals})` : '');
    button.disabled = false;
    button.dataset.job = b.job;
  } else {
    text.textContent = 'No best trial yet.';
    button.disabled = true;
  }
  app.dataset.status = exp.status || '';
  // The compare page (at most COMPARE_MAX jobs): the trials with a metric, best first.
  const mode = (exp.search && exp.search.mode) || 'min';
  const ranked = (exp.trials || []).filter((t) => isNum(t.metric))
    .sort((a, b2) => (mode === 'max' ? b2.metric - a.metric : a.metric - b2.metric)).slice(0, COMPARE_MAX);
  const link = document.getElementById('exp-compare');
  link.hidden = ranked.length < 2;
  link.href = `/compare/?jobs=${ranked.map((t) => t.job).join(',')}&metric=${encodeURIComponent((exp.search && exp.search.metric) || '')}`;
}

async function submitBest() {
  const button = document.getElementById('exp-submit-best');
  const out = document.getElementById('exp-submit-result');
  const jobId = Number(button.dataset.job);
  if (!jobId) return;
  button.disabled = true;
  out.textContent = 'Submitting…';
  try {
    const job = await getJSON(`/api/v1/jobs/${jobId}/`);
    const spec = { ...job.spec, name: `${(state.exp && state.exp.name) || job.name}-best`.slice(0, 100) };
    const r = await postJSON('/api/v1/jobs/', spec);
    if (r.ok) {
      state.submitted = r.data.id;
      out.replaceChildren('Submitted ', el('a', { href: `/jobs/${r.data.id}/`, id: 'exp-submitted' }, `job ${r.data.id}`), '.');
    } else {
      out.textContent = `Not submitted: ${errorText(r.data, r.status)}`;
    }
  } catch (err) {
    out.textContent = `Not submitted: ${err.message}`;
  } finally {
    button.disabled = false;
  }
}

// ---------------------------------------------------------------- charts

let curvesChart = null, bestChart = null;

function colorFor(exp) {
  return metricColors((exp.trials || []).map((t) => t.metric), (exp.search && exp.search.mode) || 'min');
}

function renderCurves() {
  const exp = state.exp;
  if (!exp) return;
  const colorOf = colorFor(exp);
  const best = exp.best && exp.best.job;
  const curves = [];
  for (const t of exp.trials || []) {
    const s = state.series.get(t.job);
    if (!s || !s.buckets.length) continue;
    curves.push({ key: String(t.job), label: `#${t.job}`, color: colorOf(t.metric), width: t.job === best ? 3 : 1.4,
      ...curveOf(s) });
  }
  curvesChart.update({ curves, xLabel: 'step' });
  document.getElementById('exp-curves').dataset.curves = String(curves.length);
}

// Best so far over time: every trial's buckets (x = time) in time order, the running min (mode min: each
// bucket's min) or max, from the first report of any trial.
function bestSoFar(timeSeries, mode) {
  const pts = [];
  let t0 = Infinity;
  for (const s of timeSeries) {
    if (s.first_ts !== null && s.first_ts < t0) t0 = s.first_ts;
    for (const b of s.buckets) pts.push([b.x, mode === 'max' ? b.max : b.min]);
  }
  pts.sort((a, b) => a[0] - b[0]);
  const xs = [], ys = [];
  let best = null;
  for (const [x, v] of pts) {
    if (!isNum(v)) continue;
    if (best === null || (mode === 'max' ? v > best : v < best)) {
      best = v;
      xs.push(x - t0);
      ys.push(best);
    }
  }
  if (xs.length && pts.length) { // carry the best to the newest report
    const lastX = pts[pts.length - 1][0] - t0;
    if (lastX > xs[xs.length - 1]) { xs.push(lastX); ys.push(best); }
  }
  return { xs, ys };
}

function renderBest() {
  const exp = state.exp;
  if (!exp) return;
  const mode = (exp.search && exp.search.mode) || 'min';
  const { xs, ys } = bestSoFar(state.timeSeries, mode);
  const curves = xs.length ? [{ key: 'best', label: `best ${(exp.search && exp.search.metric) || ''} (s)`,
    color: '#3ecf8e', xs, ys, width: 2 }] : [];
  bestChart.update({ curves, xLabel: 'time' });
}

function renderParcoords() {
  const exp = state.exp;
  const plot = document.getElementById('exp-parcoords-plot');
  if (!exp || !(exp.trials || []).length) {
    plot.replaceChildren(el('p', { class: 'muted' }, 'No trials yet.'));
    return;
  }
  plot.replaceChildren(parallelCoordinates({ trials: exp.trials, space: (exp.search && exp.search.space) || {},
    metric: (exp.search && exp.search.metric) || 'metric', mode: (exp.search && exp.search.mode) || 'min' }));
}

async function refreshSeries(force = false) {
  const exp = state.exp;
  if (!exp || !exp.search || !exp.search.metric) return;
  const ids = (exp.trials || []).map((t) => t.job);
  const key = (exp.trials || []).map((t) => `${t.job}:${t.status}`).join(',');
  const running = (exp.trials || []).some((t) => !finished(t.status));
  const due = running && Date.now() - state.seriesAt > SERIES_REFRESH_MS;
  if (!ids.length || (!force && key === state.seriesKey && !due)) return;
  state.seriesKey = key;
  state.seriesAt = Date.now();
  try {
    const [bySteps, byTime] = await Promise.all([
      fetchSeries(ids, exp.search.metric, 'step'),
      fetchSeries(ids, exp.search.metric, 'time', BEST_POINTS)]);
    state.seriesFetches += 1;
    state.series = new Map(bySteps.series.map((s) => [s.job, s]));
    state.timeSeries = byTime.series;
  } catch (err) {
    note(`Could not read the trials' curves: ${err.message}`);
    state.seriesKey = '';
    return;
  }
  renderCurves();
  renderBest();
}

// ---------------------------------------------------------------- live: one socket per running trial

// A telemetry batch's value of the metric per step (mean over the ranks in the batch).
function stepValues(samples, metric) {
  const acc = new Map();
  for (const s of samples || []) {
    if (!s || !Number.isInteger(s.step)) continue;
    const v = metric in s ? s[metric] : s.metrics ? s.metrics[metric] : undefined;
    if (!isNum(v)) continue;
    const a = acc.get(s.step) || { sum: 0, n: 0, ts: s.ts };
    a.sum += v; a.n += 1; a.ts = Math.max(a.ts || 0, s.ts || 0);
    acc.set(s.step, a);
  }
  return [...acc.entries()].sort((a, b) => a[0] - b[0]).map(([step, a]) => ({ step, value: a.sum / a.n, ts: a.ts }));
}

// A message's reduced step rows (issue 26: {step, ts, <field>: [min, mean, max, n], metrics: {name:
// [min, last, max]}}): the metric's mean over every rank per step, or the lowest rank's user metric.
function rowValues(rows, metric) {
  const out = [];
  for (const r of rows || []) {
    if (!r || !Number.isInteger(r.step)) continue;
    const v = Array.isArray(r[metric]) ? r[metric][1] : r.metrics && Array.isArray(r.metrics[metric]) ? r.metrics[metric][1] : undefined;
    if (isNum(v)) out.push({ step: r.step, value: v, ts: r.ts });
  }
  return out.sort((a, b) => a.step - b.step);
}

// Appends live points after the trial's newest bucket (its series is re-read from the API later): from
// the message's reduced steps when it has them (every rank's), else from its samples.
function appendLive(jobId, msg) {
  const exp = state.exp;
  if (!exp || !exp.search) return;
  const points = Array.isArray(msg.steps) ? rowValues(msg.steps, exp.search.metric) : stepValues(msg.samples, exp.search.metric);
  if (!points.length) return;
  let s = state.series.get(jobId);
  if (!s) {
    s = { job: jobId, buckets: [], first_ts: points[0].ts };
    state.series.set(jobId, s);
  }
  const lastX = s.buckets.length ? s.buckets[s.buckets.length - 1].x : -Infinity;
  let added = 0;
  for (const p of points) {
    if (p.step <= lastX) continue;
    s.buckets.push({ x: p.step, min: p.value, max: p.value, last: p.value });
    added += 1;
  }
  if (added) {
    state.livePoints += added;
    scheduleCurves();
  }
}

let curvesTimer = null;
function scheduleCurves() {
  if (curvesTimer) return;
  curvesTimer = setTimeout(() => { curvesTimer = null; renderCurves(); }, 250);
}

let pollSoon = null;
function refreshSoon() {
  clearTimeout(pollSoon);
  pollSoon = setTimeout(refresh, 300);
}

function syncSockets(exp) {
  const running = new Set((exp.trials || []).filter((t) => upper(t.status) === 'RUNNING').map((t) => t.job));
  for (const [job, sock] of state.live) {
    if (!running.has(job)) {
      sock.stop();
      state.live.delete(job);
    }
  }
  for (const job of running) {
    if (state.live.has(job) || state.live.size >= MAX_LIVE) continue;
    const sock = new LiveSocket(`/ws/jobs/${job}/`, {
      onMessage: (msg) => {
        if (msg.type === 'telemetry' || msg.type === 'window') appendLive(job, msg);
        else if (msg.type === 'status') refreshSoon();
      },
    }).start();
    state.live.set(job, sock);
  }
}

// ---------------------------------------------------------------- the experiment

async function refresh() {
  let exp;
  try {
    exp = await getJSON(app.dataset.api);
  } catch (err) {
    note(`Could not read the experiment: ${err.message}`);
    return;
  }
  state.fetches += 1;
  note('');
  state.exp = exp;
  renderHeader(exp);
  renderTable(exp);
  renderParcoords();
  renderCurves();
  syncSockets(exp);
  await refreshSeries();
  app.dataset.ready = '1';
  app.dataset.trials = String((exp.trials || []).length);
  if (finished(exp.status) && !(exp.trials || []).some((t) => !finished(t.status))) {
    clearInterval(poller);  // nothing moves any more
    for (const sock of state.live.values()) sock.stop();
    state.live.clear();
  }
}

let poller = null;
if (app && app.dataset.api) {
  ensureStyles();
  layout();
  bindSort();
  curvesChart = overlayChart(document.getElementById('exp-curves'));
  bestChart = overlayChart(document.getElementById('exp-best-so-far'), { height: 240 });
  document.getElementById('exp-submit-best').addEventListener('click', submitBest);
  refresh();
  poller = setInterval(refresh, POLL_MS);
  // For the browser tests and the console.
  window.trainyardExperiment = { state, refresh, refreshSeries: () => refreshSeries(true),
    charts: { curves: curvesChart, best: bestChart }, bestSoFar, stepValues, fmtDateTime };
}
