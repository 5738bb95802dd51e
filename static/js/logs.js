// Live log pane with one tab per rank plus "all". Lines are bounded per rank and in total, new lines
// are appended without re-rendering the pane, and the pane follows the tail unless the reader has
// scrolled up to read something.
import { el } from './util.js';

export class LogPane {
  constructor(tabs, pane, { limit = 1000 } = {}) {
    this.tabs = tabs;
    this.pane = pane;
    this.limit = limit;
    this.active = 'all';
    this.shown = 0;
    this.byRank = new Map();  // rank -> [line objects]
    this.all = [];
    this.total = 0;           // lines received (tests read it)
    tabs.addEventListener('click', (ev) => {
      const b = ev.target.closest('button[data-rank]');
      if (!b) return;
      this.active = b.dataset.rank;
      this._renderTabs();
      this._renderAll();
    });
    this._renderTabs();
  }

  reset(lines) {
    this.byRank = new Map();
    this.all = [];
    this._push(lines);
    this._renderTabs();
    this._renderAll();
  }

  add(rank, lines) {
    if (!lines.length) return;
    const newRank = !this.byRank.has(rank);
    this._push(lines);
    if (newRank) this._renderTabs();
    const visible = this.active === 'all' ? lines : lines.filter((l) => String(l.rank) === this.active);
    if (!visible.length) return;
    const stick = this._atBottom();
    if (this.shown + visible.length > this.limit * 1.5) {
      this._renderAll();
    } else {
      if (!this.shown) this.pane.replaceChildren();
      this.pane.append(...visible.map((l) => this._line(l)));
      this.shown += visible.length;
    }
    if (stick) this.pane.scrollTop = this.pane.scrollHeight;
  }

  _push(lines) {
    for (const l of lines) {
      const key = l.rank ?? '?';
      if (!this.byRank.has(key)) this.byRank.set(key, []);
      const arr = this.byRank.get(key);
      arr.push(l);
      if (arr.length > this.limit * 1.2) arr.splice(0, arr.length - this.limit);
      this.all.push(l);
      this.total += 1;
    }
    if (this.all.length > this.limit * 2.4) this.all.splice(0, this.all.length - this.limit * 2);
  }

  _atBottom() {
    const p = this.pane;
    return p.scrollTop + p.clientHeight >= p.scrollHeight - 16;
  }

  _line(l) {
    const prefix = this.active === 'all' ? `[r${l.rank ?? '?'}] ` : '';
    return el('span', { class: l.stream === 'stderr' ? 'ln err' : 'ln' }, prefix + l.line + '\n');
  }

  _renderAll() {
    const src = this.active === 'all' ? this.all : (this.byRank.get(Number(this.active)) || this.byRank.get(this.active) || []);
    const lines = src.slice(-this.limit);
    this.shown = lines.length;
    if (!lines.length) {
      this.pane.replaceChildren(el('span', { class: 'muted' }, 'No output yet.'));
      this.shown = 0;
    } else {
      this.pane.replaceChildren(...lines.map((l) => this._line(l)));
    }
    this.pane.scrollTop = this.pane.scrollHeight;
  }

  _renderTabs() {
    const ranks = [...this.byRank.keys()].filter((r) => r !== '?').sort((a, b) => a - b);
    const keys = ['all', ...ranks.map(String)];
    this.tabs.replaceChildren(...keys.map((k) => el('button', {
      type: 'button', role: 'tab', 'aria-selected': String(k === this.active),
      class: k === this.active ? 'tab active' : 'tab', dataset: { rank: k },
    }, k === 'all' ? 'All ranks' : `rank ${k}`)));
  }
}
