// The job page's two tables: its attempts (ranks, where each resumed, how it ended, the failure with its
// traceback) and its checkpoints, with the staff's Roll back / Pin buttons (POSTs to the API with the
// CSRF token; a rollback asks first, inline). static/js/job.js feeds them from the socket and the job JSON.
import { $, el, fmtBytes, fmtClock, fmtDateTime, fmtSeconds, isNum, postJSON, errorText,
  replaceKeepingOpen, statusBadge } from './util.js';

// ---------------------------------------------------------------- attempts

function ranksCell(ranks) {
  if (!ranks || !ranks.length) return el('span', { class: 'muted' }, '–');
  return el('ul', { class: 'ranks' }, ranks.map((r) => el('li', {},
    el('b', {}, `r${r.rank}`), ` ${r.node}`, r.pid ? el('span', { class: 'muted' }, ` pid ${r.pid}`) : '',
    r.role ? el('div', { class: 'rank-role', dataset: { rank: r.rank } },
      `${r.role} · params ${fmtBytes(r.param_bytes)}${r.optim_bytes ? ` · optim ${fmtBytes(r.optim_bytes)}` : ''}`) : '')));
}

function resumedCell(a, marker) {
  if (a.resumed_from_step === null || a.resumed_from_step === undefined) return 'start';
  return [`step ${a.resumed_from_step}`, marker ? el('span', { class: 'muted' }, ` (${marker.label})`) : ''];
}

function failureRow(a) {
  const f = a.failure || {};
  if (!(f.message || f.traceback || f.class)) return null;
  const where = [f.rank !== undefined && f.rank !== null ? `rank ${f.rank}` : '', f.node || ''].filter(Boolean).join(' on ');
  return el('tr', { class: 'failure-row', dataset: { failure: a.id } }, el('td', {}), el('td', { colspan: 6 },
    el('details', { dataset: { key: `tb-${a.id}` } },
      el('summary', {}, el('b', {}, f.class || 'failure'), where ? ` (${where})` : '', ': ', f.message || ''),
      el('pre', { class: 'tb' }, f.traceback || '(no traceback captured)')),
    f.suggestion ? el('p', { class: 'suggestion' }, el('b', {}, 'Suggestion: '), f.suggestion) : ''));
}

// On a Slurm pool: the attempt's Slurm job, its state and, while Slurm holds it pending, Slurm's reason,
// its category and expected start (issue 27; the API's attempt `slurm` block).
function slurmLine(s) {
  if (!s) return '';
  let text = `Slurm job ${s.job_id || '(submitting)'} · ${s.state}`;
  if (s.state === 'pending') {
    text += `: ${s.category || 'other'} (${s.reason || 'None'})`;
    if (s.eta) text += `, expected ${fmtDateTime(s.eta)}`;
  }
  if (s.nodes && s.nodes.length) text += ` on ${s.nodes.join(', ')}`;
  if (s.error) text += ` · ${s.error}`;
  return el('div', { class: 'muted slurm' }, text);
}

// An attempt's outcome as a colour class (the timeline colours attempt_ended events the same way).
export function outcomeClass(outcome) {
  if (!outcome) return '';
  if (outcome === 'succeeded') return 'ok';
  if (outcome.startsWith('failed') || outcome === 'lost') return 'bad';
  return 'warn';  // rolled_back, preempted, cancelled
}

// attempts: the job JSON's; markers: [{attempt, label}] the charts' rollback/restart lines.
export function renderAttempts(attempts, markers) {
  const body = $('#attempts-body');
  if (!body) return;
  const rows = [];
  const byAttempt = new Map(markers.map((m) => [m.attempt, m]));
  const sorted = [...(attempts || [])].sort((a, b) => b.number - a.number);
  for (const a of sorted) {
    rows.push(el('tr', { dataset: { attempt: a.id, number: a.number, outcome: a.outcome || '' } },
      el('td', {}, `#${a.number}`),
      el('td', {}, statusBadge(a.status), slurmLine(a.slurm)),
      el('td', {}, el('span', { class: `outcome o-${outcomeClass(a.outcome)}` },
        a.outcome || (a.status === 'ENDED' ? '' : '…')),
        a.stop_reason ? el('div', { class: 'muted' }, a.stop_reason) : ''),
      el('td', {}, ranksCell(a.ranks)),
      el('td', {}, resumedCell(a, byAttempt.get(a.number))),
      el('td', {}, el('time', { datetime: a.started_at || '' }, fmtDateTime(a.started_at))),
      el('td', {}, el('time', { datetime: a.ended_at || '' }, fmtDateTime(a.ended_at)))));
    const failure = failureRow(a);
    if (failure) rows.push(failure);
  }
  if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: 7, class: 'muted' }, 'No attempt yet: the job is waiting for slots.')));
  replaceKeepingOpen(body, rows);
}

// ---------------------------------------------------------------- checkpoints (+ staff actions)

function checkpointState(c) {
  if (c.deleted) return 'deleted';
  if (c.superseded) return 'superseded';
  return 'active';
}

function setNote(text, bad = false) {
  const note = $('#checkpoint-note');
  if (!note) return;
  note.textContent = text || '';
  note.hidden = !text;
  note.classList.toggle('bad', bad);
  if (bad) note.setAttribute('role', 'alert'); else note.removeAttribute('role');
}

