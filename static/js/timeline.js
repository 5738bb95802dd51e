// The job page's timeline: its events, newest first, coloured by kind (failures red, restarts and
// rollbacks amber, checkpoints and resumes blue, success green), with a preemption's why / for whom /
// where it resumes, and any evidence folded away. static/js/job.js feeds it from the socket.
import { $, el, fmtClock, fmtDateTime, fmtSeconds, isNum } from './util.js';
import { outcomeClass } from './jobtables.js';

const KIND_CLASS = {
  attempt_started: 'ok', running: 'ok', succeeded: 'ok', straggler_cleared: 'ok', node_cleared: 'ok',
  failed: 'bad', hang_detected: 'bad', node_quarantined: 'bad', lost: 'bad',
  restart: 'warn', rollback: 'warn', straggler: 'warn', preempted: 'warn', cancelled: 'warn',
  preempt_requested: 'warn', preempt_forced: 'warn',
  checkpoint: 'info', checkpoint_saved: 'info', checkpoint_deleted: 'info', resumed: 'info',
};

// failures red, restarts/rollbacks amber, checkpoints/resumes blue, success green
function eventClass(e) {
  const kind = e.kind || '';
  if (kind === 'attempt_ended') return outcomeClass(e.data && e.data.outcome) || 'warn';
  if (KIND_CLASS[kind]) return KIND_CLASS[kind];
  if (/fail|lost|error|crash|hang|quarantin/i.test(kind)) return 'bad';
  if (/checkpoint|resum/i.test(kind)) return 'info';
  if (/rollback|restart|retry|preempt|cancel|stop|straggler|queue|drain/i.test(kind)) return 'warn';
  if (/succeed|finish|start|running|clear/i.test(kind)) return 'ok';
  return '';
}

function evidenceOf(e) {
  const data = e.data || {};
  const nonEmpty = (x) => !!x && typeof x === 'object' && Object.keys(x).length > 0;
  if (nonEmpty(data.evidence)) return data.evidence;
  return nonEmpty(data) ? data : null;
}

// Preemptions say why (and for whom, and where the job resumes) on a line of their own.
function preemptDetail(e) {
  if (!/^preempt/.test(e.kind || '')) return null;
  const d = e.data || {};
  const parts = [];
  if (d.reason && !(e.message || '').includes(d.reason)) {
    parts.push(el('span', { class: 'ev-reason' }, `why: ${d.reason}`));
  }
  if (isNum(d.for_job)) {
    parts.push(el('span', {}, 'for ', el('a', { href: `/jobs/${d.for_job}/` }, `job ${d.for_job}`)));
  }
  if (isNum(d.grace_s)) parts.push(`grace ${fmtSeconds(d.grace_s)}`);
  if (isNum(d.resume_step)) parts.push(d.resume_step ? `resumes from step ${d.resume_step}` : 'restarts from step 0');
  if (!parts.length) return null;
  return el('div', { class: 'ev-detail' }, parts.flatMap((p, i) => (i ? [' · ', p] : [p])));
}

function eventNode(e) {
  const cls = eventClass(e);
  const evidence = evidenceOf(e);
  return el('li', { class: cls ? `ev-${cls}` : '', dataset: { id: e.id ?? '', kind: e.kind || '' } },
    el('time', { datetime: e.created_at || '', title: fmtDateTime(e.created_at) }, fmtClock(e.created_at)),
    el('span', { class: `ev-kind kb-${cls || 'plain'}` }, e.kind || ''),
    el('span', { class: 'ev-msg' }, e.message || ''),
    preemptDetail(e),
    evidence ? el('details', { class: 'ev-evidence' }, el('summary', {}, 'evidence'),
      el('pre', {}, JSON.stringify(evidence, null, 2))) : '');
}

export class Timeline {
  constructor() {
    this.items = new Map();  // id -> event
    this.nodes = new Map();  // events never change once written, so each keeps its <li> (and any evidence the user expanded)
  }

  add(e) {
    if (!e) return;
    this.items.set(e.id ?? `${e.kind}:${e.created_at}`, e);
  }

  render() {
    const list = $('#events');
    const items = [...this.items.entries()].sort(([, a], [, b]) => (b.id || 0) - (a.id || 0)).slice(0, 200);
    if (!items.length) {
      list.replaceChildren(el('li', { class: 'muted' }, 'No events yet.'));
      return;
    }
    list.replaceChildren(...items.map(([key, e]) => {
      if (!this.nodes.has(key)) this.nodes.set(key, eventNode(e));
      return this.nodes.get(key);
    }));
  }
}
