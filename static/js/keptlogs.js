// Kept logs of a finished job: every rank's full output per attempt, paged from
// GET /api/v1/jobs/<id>/logs/ (offset/limit in lines) in the page's log panel style, with an attempt
// picker, rank tabs, first/previous/next/last and a download link for the whole file.
import { $, el, getJSON } from './util.js';

export class KeptLogs {
  constructor(root, jobId, { limit = 500 } = {}) {
    this.root = root;
    this.jobId = jobId;
    this.limit = limit;
    this.active = false;
    this.page = null;      // the API's last answer (tests read it)
    this.loads = 0;
    this.tabs = $('.kept-tabs', root);
    this.pane = $('.kept-pane', root);
    this.attemptSelect = $('.kept-attempt', root);
    this.range = $('.kept-range', root);
    this.note = $('.kept-note', root);
    this.download = $('.kept-download', root);
    this.buttons = Object.fromEntries(['first', 'prev', 'next', 'last'].map((k) => [k, $(`[data-page=${k}]`, root)]));
    this.buttons.first.addEventListener('click', () => this.load({ offset: 0 }));
    this.buttons.prev.addEventListener('click', () => this.load({ offset: Math.max(0, this.page.offset - this.limit) }));
    this.buttons.next.addEventListener('click', () => this.load({ offset: this.page.next_offset }));
    this.buttons.last.addEventListener('click', () => this.load({ last: true }));
    this.attemptSelect.addEventListener('change', () => this.load({ attempt: Number(this.attemptSelect.value), rank: 0, last: true }));
    this.tabs.addEventListener('click', (ev) => {
      const b = ev.target.closest('button[data-rank]');
      if (b) this.load({ rank: Number(b.dataset.rank), last: true });
    });
  }

  // Switch the log card to the kept files (once the job has finished): its newest page first.
  async show() {
    if (this.active) return;
    this.active = true;
    this.root.hidden = false;
    for (const live of document.querySelectorAll('[data-live-logs]')) live.hidden = true;
    await this.load({ last: true });
  }

  _url({ attempt, rank, offset, download = false }) {
    const q = new URLSearchParams();
    if (attempt !== null && attempt !== undefined) q.set('attempt', attempt);
    q.set('rank', rank ?? 0);
    if (download) q.set('download', '1');
    else { q.set('offset', offset ?? 0); q.set('limit', this.limit); }
    return `/api/v1/jobs/${this.jobId}/logs/?${q}`;
  }

  async load({ attempt = this.page?.attempt, rank = this.page?.rank ?? 0, offset = 0, last = false } = {}) {
    try {
      let page = await getJSON(this._url({ attempt, rank, offset }));
      if (last && page.total > page.offset + page.lines.length) {
        page = await getJSON(this._url({ attempt: page.attempt, rank, offset: Math.max(0, page.total - this.limit) }));
      }
      this.page = page;
      this.loads += 1;
      this._render();
    } catch (err) {
      this.note.hidden = false;
      this.note.textContent = `Could not load the kept logs: ${err.message || err}`;
    }
  }

  _render() {
    const p = this.page;
    this.attemptSelect.replaceChildren(...p.attempts.map((a) => el('option', { value: a.id, selected: a.id === p.attempt },
      `attempt #${a.number}`)));
    const ranks = (p.attempts.find((a) => a.id === p.attempt) || { ranks: [] }).ranks;
    this.tabs.replaceChildren(...(ranks.length ? ranks : [p.rank]).map((r) => el('button', {
      type: 'button', role: 'tab', 'aria-selected': String(r === p.rank), class: r === p.rank ? 'tab active' : 'tab',
      dataset: { rank: r } }, `rank ${r}`)));
    this.pane.replaceChildren(...(p.lines.length ? p.lines.map((l) => el('span', { class: 'ln' }, `${l}\n`))
      : [el('span', { class: 'muted' }, 'No output kept for this rank.')]));
    this.pane.scrollTop = 0;
    const first = p.lines.length ? p.offset + 1 : 0;
    this.range.textContent = `lines ${first}–${p.offset + p.lines.length} of ${p.total}`;
    this.root.dataset.offset = String(p.offset);
    this.root.dataset.total = String(p.total);
    this.note.hidden = !p.note;
    this.note.textContent = p.note || '';
    const atStart = p.offset <= p.dropped_lines;
    this.buttons.first.disabled = atStart;
    this.buttons.prev.disabled = atStart;
    this.buttons.next.disabled = p.next_offset === null;
    this.buttons.last.disabled = p.next_offset === null;
    this.download.hidden = !p.total;
    this.download.href = this._url({ attempt: p.attempt, rank: p.rank, download: true });
  }
}
