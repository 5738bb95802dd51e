// Per-step telemetry of one job, merged by key (attempt, rank, step) so a snapshot after a reload or
// reconnect, a downsampled `window` and live `telemetry` batches overlap without duplicates or gaps.
//
// Rows are indexed by step; each row holds at most one sample per rank. A newer attempt (restart
// from a checkpoint) replaces the older attempt's samples from the step it resumed at, so charts show
// the run as it is now, not two overlapping timelines. The number of steps is bounded: past
// `maxSteps` every other step is dropped (the newest step always stays), so each chart series keeps
// at most `maxSteps` points however long the job runs.

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
    const st = this.steps;
    if (!st.length || st[st.length - 1] < step) {
      st.push(step);
      return;
    }
    let lo = 0, hi = st.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (st[mid] < step) lo = mid + 1; else hi = mid;
    }
    st.splice(lo, 0, step);
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
