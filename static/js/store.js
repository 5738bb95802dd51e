// Per-step telemetry of one job, merged by key (attempt, rank, step) so a snapshot after a reload or
// reconnect, a downsampled `window` and live `telemetry` batches overlap without duplicates or gaps.
//
// Rows are indexed by step; each row holds at most one sample per rank. A newer attempt (restart
// from a checkpoint) replaces the older attempt's samples from the step it resumed at, so charts show
// the run as it is now, not two overlapping timelines. The number of steps is bounded: past
// `maxSteps` every other step is dropped (the newest step always stays), so each chart series keeps
// at most `maxSteps` points however long the job runs.

// Insert `value` into the ascending array `arr` (appending is the common case: steps arrive in order).
function insertSorted(arr, value) {
  if (!arr.length || arr[arr.length - 1] < value) {
    arr.push(value);
    return;
  }
  let lo = 0, hi = arr.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (arr[mid] < value) lo = mid + 1; else hi = mid;
  }
  arr.splice(lo, 0, value);
}

export class SampleStore {
  constructor({ maxSteps = 2000 } = {}) {
    this.maxSteps = maxSteps;
    this.clear();
  }

  clear() {
    this.rows = new Map();     // step -> Map(rank -> sample)
    this.steps = [];           // sorted keys of rows
    this.ranks = new Set();
    this.metricNames = new Set(); // names of the user's own metrics seen in any sample (s.metrics)
    this.attempt = 0;          // newest attempt id seen
    this.cutoff = Infinity;    // first step of the newest attempt: older attempts' samples from here on are stale
    this.downsampled = false;  // true once any step was dropped here or arrived downsampled
    this.version = 0;          // bumps on every change (charts redraw only when it moved)
    this.merged = 0;           // samples accepted (new or replaced), for tests and the debug overlay
  }

  merge(samples, { downsampled = false } = {}) {
    if (downsampled) this.downsampled = true;
    let changed = 0;
    for (const s of samples || []) {
      if (!s || !Number.isInteger(s.step) || !Number.isInteger(s.rank)) continue;
      const a = Number(s.attempt) || 0;
      if (a > this.attempt) {
        this.attempt = a;
        this.cutoff = s.step;
        this._dropOlder(s.step, a);
      } else if (a === this.attempt && s.step < this.cutoff) {
        this.cutoff = s.step;
        this._dropOlder(s.step, a);
      } else if (a < this.attempt && s.step >= this.cutoff) {
        continue; // late tail of an attempt the newer one has replaced
      }
      let row = this.rows.get(s.step);
      if (!row) {
        row = new Map();
        this.rows.set(s.step, row);
        this._insertStep(s.step);
      }
      const old = row.get(s.rank);
      if (old && (Number(old.attempt) || 0) > a) continue;
      row.set(s.rank, s);
      this.ranks.add(s.rank);
      if (s.metrics && typeof s.metrics === 'object') for (const name of Object.keys(s.metrics)) this.metricNames.add(name);
      changed += 1;
    }
    while (this.steps.length > this.maxSteps) this._downsample();
    if (changed) {
      this.version += 1;
      this.merged += changed;
    }
    return changed;
  }

  _insertStep(step) {
    insertSorted(this.steps, step);
  }

  // Remove samples of attempts older than `attempt` at steps >= `step`.
  _dropOlder(step, attempt) {
    let i = this.steps.length;
    while (i > 0 && this.steps[i - 1] >= step) i--;
    const keep = this.steps.slice(0, i);
    for (let j = i; j < this.steps.length; j++) {
      const st = this.steps[j];
      const row = this.rows.get(st);
      for (const [rank, s] of row) if ((Number(s.attempt) || 0) < attempt) row.delete(rank);
      if (row.size) keep.push(st); else this.rows.delete(st);
    }
    this.steps = keep;
  }

  _downsample() {
    const last = this.steps.length - 1;
    const keep = [];
    this.steps.forEach((st, i) => {
      if (i % 2 === 0 || i === last) keep.push(st);
      else this.rows.delete(st);
    });
    this.steps = keep;
    this.downsampled = true;
  }

  get lastStep() {
    return this.steps.length ? this.steps[this.steps.length - 1] : null;
  }

  sortedRanks() {
    return Array.from(this.ranks).sort((a, b) => a - b);
  }

  // Column of one field for one rank, aligned with this.steps (null where that rank has no sample).
  column(rank, field) {
    return this.steps.map((st) => {
      const s = this.rows.get(st).get(rank);
      const v = s ? s[field] : null;
      return typeof v === 'number' && Number.isFinite(v) ? v : null;
    });
  }

