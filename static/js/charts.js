// uPlot charts of the job page. Since issue 26 they are fed from two stores: the reduced steps
// (StepStore: every rank's min/mean/max per step, or per bucket of steps) drawn as a mean line over a
// min/max band, and the per-rank samples of the few named ranks (SampleStore: the slowest and fastest
// few, every rank of a small job) plus one rank picked for drill-down, drawn as lines by name. A chart
// never draws a line per rank of a big job. Each chart is rebuilt only when its set of series changes
// (a named rank changes); otherwise new points go in with setData, at most once per animation frame.
import uPlot from '../vendor/uplot-1.6.32/uPlot.esm.js';
import { fmtNum, fmtSeconds, fmtBytes } from './util.js';

export const PALETTE = ['#4fb3ff', '#ff9f43', '#3ecf8e', '#ff6b6b', '#c792ea', '#ffcc66', '#5ee6e6', '#f78fb3',
  '#a3be8c', '#9aa5ce'];
export const rankColor = (rank) => PALETTE[rank % PALETTE.length];

const FONT = '11px system-ui, sans-serif';
const axis = (extra = {}) => ({
  stroke: '#8b96a3', font: FONT, size: 44, gap: 4,
  grid: { stroke: 'rgba(139,150,163,0.14)', width: 1 },
  ticks: { stroke: 'rgba(139,150,163,0.25)', width: 1, size: 4 },
  ...extra,
});
// The x value in the legend: steps as they are, fractional seconds (a time axis) to 4 digits.
const fmtX = (v) => (Number.isInteger(v) ? String(v) : fmtNum(v, 4));
const xAxis = () => axis({ size: 30, values: (u, ticks) => ticks.map((t) => fmtNum(t, 3)) });

function line(label, stroke, extra = {}) {
  return { label, stroke, width: 1.5, spanGaps: true, points: { show: false }, ...extra };
}

// Vertical dashed lines where a newer attempt took over: ctx.markers = [{step, label}] with label
// "rollback" (an admin rolled the job back to that step) or "restart" (resumed after a failure).
const MARKER_COLORS = { rollback: '#ffcc66', restart: '#ff9f43' };

function drawMarkers(u, markers) {
  const { ctx, bbox } = u;
  const { min, max } = u.scales.x;
  if (!markers.length || min === null || max === null || min === undefined) return 0;
  const px = uPlot.pxRatio || window.devicePixelRatio || 1;
  let drawn = 0;
  ctx.save();
  ctx.beginPath();
  ctx.rect(bbox.left, bbox.top, bbox.width, bbox.height);
  ctx.clip();
  ctx.font = `${Math.round(10 * px)}px system-ui, sans-serif`;
  ctx.textBaseline = 'top';
  for (const m of markers) {
    if (m.step < min || m.step > max) continue;
    const color = MARKER_COLORS[m.label] || MARKER_COLORS.restart;
    const x = Math.round(u.valToPos(m.step, 'x', true)) + 0.5;
    ctx.strokeStyle = color;
    ctx.lineWidth = px;
    ctx.setLineDash([5 * px, 4 * px]);
    ctx.beginPath();
    ctx.moveTo(x, bbox.top);
    ctx.lineTo(x, bbox.top + bbox.height);
    ctx.stroke();
    ctx.setLineDash([]);
    ctx.fillStyle = color;
    // Label on the right of the line, or on its left near the right edge so it stays inside the plot.
    const right = x + 3 * px + ctx.measureText(m.label).width < bbox.left + bbox.width;
    ctx.textAlign = right ? 'left' : 'right';
    ctx.fillText(m.label, right ? x + 3 * px : x - 3 * px, bbox.top + 2 * px);
    drawn += 1;
  }
  ctx.restore();
  return drawn;
}

const markerKey = (markers) => markers.map((m) => `${m.label}@${m.step}`).join(',');

