// The compare page (/compare/?jobs=3,7,9; templates/jobs/compare.html): one metric of every job overlaid
// against step or time (bucketed series: at most 1,500 points a curve), the legend with each job's
// last/min/max; the spec diff is rendered by the server. The metric and axis live in the URL
// (?metric=&x=) so a comparison can be shared; jobs still running are re-read every 10 s.
import { overlayChart, fetchSeries, fetchMetricNames, curveOf, summary, jobColor } from './overlay.js';
import { $, $$, TERMINAL, fmtNum, readJSONScript } from './util.js';

const cfg = readJSONScript('compare-config');
const ids = cfg.jobs.map((j) => j.id);
const colors = new Map(cfg.jobs.map((j, i) => [j.id, jobColor(i)]));
const names = new Map(cfg.jobs.map((j) => [j.id, j.name]));
const chart = overlayChart($('#compare-chart'));
const params = new URLSearchParams(location.search);
const state = { metric: params.get('metric') || '', x: params.get('x') === 'time' ? 'time' : 'step',
  metrics: [], series: [], fetches: 0, statuses: new Map(cfg.jobs.map((j) => [j.id, j.status])) };

for (const sw of $$('#compare-legend .swatch')) sw.style.background = jobColor(Number(sw.dataset.index));

function note(text) {
  const n = $('#compare-note');
  n.hidden = !text;
  n.textContent = text || '';
}

function renderLegend() {
  const byJob = new Map(state.series.map((s) => [s.job, s]));
  for (const row of $$('#compare-legend tbody tr')) {
    const s = byJob.get(Number(row.dataset.job));
    const sum = summary(s);
    row.querySelector('.cmp-last').textContent = fmtNum(sum.last, 4);
    row.querySelector('.cmp-min').textContent = fmtNum(sum.min, 4);
    row.querySelector('.cmp-max').textContent = fmtNum(sum.max, 4);
    row.dataset.buckets = String(s ? s.buckets.length : 0);
    if (s) state.statuses.set(s.job, s.status);
  }
}

function render() {
  const curves = state.series.filter((s) => s.buckets.length).map((s) => ({
    key: String(s.job), label: `#${s.job} ${names.get(s.job) || s.name}`, color: colors.get(s.job),
    ...curveOf(s, { x: state.x }),
  }));
  chart.update({ curves, xLabel: state.x });
  const empty = $('#compare-chart .chart-empty');
  if (empty) {
    empty.hidden = curves.length > 0;
    empty.textContent = state.metric ? `No job reported ${state.metric}.` : 'These jobs reported no metric.';
  }
  const without = state.series.filter((s) => !s.buckets.length).map((s) => `#${s.job}`);
  note(without.length && curves.length ? `No ${state.metric} from ${without.join(', ')}.` : '');
  $('#compare-chart').dataset.curves = String(curves.length);
  renderLegend();
}

async function load() {
  if (!state.metric) return render();
  const q = new URLSearchParams(location.search);
  q.set('metric', state.metric);
  q.set('x', state.x);
  history.replaceState(null, '', `${location.pathname}?${q}`);
  try {
    const got = await fetchSeries(ids, state.metric, state.x, cfg.max_points);
    state.fetches += 1;
    state.series = got.series;
  } catch (err) {
    note(`Could not read the series: ${err.message}`);
    return;
  }
  render();
}

async function start() {
  const select = $('#compare-metric');
  try {
    state.metrics = (await fetchMetricNames(ids)).metrics;
  } catch (err) {
    note(`Could not read the metric names: ${err.message}`);
    return;
  }
  select.replaceChildren(...state.metrics.map((m) => new Option(m, m)));
  if (!state.metrics.includes(state.metric)) {
    state.metric = state.metrics.includes('loss') ? 'loss' : (state.metrics[0] || '');
  }
  select.value = state.metric;
  select.disabled = !state.metrics.length;
  $('#compare-x').value = state.x;
  select.addEventListener('change', () => { state.metric = select.value; load(); });
  $('#compare-x').addEventListener('change', (e) => { state.x = e.target.value; load(); });
  await load();
  document.body.dataset.compareReady = '1';
  setInterval(() => {
    if ([...state.statuses.values()].some((s) => !TERMINAL.has(s))) load();
  }, 10000);
}

start();

// For the browser tests and the console.
window.trainyardCompare = { chart, state, reload: load };
