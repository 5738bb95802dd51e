// Curves of several jobs on one chart, read from the bucketed series API (jobs/telemetry/api_series.py):
// the compare page (compare.js) and the experiment page (experiment.js) share this.
import uPlot from '../vendor/uplot-1.6.32/uPlot.esm.js';
import { LiveChart, PALETTE } from './charts.js';
import { fmtNum, getJSON } from './util.js';

export const SERIES_BATCH = 50; // the API's cap on jobs per request (api_series.MAX_SERIES_JOBS)

// One colour per job: the charts' palette, then evenly spread hues past it.
export function jobColor(i) {
  if (i < PALETTE.length) return PALETTE[i];
  return `hsl(${Math.round((i * 137.508) % 360)}, 70%, 62%)`;
}

// GET /api/v1/series/ for any number of jobs (in batches of SERIES_BATCH) -> {series: [...], missing: [...]}.
export async function fetchSeries(ids, metric, x = 'step', points = 1500) {
  const out = { series: [], missing: [] };
  for (let i = 0; i < ids.length; i += SERIES_BATCH) {
    const q = new URLSearchParams({ jobs: ids.slice(i, i + SERIES_BATCH).join(','), metric, x, points: String(points) });
    const body = await getJSON(`/api/v1/series/?${q}`);
    out.series.push(...body.series);
    out.missing.push(...body.missing);
  }
  return out;
}

// GET /api/v1/series/metrics/ -> {metrics: [union], jobs: {id: [...]}, missing: [...]}.
export async function fetchMetricNames(ids) {
  const out = { metrics: new Set(), jobs: {}, missing: [] };
  for (let i = 0; i < ids.length; i += SERIES_BATCH) {
    const body = await getJSON(`/api/v1/series/metrics/?jobs=${ids.slice(i, i + SERIES_BATCH).join(',')}`);
    for (const m of body.metrics) out.metrics.add(m);
    Object.assign(out.jobs, body.jobs);
    out.missing.push(...body.missing);
  }
  return { metrics: [...out.metrics].sort(), jobs: out.jobs, missing: out.missing };
}

// A series' buckets as a curve: xs (steps, or seconds since `t0`), ys (each bucket's last value).
export function curveOf(s, { x = 'step', t0 = null } = {}) {
  const base = x === 'time' ? (t0 ?? s.first_ts ?? 0) : 0;
  return { xs: s.buckets.map((b) => b.x - base), ys: s.buckets.map((b) => b.last) };
}

// {last, min, max} of a series: the newest bucket's last value, the extremes of every bucket.
export function summary(s) {
  if (!s || !s.buckets.length) return { last: null, min: null, max: null };
  let min = Infinity, max = -Infinity;
  for (const b of s.buckets) {
    if (b.min < min) min = b.min;
    if (b.max > max) max = b.max;
  }
  return { last: s.buckets[s.buckets.length - 1].last, min, max };
}

// ctx.curves = [{key, label, color, xs, ys, width?}]; ctx.xLabel names the x axis in the legend.
export function overlayChart(root, { height = 300 } = {}) {
  return new LiveChart(root, {
    height,
    define: ({ curves, xLabel }) => ({
      key: `${xLabel}|${curves.map((c) => `${c.key}:${c.color}`).join(',')}`,
      xLabel: xLabel === 'time' ? 'seconds' : xLabel,
      series: curves.map((c) => ({
        label: c.label, stroke: c.color, width: c.width || 1.6, spanGaps: true, points: { show: false },
        value: (u, v) => fmtNum(v, 4),
      })),
    }),
    data: ({ curves }) => {
      const tables = curves.map((c) => [c.xs, c.ys]);
      if (!tables.length) return [[]];
      return tables.length === 1 ? tables[0] : uPlot.join(tables);
    },
  });
}