// The checkpoints table of job `jobId`. attempts() gives the job's attempts (a checkpoint names its
// attempt by id, the table shows the number); onRolledBack(job) runs after the server accepted a
// rollback, with the job it answered (or null).
export class CheckpointTable {
  constructor({ jobId, isStaff, attempts, onRolledBack }) {
    this.jobId = jobId;
    this.isStaff = !!isStaff;
    this.attempts = attempts;
    this.onRolledBack = onRolledBack;
    this.items = new Map();  // id -> checkpoint (after a rollback two checkpoints can share a step)
    this.pendingRollback = null;
  }

  add(c) {
    if (!c || !Number.isInteger(c.step)) return;
    const key = c.id ?? `step:${c.step}`;
    this.items.set(key, { ...this.items.get(key), ...c });
  }

  attemptLabel(c) {
    const a = (this.attempts() || []).find((x) => x.id === c.attempt);
    if (a) return `#${a.number}`;
    if (isNum(c.attempt_number)) return `#${c.attempt_number}`;
    return '–';
  }

  actions(c) {
    if (!this.isStaff) return null;
    const buttons = [];
    if (!c.deleted) {
      buttons.push(el('button', { type: 'button', class: 'small warn', dataset: { action: 'rollback', id: c.id } },
        'Roll back'));
      buttons.push(el('button', { type: 'button', class: 'small ghost', dataset: { action: 'pin', id: c.id } },
        c.pinned ? 'Unpin' : 'Pin'));
    }
    return el('td', { class: 'actions-cell' }, buttons);
  }

  row(c) {
    const st = checkpointState(c);
    const dataset = { checkpoint: c.id, step: c.step, state: st, pinned: c.pinned ? '1' : '' };
    return el('tr', { class: `ck-${st}`, dataset },
      el('td', {}, `step ${c.step}`),
      el('td', {}, this.attemptLabel(c)),
      el('td', {}, el('time', { datetime: c.created_at || '', title: fmtDateTime(c.created_at) },
        fmtClock(c.created_at))),
      el('td', { class: 'num' }, fmtBytes(c.size_bytes)),
      el('td', { class: 'num' }, `${fmtSeconds(c.blocking_s)} / ${fmtSeconds(c.save_s)}`),
      el('td', { class: 'ck-badges' }, el('span', { class: `badge b-${st}` }, st),
        c.pinned ? el('span', { class: 'badge b-pinned' }, 'pinned') : ''),
      this.actions(c));
  }

  render() {
    const list = $('#checkpoints-body');
    const items = [...this.items.values()].sort((a, b) => b.step - a.step || (b.id || 0) - (a.id || 0));
    if (!items.length) {
      const colspan = this.isStaff ? 7 : 6;
      list.replaceChildren(el('tr', {}, el('td', { colspan, class: 'muted empty-state' }, 'No checkpoints yet.')));
      return;
    }
    list.replaceChildren(...items.map((c) => this.row(c)));
  }

  askRollback(c) {
    this.pendingRollback = c;
    setNote('');
    $('#rollback-question').textContent =
      `Roll back job ${this.jobId} to step ${c.step}? The running attempt stops; later checkpoints are superseded.`;
    $('#rollback-confirm').hidden = false;
    $('#rollback-yes').disabled = false;
    $('#rollback-yes').focus();
  }

  closeRollback() {
    this.pendingRollback = null;
    $('#rollback-confirm').hidden = true;
  }

  async confirmRollback() {
    const c = this.pendingRollback;
    if (!c) return;
    $('#rollback-yes').disabled = true;
    const r = await postJSON(`/api/v1/jobs/${this.jobId}/rollback/`, { checkpoint: c.id });
    this.closeRollback();
    if (!r.ok) {
      setNote(`Roll back to step ${c.step} refused: ${errorText(r.data, r.status)}`, true);
      return;
    }
    setNote(`Rollback to step ${c.step} requested: the job restarts from that checkpoint.`);
    this.onRolledBack(r.data && r.data.id === this.jobId ? r.data : null);
  }

  async togglePin(c, button) {
    button.disabled = true;
    const r = await postJSON(`/api/v1/jobs/${this.jobId}/checkpoints/${c.id}/pin/`, { pinned: !c.pinned });
    button.disabled = false;
    if (!r.ok) {
      setNote(`${c.pinned ? 'Unpin' : 'Pin'} of step ${c.step} refused: ${errorText(r.data, r.status)}`, true);
      return;
    }
    setNote('');
    this.add(r.data && Number.isInteger(r.data.step) ? r.data : { ...c, pinned: !c.pinned });
    this.render();
  }

  bind() {
    if (!this.isStaff) return;
    $('#checkpoints-body').addEventListener('click', (ev) => {
      const b = ev.target.closest('button[data-action]');
      if (!b) return;
      const c = [...this.items.values()].find((x) => String(x.id) === b.dataset.id);
      if (!c) return;
      if (b.dataset.action === 'rollback') this.askRollback(c);
      else if (b.dataset.action === 'pin') this.togglePin(c, b);
    });
    $('#rollback-yes').addEventListener('click', () => this.confirmRollback());
    $('#rollback-no').addEventListener('click', () => this.closeRollback());
  }
}