export class LiveChart {
  // define(ctx) -> {key, series, axes?, scales?}; data(ctx) -> [xs, ...ys] aligned arrays.
  // ctx.markers (optional) -> dashed vertical lines at those steps (drawMarkers).
  constructor(root, { define, data, height = 220 }) {
    this.root = root;
    this.define = define;
    this.dataFn = data;
    this.height = height;
    this.u = null;
    this.key = null;
    this.zoomed = false;
    this.points = 0;
    this.markers = [];
    this.markersDrawn = 0;
    this.target = root.querySelector('.chart-plot') || root;
    this.empty = root.querySelector('.chart-empty');
    if (window.ResizeObserver) {
      this.ro = new ResizeObserver(() => this._resize());
      this.ro.observe(this.target);
    }
    this.target.addEventListener('dblclick', () => { this.zoomed = false; });
  }

  _size() {
    const width = Math.max(200, Math.floor(this.target.clientWidth));
    const height = window.innerWidth < 640 ? Math.round(this.height * 0.8) : this.height;
    return { width, height };
  }

  _resize() {
    if (!this.u) return;
    const { width, height } = this._size();
    if (width !== this.u.width || height !== this.u.height) this.u.setSize({ width, height });
  }

  update(ctx) {
    const def = this.define(ctx);
    const data = this.dataFn(ctx);
    // `points`: what the lines of ranks hold (a chart of the reduced series only: all of it)
    let points = 0;
    for (let i = 1; i < data.length; i++) {
      if (def.counted && !def.counted.includes(i)) continue;
      for (const v of data[i]) if (v !== null && v !== undefined) points++;
    }
    this.points = points;
    this.root.dataset.points = String(points);
    if (def.bandIndex) {  // the reduced series' points, and which ranks are drawn by name
      let band = 0;
      for (const v of data[def.bandIndex]) if (v !== null && v !== undefined) band++;
      this.root.dataset.band = String(band);
      this.root.dataset.named = def.named || '';
    }
    this.root.dataset.steps = String(data[0].length);
    this.markers = ctx.markers || [];
    this.root.dataset.markers = markerKey(this.markers);
    if (this.empty) this.empty.hidden = data[0].length > 0;
    if (!data[0].length && !this.u) return;
    if (!this.u || def.key !== this.key) {
      if (this.u) this.u.destroy();
      this.key = def.key;
      this.zoomed = false;
      const opts = {
        ..._base(this._size()),
        series: [{ label: def.xLabel || 'step', value: (u, v) => (v === null || v === undefined ? '–' : fmtX(v)) }, ...def.series]
          .map(latestWhenIdle),
        axes: def.axes || [xAxis(), axis()],
        scales: { x: { time: false }, ...(def.scales || {}) },
        ...(def.bands ? { bands: def.bands } : {}),
        hooks: {
          setSelect: [(u) => { if (u.select.width > 2) this.zoomed = true; }],
          draw: [(u) => { this.markersDrawn = drawMarkers(u, this.markers); }],
        },
      };
      this.u = new uPlot(opts, data, this.target);
    } else {
      this.u.setData(data, !this.zoomed);
    }
  }

  // [{label, steps: [...]}] of the points actually drawn (tests read this through window.trainyard).
  seriesSteps() {
    if (!this.u) return [];
    const xs = this.u.data[0];
    return this.u.series.slice(1).map((s, i) => ({
      label: s.label,
      steps: xs.filter((_, j) => this.u.data[i + 1][j] !== null && this.u.data[i + 1][j] !== undefined),
    }));
  }
}

// With the cursor off the plot the legend shows each series' newest value instead of a dash.
function latestWhenIdle(series) {
  const fmt = series.value;
  if (!fmt) return series;
  return {
    ...series,
    value: (u, v, si, idx) => {
      if (idx === null || idx === undefined) {
        const col = u.data[si] || [];
        let i = col.length - 1;
        while (i >= 0 && (col[i] === null || col[i] === undefined)) i--;
        if (i < 0) return '–';
        return fmt(u, col[i], si, i);
      }
      return fmt(u, v, si, idx);
    },
  };
}

function _base({ width, height }) {
  return {
    width, height,
    padding: [10, 18, 0, 0],
    legend: { live: true },
    cursor: { drag: { x: true, y: false }, points: { size: 6 } },
  };
}