  // Column of one user metric (s.metrics[name]) for one rank, aligned with this.steps.
  metricColumn(rank, name) {
    return this.steps.map((st) => {
      const s = this.rows.get(st).get(rank);
      const v = s && s.metrics ? s.metrics[name] : null;
      return typeof v === 'number' && Number.isFinite(v) ? v : null;
    });
  }

  // Sum of `field` over ranks at each step; null unless all `world` ranks reported that step
  // (a half-reported step would show as a dip in job throughput).
  sumColumn(field, world) {
    return this.steps.map((st) => {
      const row = this.rows.get(st);
      if (row.size < world) return null;
      let sum = 0;
      for (const s of row.values()) {
        if (typeof s[field] !== 'number') return null;
        sum += s[field];
      }
      return sum;
    });
  }

  meanColumn(field) {
    return this.steps.map((st) => {
      let sum = 0, n = 0;
      for (const s of this.rows.get(st).values()) {
        if (typeof s[field] === 'number' && Number.isFinite(s[field])) { sum += s[field]; n++; }
      }
      return n ? sum / n : null;
    });
  }

  // Mean of the last `n` complete steps' summed field (header throughput).
  recentSum(field, world, n = 5) {
    const vals = [];
    for (let i = this.steps.length - 1; i >= 0 && vals.length < n; i--) {
      const row = this.rows.get(this.steps[i]);
      if (row.size < world) continue;
      let sum = 0;
      for (const s of row.values()) sum += s[field] || 0;
      vals.push(sum);
    }
    return vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : null;
  }

  latest(field) {
    for (let i = this.steps.length - 1; i >= 0; i--) {
      const vals = [];
      for (const s of this.rows.get(this.steps[i]).values()) if (typeof s[field] === 'number') vals.push(s[field]);
      if (vals.length) return vals.reduce((a, b) => a + b, 0) / vals.length;
    }
    return null;
  }

  // Per rank: points held, distinct steps, first and last step; for tests and debugging.
  stats() {
    const out = {};
    for (const rank of this.sortedRanks()) {
      const steps = [];
      for (const st of this.steps) if (this.rows.get(st).has(rank)) steps.push(st);
      out[rank] = { points: steps.length, distinct: new Set(steps).size, min: steps[0] ?? null,
        max: steps[steps.length - 1] ?? null, steps };
    }
    return out;
  }
}

// Reduced steps of one job (issue 26): one row per step, each standard field as [min, mean, max, n]
// across the ranks (a snapshot's bucket: min and max over every step of the bucket, the mean and n of its
// last step `step`, its first step `first`), `by` the ranks of the extremes, `metrics` the user's own as
// [min, last, max]. Keyed by step like SampleStore: a newer attempt replaces an older one's rows from
// the step it resumed at, and a step sent again (its ranks arrived over several relay rounds) replaces
// its row. Past `maxSteps` rows, adjacent pairs merge (min of the mins, max of the maxes, the later
// mean), so a spike stays visible however long the job runs.
export class StepStore {
  constructor({ maxSteps = 3000 } = {}) {
    this.maxSteps = maxSteps;
    this.clear();
  }

  clear() {
    this.rows = new Map();        // step -> row
    this.steps = [];              // sorted keys of rows
    this.metricNames = new Set();
    this.attempt = 0;
    this.cutoff = Infinity;
    this.bucketed = false;        // some row stands for several steps
    this.version = 0;
    this.merged = 0;
    this.named = null;            // {slowest: [{rank, count}], fastest: [...], all, window}: the latest the server sent
  }

  setNamed(named) {
    if (named && typeof named === 'object' && Array.isArray(named.slowest)) {
      this.named = named;
      this.version += 1;
    }
  }

  merge(rows) {
    let changed = 0;
    for (const r of rows || []) {
      if (!r || !Number.isInteger(r.step)) continue;
      const a = Number(r.attempt) || 0;
      if (a > this.attempt) {
        this.attempt = a;
        this.cutoff = r.step;
        this._dropOlder(r.step, a);
      } else if (a === this.attempt && r.step < this.cutoff) {
        this.cutoff = r.step;
        this._dropOlder(r.step, a);
      } else if (a < this.attempt && r.step >= this.cutoff) {
        continue;
      }
      const old = this.rows.get(r.step);
      if (old && (Number(old.attempt) || 0) > a) continue;
      if (!old) this._insertStep(r.step);
      this.rows.set(r.step, r);
      if (Number.isInteger(r.first) && r.first !== r.step) this.bucketed = true;
      if (r.metrics && typeof r.metrics === 'object') for (const name of Object.keys(r.metrics)) this.metricNames.add(name);
      changed += 1;
    }
    while (this.steps.length > this.maxSteps) this._compact();
    if (changed) {
      this.version += 1;
      this.merged += changed;
    }
    return changed;
  }

