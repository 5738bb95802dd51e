// The nodes page's "Control plane" panel (templates/jobs/_control_plane.html): every process's liveness
// (web, redis, control worker, beat, relay, agents) and, for staff under `make run`, the supervisor's
// restarts. Fetched every 5 s from /nodes/control-plane/ rather than pushed: the pushes come through the
// control worker and the relay, which are among the processes this panel must be able to show dead.
import { $, el, getJSON } from './util.js';

const POLL_MS = 5000;
const badge = (ok, yes, no) => el('span', { class: `status ${ok ? 's-up' : 's-down'}` }, ok ? yes : no);
const ago = (s) => (typeof s === 'number' && Number.isFinite(s) ? `${s.toFixed(0)} s ago` : 'never');

function exitText(e) {
  if (!e) return '–';
  return e.signal ? `killed by ${e.signal}` : `exit code ${e.code}`;
}

function render(data) {
  $('#cp-processes').replaceChildren(...data.processes.map((p) => el('tr', { dataset: { process: p.process } },
    el('td', {}, p.process), el('td', {}, badge(p.up, 'UP', 'DOWN')), el('td', { class: 'muted' }, ago(p.age_s)))));
  const sup = data.supervisor;
  if (!sup) { $('#cp-supervisor').replaceChildren(); return; }
  $('#cp-supervisor').replaceChildren(
    el('h3', {}, 'make run supervisor ', badge(sup.up, 'UP', 'DOWN'),
      sup.up ? '' : el('small', { class: 'muted' }, ' its status file is stale')),
    el('div', { class: 'table-wrap' }, el('table', {},
      el('thead', {}, el('tr', {}, ['Process', 'State', 'PID', 'Restarts', 'Last exit'].map((h, i) =>
        el('th', i === 2 || i === 3 ? { class: 'num' } : {}, h)))),
      el('tbody', {}, sup.rows.map((p) => el('tr', { dataset: { process: p.process } },
        el('td', {}, p.process), el('td', {}, badge(p.running, 'RUNNING', 'RESTARTING')),
        el('td', { class: 'num' }, p.pid ?? '–'), el('td', { class: 'num' }, p.restarts ?? 0),
        el('td', {}, exitText(p.last_exit))))))));
}

async function refresh() {
  const panel = $('#control-plane');
  if (!panel) return;
  try {
    render(await getJSON(panel.dataset.url));
    panel.removeAttribute('data-stale');
  } catch (err) {
    panel.dataset.stale = '1';  // the web process itself (or the network) did not answer
  }
}

setInterval(refresh, POLL_MS);