// ---------------------------------------------------------------- the job page's charts

// The union of two sorted step arrays.
export function unionSteps(a, b) {
  if (!b.length) return a;
  if (!a.length) return b;
  const out = [];
  let i = 0, j = 0;
  while (i < a.length || j < b.length) {
    const x = j >= b.length || (i < a.length && a[i] <= b[j]) ? a[i] : b[j];
    if (i < a.length && a[i] === x) i++;
    if (j < b.length && b[j] === x) j++;
    out.push(x);
  }
  return out;
}

// `col` (aligned with the sorted `steps`) aligned with `xs` (a sorted superset), null elsewhere.
function align(xs, steps, col) {
  if (steps === xs) return col;
  const out = new Array(xs.length).fill(null);
  let j = 0;
  for (let i = 0; i < steps.length; i++) {
    while (j < xs.length && xs[j] < steps[i]) j++;
    if (j < xs.length && xs[j] === steps[i]) out[j] = col[i];
  }
  return out;
}

// The ranks a per-rank chart draws by name: every rank of a small job (the server names them all),
// else the named slowest and fastest few; [{rank, role}].
export function rankLinesOf({ store, steps }) {
  const named = steps && steps.named;
  if ((named && named.all) || (!named && store.ranks.size <= 8)) {
    return store.sortedRanks().map((rank) => ({ rank, role: '' }));
  }
  return steps ? steps.namedRanks() : [];
}

const BAND_FILL = 'rgba(139,150,163,0.22)';
const ROLE_COLOR = { slowest: ['#ff6b6b', '#ff9f43', '#ffcc66'], fastest: ['#3ecf8e', '#5ee6e6', '#a3be8c'] };

// The reduced series of a metric as a min/max band around the mean line, plus a line per named rank and
// one for the rank picked for drill-down (ctx.drill: {rank, values: {key: Map(step -> value)}}).
// band(steps) -> {lo, mean, hi} aligned with steps.steps; column(store, rank) -> aligned with store.steps.
function bandChart(root, key, band, column, { value, tick, size, scales, meanLabel = 'mean over ranks' }) {
  return new LiveChart(root, {
    define: (ctx) => {
      const lines = rankLinesOf(ctx);
      const colors = { slowest: 0, fastest: 0 };
      const drill = ctx.drill && Number.isInteger(ctx.drill.rank) ? ctx.drill.rank : null;
      const rankSeries = lines.map(({ rank, role }) => {
        const color = role ? ROLE_COLOR[role][colors[role]++ % 3] : rankColor(rank);
        return line(role ? `rank ${rank} · ${role}` : `rank ${rank}`, color, { value: (u, v) => value(v) });
      });
      const faint = (label) => line(label, 'rgba(139,150,163,0.5)', { width: 1, value: (u, v) => value(v) });
      const series = [faint('min over ranks'), faint('max over ranks'),
        line(meanLabel, '#e6e9ec', { width: 2, value: (u, v) => value(v) }), ...rankSeries];
      if (drill !== null) series.push(line(`rank ${drill} · picked`, '#c792ea', { width: 2, dash: [6, 3], value: (u, v) => value(v) }));
      const counted = series.map((_, i) => i + 1).filter((i) => i > 3);
      return {
        key: `${lines.map((l) => `${l.rank}${l.role}`).join(',')}|${drill}`,
        series, counted, bandIndex: 3, bands: [{ series: [2, 1], fill: BAND_FILL }],
        named: lines.filter((l) => l.role).map((l) => `${l.role}:${l.rank}`).join(','),
        ...(scales ? { scales } : {}),
        axes: [xAxis(), axis({ values: (u, t) => t.map((v) => tick(v)), ...(size ? { size } : {}) })],
      };
    },
    data: (ctx) => {
      const { store, steps } = ctx;
      const drill = ctx.drill && Number.isInteger(ctx.drill.rank) ? ctx.drill : null;
      const drilled = drill && drill.values[key];
      let xs = unionSteps(steps.steps, store.steps);
      if (drilled) xs = unionSteps(xs, [...drilled.keys()].sort((a, b) => a - b));
      const b = band(steps);
      const out = [xs, align(xs, steps.steps, b.lo), align(xs, steps.steps, b.hi), align(xs, steps.steps, b.mean),
        ...rankLinesOf(ctx).map(({ rank }) => align(xs, store.steps, column(store, rank)))];
      if (drill) out.push(xs.map((x) => (drilled && drilled.has(x) ? drilled.get(x) : null)));
      return out;
    },
  });
}

