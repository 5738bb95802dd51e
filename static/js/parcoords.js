// Parallel coordinates in plain SVG (no library): one vertical axis per hyperparameter and one for the
// metric, one line per trial coloured by its metric. Axes follow the search space when it says how:
// {choice: [...]} is categorical, {loguniform: [lo, hi]} logarithmic, {uniform|int: [lo, hi]} linear;
// a dimension the space does not describe is linear when all its values are numbers, else categorical.
import { fmtNum, isNum } from './util.js';

const NS = 'http://www.w3.org/2000/svg';
const W = 900, H = 320, TOP = 34, BOTTOM = 26, SIDE = 60;

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const label = (v) => (isNum(v) ? fmtNum(v, 4) : typeof v === 'string' ? v : JSON.stringify(v));

// -> {name, kind: 'linear'|'log'|'category', lo, hi, cats, pos(value) -> 0..1 | null}
export function axisFor(name, spec, values) {
  const present = values.filter((v) => v !== null && v !== undefined);
  if (spec && Array.isArray(spec.choice)) {
    const cats = [...spec.choice.map(label)];
    for (const v of present) if (!cats.includes(label(v))) cats.push(label(v));
    return category(name, cats);
  }
  const range = spec && (spec.loguniform || spec.uniform || spec.int);
  const nums = present.filter(isNum);
  if (Array.isArray(range) || (present.length && nums.length === present.length)) {
    let lo = Math.min(...nums, ...(Array.isArray(range) ? range : []));
    let hi = Math.max(...nums, ...(Array.isArray(range) ? range : []));
    const log = !!(spec && spec.loguniform) && lo > 0;
    if (!Number.isFinite(lo) || !Number.isFinite(hi)) { lo = 0; hi = 1; }
    const f = log ? Math.log : (v) => v;
    const a = f(lo), b = f(hi);
    return { name, kind: log ? 'log' : 'linear', lo, hi, cats: null,
      pos: (v) => (isNum(v) && (!log || v > 0) ? (b === a ? 0.5 : (f(v) - a) / (b - a)) : null) };
  }
  return category(name, [...new Set(present.map(label))]);
}

function category(name, cats) {
  return { name, kind: 'category', lo: null, hi: null, cats,
    pos: (v) => {
      if (v === null || v === undefined) return null;
      const i = cats.indexOf(label(v));
      if (i < 0) return null;
      return cats.length === 1 ? 0.5 : i / (cats.length - 1);
    } };
}

// Good (0) to bad (1): green through yellow to red.
export function rampColor(t) {
  const x = Math.max(0, Math.min(1, t));
  return `hsl(${Math.round(150 - 150 * x)}, 70%, 55%)`;
}

// -> a function from a metric value to a colour (mode min: lower is greener), grey for none.
export function metricColors(metrics, mode = 'min') {
  const nums = metrics.filter(isNum);
  const lo = Math.min(...nums), hi = Math.max(...nums);
  return (m) => {
    if (!isNum(m)) return '#5b6570';
    const t = hi === lo ? 0 : (m - lo) / (hi - lo);
    return rampColor(mode === 'max' ? 1 - t : t);
  };
}

// trials: [{job, values, metric}]; space: the search space; metric: its name; returns the <svg>.
export function parallelCoordinates({ trials, space = {}, metric = 'metric', mode = 'min', color }) {
  const dims = Object.keys(space || {});
  for (const t of trials) for (const k of Object.keys(t.values || {})) if (!dims.includes(k)) dims.push(k);
  const axes = dims.map((d) => axisFor(d, space[d], trials.map((t) => (t.values || {})[d])));
  axes.push({ ...axisFor(`${metric} (${mode})`, null, trials.map((t) => (isNum(t.metric) ? t.metric : null))),
    metricAxis: true });
  const colorOf = color || metricColors(trials.map((t) => t.metric), mode);
  const step = axes.length > 1 ? (W - 2 * SIDE) / (axes.length - 1) : 0;
  const xAt = (i) => (axes.length > 1 ? SIDE + i * step : W / 2);
  const yAt = (p) => TOP + (1 - p) * (H - TOP - BOTTOM);
  const root = svg('svg', { class: 'parcoords', viewBox: `0 0 ${W} ${H}`, role: 'img',
    'aria-label': `parallel coordinates of ${dims.length} hyperparameters and ${metric}` });
  const lines = svg('g', { class: 'trials' });
  for (const t of trials) {
    const pts = [];
    axes.forEach((a, i) => {
      const p = a.pos(a.metricAxis ? t.metric : (t.values || {})[a.name]);
      if (p !== null) pts.push(`${xAt(i).toFixed(1)},${yAt(p).toFixed(1)}`);
    });
    if (!pts.length) continue;
    const desc = [`#${t.job}`, ...dims.map((d) => `${d}=${label((t.values || {})[d])}`),
      `${metric}=${isNum(t.metric) ? fmtNum(t.metric, 4) : '–'}`].join('  ');
    lines.append(svg('polyline', { class: `trial${isNum(t.metric) ? '' : ' none'}`, points: pts.join(' '),
      stroke: colorOf(t.metric), 'data-job': t.job }, svg('title', {}, desc)));
  }
  root.append(lines);
  axes.forEach((a, i) => {
    const g = svg('g', { class: 'axis', 'data-axis': a.metricAxis ? '' : a.name, transform: `translate(${xAt(i)},0)` });
    g.append(svg('line', { x1: 0, x2: 0, y1: TOP, y2: H - BOTTOM }));
    g.append(svg('text', { x: 0, y: TOP - 16, 'text-anchor': 'middle', 'font-weight': 600 },
      a.name.length > 22 ? `${a.name.slice(0, 21)}…` : a.name));
    const ticks = a.kind === 'category' ? a.cats.map((c) => [c, a.pos(c)])
      : [[a.hi, 1], [a.lo, 0]].map(([v, p]) => [label(v), p]);
    for (const [text, p] of ticks) {
      if (p === null) continue;
      g.append(svg('text', { x: 5, y: yAt(p) + 4 }, text));
    }
    root.append(g);
  });
  return root;
}