  _insertStep(step) {
    insertSorted(this.steps, step);
  }

  _dropOlder(step, attempt) {
    this.steps = this.steps.filter((st) => {
      if (st < step) return true;
      const r = this.rows.get(st);
      if ((Number(r.attempt) || 0) >= attempt) return true;
      this.rows.delete(st);
      return false;
    });
  }

  // Two adjacent rows as one bucket: the later row's step, mean, n, by and ts; min/max over both.
  static join(a, b) {
    const out = { ...b, first: Number.isInteger(a.first) ? a.first : a.step };
    for (const [k, v] of Object.entries(a)) {
      if (!Array.isArray(v) || v.length !== 4) continue;
      const w = b[k];
      out[k] = Array.isArray(w) ? [Math.min(v[0], w[0]), w[1], Math.max(v[2], w[2]), w[3]] : v;
    }
    if (a.metrics || b.metrics) {
      out.metrics = { ...(a.metrics || {}), ...(b.metrics || {}) };
      for (const [name, v] of Object.entries(a.metrics || {})) {
        const w = (b.metrics || {})[name];
        if (w) out.metrics[name] = [Math.min(v[0], w[0]), w[1], Math.max(v[2], w[2])];
      }
    }
    return out;
  }

  _compact() {
    const last = this.steps.length - 1;
    const keep = [];
    for (let i = 0; i < this.steps.length; i++) {
      const st = this.steps[i];
      if (i % 2 === 0 && i + 1 < last) {
        const next = this.steps[i + 1];
        this.rows.set(next, StepStore.join(this.rows.get(st), this.rows.get(next)));
        this.rows.delete(st);
        keep.push(next);
        i += 1;
      } else {
        keep.push(st);
      }
    }
    this.steps = keep;
    this.bucketed = true;
  }

  get lastStep() {
    return this.steps.length ? this.steps[this.steps.length - 1] : null;
  }

  // {lo, mean, hi} columns of one standard field, aligned with this.steps (null where not reported).
  band(field) {
    const lo = [], mean = [], hi = [];
    for (const st of this.steps) {
      const v = this.rows.get(st)[field];
      const ok = Array.isArray(v) && Number.isFinite(v[1]);
      lo.push(ok ? v[0] : null);
      mean.push(ok ? v[1] : null);
      hi.push(ok ? v[2] : null);
    }
    return { lo, mean, hi };
  }

  // The same for one of the user's own metrics ([min, last, max] of the lowest reporting rank's value).
  metricBand(name) {
    const lo = [], mean = [], hi = [];
    for (const st of this.steps) {
      const m = this.rows.get(st).metrics;
      const v = m ? m[name] : null;
      const ok = Array.isArray(v) && Number.isFinite(v[1]);
      lo.push(ok ? v[0] : null);
      mean.push(ok ? v[1] : null);
      hi.push(ok ? v[2] : null);
    }
    return { lo, mean, hi };
  }

  meanColumn(field) {
    return this.band(field).mean;
  }

  // The whole job's value (mean x ranks) at each step; null unless all `world` ranks reported it
  // (a half-reported step would show as a dip in job throughput).
  totalColumn(field, world) {
    return this.steps.map((st) => {
      const v = this.rows.get(st)[field];
      return Array.isArray(v) && Number.isFinite(v[1]) && v[3] >= world ? v[1] * v[3] : null;
    });
  }

  // Mean of the last `n` complete steps' totals (the header's throughput).
  recentTotal(field, world, n = 5) {
    const vals = [];
    for (let i = this.steps.length - 1; i >= 0 && vals.length < n; i--) {
      const v = this.rows.get(this.steps[i])[field];
      if (Array.isArray(v) && v[3] >= world) vals.push(v[1] * v[3]);
    }
    return vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : null;
  }

  latest(field) {
    for (let i = this.steps.length - 1; i >= 0; i--) {
      const v = this.rows.get(this.steps[i])[field];
      if (Array.isArray(v) && Number.isFinite(v[1])) return v[1];
    }
    return null;
  }

  // The named ranks to draw by name: [{rank, role: 'slowest' | 'fastest'}] (slowest first).
  namedRanks() {
    const n = this.named;
    if (!n) return [];
    const out = [];
    const seen = new Set();
    for (const [role, list] of [['slowest', n.slowest], ['fastest', n.fastest]]) {
      for (const x of list || []) {
        if (Number.isInteger(x.rank) && !seen.has(x.rank)) {
          seen.add(x.rank);
          out.push({ rank: x.rank, role, count: x.count });
        }
      }
    }
    return out;
  }
}