export function lossChart(root) {
  return bandChart(root, 'loss', (steps) => steps.band('loss'), (store, r) => store.column(r, 'loss'),
    { value: (v) => fmtNum(v, 4), tick: (v) => fmtNum(v, 3) });
}

// Job samples/s per step (thin) and its moving average (thick). Tokens/s is samples/s times the
// tokens per sample, so it is the same curve: the right axis labels it instead of drawing it twice.
const AVG_STEPS = 20;

function movingAverage(values, n) {
  const out = new Array(values.length).fill(null);
  let sum = 0, count = 0;
  const win = [];
  values.forEach((v, i) => {
    win.push(v);
    if (v !== null) { sum += v; count++; }
    if (win.length > n) {
      const old = win.shift();
      if (old !== null) { sum -= old; count--; }
    }
    out[i] = count ? sum / count : null;
  });
  return out;
}

export function throughputChart(root) {
  let tokensPerSample = null;
  return new LiveChart(root, {
    define: () => ({
      key: 'tp',
      series: [
        line('samples/s', 'rgba(79,179,255,0.45)', { width: 1, value: (u, v) => fmtNum(v) }),
        line(`avg of ${AVG_STEPS} steps`, '#4fb3ff', { width: 2.5, value: (u, v) => fmtNum(v) }),
      ],
      scales: { y: { auto: true, range: (u, min, max) => [0, max * 1.1 || 1] } },
      axes: [xAxis(),
        axis({ values: (u, t) => t.map((v) => fmtNum(v, 3)), stroke: '#4fb3ff', label: 'samples/s',
          labelSize: 14, labelFont: FONT }),
        axis({ side: 1, grid: { show: false }, stroke: '#3ecf8e', label: 'tokens/s', labelSize: 14, labelFont: FONT,
          values: (u, t) => t.map((v) => (tokensPerSample ? fmtNum(v * tokensPerSample, 3) : '')) })],
    }),
    data: ({ steps, world }) => {
      const sps = steps.totalColumn('samples_per_s', world);
      const tps = steps.totalColumn('tokens_per_s', world);
      for (let i = sps.length - 1; i >= 0; i--) {
        if (sps[i] && tps[i]) { tokensPerSample = tps[i] / sps[i]; break; }
      }
      return [steps.steps, sps, movingAverage(sps, AVG_STEPS)];
    },
  });
}

// Stacked: each band is drawn as its cumulative sum filled to zero, top band first, so the visible
// slice of each colour is that phase's share; the legend shows the phase's own (not cumulative) time.
const PHASES = [['optim_s', 'optimizer', '#c792ea'], ['comm_s', 'communication', '#ff9f43'],
  ['compute_s', 'compute', '#4fb3ff'], ['data_s', 'data', '#3ecf8e']];

export function breakdownChart(root) {
  let raw = {};
  return new LiveChart(root, {
    define: () => ({
      key: 'bd',
      series: [
        line('step (total)', '#e6e9ec', { width: 1, dash: [4, 3], value: (u, v) => fmtSeconds(v) }),
        ...PHASES.map(([field, label, color]) => ({
          label, stroke: color, fill: color + 'c0', width: 1, spanGaps: true, points: { show: false },
          value: (u, v, si, idx) => (idx === null || idx === undefined ? '–' : fmtSeconds(raw[field]?.[idx])),
        })),
      ],
      scales: { y: { auto: true, range: (u, min, max) => [0, max * 1.1 || 1] } },
      axes: [xAxis(), axis({ values: (u, t) => t.map((v) => fmtSeconds(v)), size: 56 })],
    }),
    data: ({ steps: store }) => {
      raw = {};
      for (const [field] of PHASES) raw[field] = store.meanColumn(field);
      // cumulative from the bottom band (data) up to the top band (optimizer)
      const order = [...PHASES].reverse();
      const cum = {};
      let acc = store.steps.map(() => 0);
      for (const [field] of order) {
        acc = acc.map((a, i) => (raw[field][i] === null ? a : a + raw[field][i]));
        cum[field] = acc.map((a, i) => (raw[field][i] === null ? null : a));
      }
      return [store.steps, store.meanColumn('step_s'), ...PHASES.map(([field]) => cum[field])];
    },
  });
}

// A per-rank field from zero: step time, bytes sent, batch share (band, named ranks, the picked rank).
function perRankChart(root, field, fmt) {
  return bandChart(root, field, (steps) => steps.band(field), (store, r) => store.column(r, field), {
    value: fmt, tick: fmt, size: 56,
    scales: { y: { auto: true, range: (u, min, max) => [0, max * 1.1 || 1] } },
  });
}

// One of the user's own metrics (run.log(step, name=value) in the SDK): the lowest reporting rank's value
// over the whole run with its min/max band, and the named ranks' lines; the y range follows the data (a
// metric may be negative or far from zero).
export function userMetricChart(root, name) {
  return bandChart(root, `metric:${name}`, (steps) => steps.metricBand(name), (store, r) => store.metricColumn(r, name),
    { value: (v) => fmtNum(v, 4), tick: (v) => fmtNum(v, 3), size: 56, meanLabel: 'lowest rank' });
}

export function rankStepChart(root) {
  return perRankChart(root, 'step_s', fmtSeconds);
}

// Bytes each rank handed to gradient/model collectives per step: compression shows as a drop after
// comm.start_step, local SGD as spikes on averaging steps only.
export function bytesChart(root) {
  return perRankChart(root, 'bytes_sent', fmtBytes);
}

// train.balance auto: each rank's fraction of the global batch (sums to 1 over ranks).
export function shareChart(root) {
  return perRankChart(root, 'share', (v) => (v === null || v === undefined ? '–' : `${(v * 100).toFixed(1)}%`));
}

// Chart markers from the job's attempts: every attempt after the first that resumed from a checkpoint
// marks the step it resumed at, labelled "rollback" when an admin rolled the job back there, else
// "restart" (failure, lost node, preemption). A rollback shows as: the attempt before ended
// rolled_back (the job was running), or it had ended succeeded/cancelled (only a rollback runs a finished
// job again), or a `rollback` event falls between the two attempts (a job that had FAILED for good).
const ROLLBACK_AFTER = new Set(['rolled_back', 'succeeded', 'cancelled']);

function rollbackBetween(prev, a, rollbacks) {
  const from = Date.parse(prev.ended_at || '');
  const to = Date.parse(a.created_at || a.started_at || '');
  if (Number.isNaN(from) || Number.isNaN(to)) return false;
  return rollbacks.some((e) => {
    const t = Date.parse(e.created_at || '');
    return t >= from && t <= to;
  });
}

export function attemptMarkers(attempts, events = []) {
  const byNumber = new Map((attempts || []).map((a) => [a.number, a]));
  const rollbacks = (events || []).filter((e) => e && e.kind === 'rollback');
  const out = [];
  for (const a of attempts || []) {
    if (!(a.number > 1) || a.resumed_from_step === null || a.resumed_from_step === undefined) continue;
    const prev = byNumber.get(a.number - 1);
    const rollback = !!prev && (ROLLBACK_AFTER.has(prev.outcome) || prev.stop_reason === 'rollback'
      || rollbackBetween(prev, a, rollbacks));
    out.push({ step: a.resumed_from_step, label: rollback ? 'rollback' : 'restart', attempt: a.number });
  }
  return out.sort((x, y) => x.step - y.step || x.attempt - y.attempt);
}
