// Cluster overview and nodes page, live over /ws/cluster/: node cards (slots used/free, CPU, memory,
// GPU utilisation, status, heartbeat age, quarantine), running jobs with progress, and the queue.
// Staff get a "Clear quarantine" button on quarantined nodes (POST /api/v1/nodes/<name>/clear/), and on
// the nodes page Cordon / Drain (finish) / Drain (preempt, after a confirm) / Uncordon per node
// (POST /api/v1/nodes/<name>/<action>/); the answer updates the card at once, the socket follows.
import { LiveSocket, bindIndicator } from './live.js';
import { $, $$, el, fmtAgo, fmtDateTime, statusBadge, postJSON, errorText } from './util.js';

const state = { nodes: null, queue: null, running: null };

function pct(v) {
  return typeof v === 'number' && Number.isFinite(v) ? Math.max(0, Math.min(100, v)) : 0;
}

function meter(label, cls, value, text) {
  return el('div', { class: 'meter' }, el('span', { class: 'k' }, label),
    el('span', { class: `bar ${cls}` }, el('span', { style: { width: `${pct(value).toFixed(0)}%` } })),
    el('span', { class: 'n' }, text));
}

// Quarantine is kept apart from status on the server (a quarantined node that went LOST stays quarantined).
const quarantined = (n) => !!n.quarantined_at || n.status === 'QUARANTINED';
const canClear = () => $('#nodes')?.dataset.canClear === '1';
const canControl = () => $('#nodes')?.dataset.canControl === '1';

const DRAIN_TEXT = {
  cordon: ['Cordoned', 'no new work; running jobs continue'],
  finish: ['Draining (finish)', 'no new work; running jobs finish'],
  preempt: ['Draining (preempt)', 'running jobs checkpoint and move'],
};

function drainBox(n) {
  const mode = n.drain_mode || '';
  if (!mode) return null;
  const [title, text] = DRAIN_TEXT[mode] || DRAIN_TEXT.finish;
  return el('div', { class: 'drain', dataset: { mode } }, el('b', {}, title), `: ${text}`);
}

// The drain actions n.drain_mode offers come with the node (jobs/fleet/serializers.py node_controls).
function nodeControls(n) {
  if (!canControl()) return null;
  return el('div', { class: 'node-actions' }, (n.controls || []).map(({ action, mode, label }) => el('button', {
    type: 'button', class: `small ${mode === 'preempt' ? 'warn' : 'ghost'}`,
    dataset: mode ? { action, mode, node: n.name } : { action, node: n.name } }, label)));
}

function quarantineBox(n) {
  if (!quarantined(n)) return null;
  return el('div', { class: 'quarantine' },
    el('div', {}, el('b', {}, 'Quarantined'),
      n.quarantined_at ? [' ', el('time', { datetime: n.quarantined_at, 'data-ago': true,
        title: fmtDateTime(n.quarantined_at) }, fmtAgo(n.quarantined_at))] : '',
      n.quarantine_reason ? [': ', el('span', { class: 'q-reason' }, n.quarantine_reason)] : ''),
    canClear() ? el('button', { type: 'button', class: 'small', dataset: { action: 'clear', node: n.name } },
      'Clear quarantine') : '');
}

function nodeCard(n) {
  const used = n.slots_used || 0;
  const slots = [];
  for (let i = 0; i < (n.slots || 0); i++) slots.push(el('span', { class: i < used ? 'slot used' : 'slot' }));
  const labels = Object.entries(n.labels || {}).map(([k, v]) => ` · ${k}=${v}`).join('');
  const gpus = (n.devices || []).filter((d) => d && d.kind === 'cuda');
  // A GPU's NVML figures in one line, one per cuda device in order (jobs/fleet/serializers.py gpu_detail).
  const details = n.gpu_details || [];
  const cls = ['node', n.status === 'LOST' ? 's-lost-card' : '', quarantined(n) ? 's-quarantined-card' : ''];
  return el('article', { class: cls.filter(Boolean).join(' '), dataset: { node: n.name } },
    el('div', { class: 'node-head' }, el('b', {}, n.name), statusBadge(n.status)),
    el('div', { class: 'sub' }, `${n.address || ''}${labels} · heartbeat `,
      el('time', { datetime: n.last_heartbeat || '', 'data-ago': true }, fmtAgo(n.last_heartbeat))),
    quarantineBox(n),
    drainBox(n),
    el('div', { class: 'meter' }, el('span', { class: 'k' }, 'Slots'),
      el('span', { class: 'slots', title: `${used} used, ${Math.max(0, n.slots - used)} free` }, slots),
      el('span', { class: 'n' }, `${used}/${n.slots}`)),
    meter('CPU', 'cpu', n.cpu_percent, `${pct(n.cpu_percent).toFixed(0)}%`),
    meter('Memory', 'mem', n.mem_percent, `${pct(n.mem_percent).toFixed(0)}%`),
    gpus.flatMap((g, i) => {
      const memPct = g.memory_bytes ? (100 * (g.memory_used_bytes || 0)) / g.memory_bytes : null;
      const util = typeof g.utilization === 'number' ? g.utilization : null;
      const detail = details[i] || '';
      const bad = (g.ecc_uncorrected || 0) > 0 || (g.xid_events || []).length > 0;
      return [meter(`GPU ${g.index}`, 'gpu', util ?? memPct ?? 0,
        util !== null ? `${util.toFixed(0)}%` : memPct !== null ? `mem ${memPct.toFixed(0)}%` : '–'),
      detail ? el('div', { class: bad ? 'gpu-detail bad' : 'gpu-detail', title: g.uuid || '' }, detail) : ''];
    }),
    nodeControls(n));
}

function renderNodes() {
  const nodes = state.nodes || [];
  const box = $('#nodes');
  if (box) {
    box.replaceChildren(...(nodes.length ? nodes.map(nodeCard)
      : [el('p', { class: 'muted' }, 'No node agent has registered yet.')]));
  }
  const summary = $('#nodes-summary');
  if (summary) {
    const ready = nodes.filter((n) => n.status === 'READY');
    const slots = ready.reduce((a, n) => a + n.slots, 0);
    const used = ready.reduce((a, n) => a + (n.slots_used || 0), 0);
    summary.textContent = `${ready.length}/${nodes.length} ready · ${used}/${slots} slots in use`;
  }
  const table = $('#node-table');
  if (table) {
    table.replaceChildren(...(nodes.length ? nodes.map((n) => el('tr', { dataset: { node: n.name } },
      el('td', {}, n.name),
      el('td', { title: quarantined(n) ? `quarantined: ${n.quarantine_reason || ''}` : null }, statusBadge(n.status),
        n.drain_mode ? [' ', el('small', { class: 'muted' }, n.drain_mode)] : ''),
      el('td', {}, n.address || ''),
      el('td', { class: 'num' }, `${n.slots_used || 0} / ${n.slots}`),
      el('td', { class: 'num' }, `${pct(n.cpu_percent).toFixed(0)}%`),
      el('td', { class: 'num' }, `${pct(n.mem_percent).toFixed(0)}%`),
      el('td', {}, n.device_summary || ''),  // jobs/fleet/serializers.py device_summary
      el('td', {}, Object.entries(n.labels || {}).map(([k, v]) => `${k}=${v}`).join(' '))))
      : [el('tr', {}, el('td', { colspan: 8, class: 'muted' }, 'No node agent has registered yet.'))]));
  }
}

function jobLink(j) {
  return el('a', { href: `/jobs/${j.id}/` }, `${j.id} · ${j.name}`);
}

function renderJobs() {
  const running = $('#running');
  if (running && state.running) {
    running.replaceChildren(...(state.running.length ? state.running.map((j) => {
      const p = j.total_steps ? Math.min(100, (100 * j.step) / j.total_steps) : 0;
      return el('tr', { dataset: { job: j.id } }, el('td', {}, jobLink(j)), el('td', {}, j.owner),
        el('td', {}, statusBadge(j.status)),
        el('td', {}, `${j.step} / ${j.total_steps}`,
          el('div', { class: 'progress thin' }, el('span', { style: { width: `${p.toFixed(1)}%` } }))));
    }) : [el('tr', {}, el('td', { colspan: 4, class: 'muted' }, 'Nothing running.'))]));
  }
  const queue = $('#queue');
  if (queue && state.queue) {
    queue.replaceChildren(...(state.queue.length ? state.queue.map((j) => el('tr', { dataset: { job: j.id } },
      el('td', { class: 'num' }, j.queue_position ?? '–'), el('td', {}, jobLink(j)), el('td', {}, j.owner),
      el('td', { class: 'num' }, j.slots), el('td', {}, j.status_reason || '')))
      : [el('tr', {}, el('td', { colspan: 5, class: 'muted' }, 'The queue is empty.'))]));
  }
}

function onMessage(msg) {
  if (msg.type === 'snapshot' || msg.type === 'nodes') {
    if (Array.isArray(msg.nodes)) {
      state.nodes = msg.nodes;
      renderNodes();
    }
  }
  if (msg.type === 'snapshot' || msg.type === 'jobs') {
    if (Array.isArray(msg.queue)) state.queue = msg.queue;
    if (Array.isArray(msg.running)) state.running = msg.running;
    renderJobs();
  }
}

function showNodeError(text) {
  const box = $('#node-error');
  if (!box) return;
  box.textContent = text || '';
  box.hidden = !text;
}

// The API's answer is the node: show it at once (the cluster socket pushes the change too).
function applyNode(name, data) {
  if (data && data.name === name && state.nodes) {
    state.nodes = state.nodes.map((n) => (n.name === name ? { ...n, ...data } : n));
    renderNodes();
  }
}

async function clearQuarantine(name, button) {
  button.disabled = true;
  const r = await postJSON(`/api/v1/nodes/${encodeURIComponent(name)}/clear/`, {});
  if (!r.ok) {
    button.disabled = false;
    showNodeError(`Clear quarantine of ${name} refused: ${errorText(r.data, r.status)}`);
    return;
  }
  showNodeError('');
  applyNode(name, r.data);
}

const ACTION_NAMES = { cordon: 'Cordon', uncordon: 'Uncordon', drain: 'Drain' };

async function nodeAction(name, action, mode, button) {
  if (button) button.disabled = true;
  const r = await postJSON(`/api/v1/nodes/${encodeURIComponent(name)}/${action}/`, mode ? { mode } : {});
  if (!r.ok) {
    if (button) button.disabled = false;
    const what = `${ACTION_NAMES[action] || action}${mode ? ` (${mode})` : ''}`;
    showNodeError(`${what} of ${name} refused: ${errorText(r.data, r.status)}`);
    return;
  }
  showNodeError('');
  applyNode(name, r.data);
}

// Drain (preempt) stops running work: ask first, inline (no window.confirm).
let pendingDrain = null;

function askPreempt(name) {
  pendingDrain = name;
  $('#node-question').textContent = `Drain ${name} now? Running jobs on ${name} will checkpoint and move ` +
    'to other nodes; it takes no new work until uncordoned.';
  $('#node-confirm').hidden = false;
  $('#node-yes').disabled = false;
  $('#node-yes').focus();
}

function closeConfirm() {
  pendingDrain = null;
  $('#node-confirm').hidden = true;
}

function onNodeButton(b) {
  const { action, node, mode } = b.dataset;
  if (action === 'clear') clearQuarantine(node, b);
  else if (action === 'drain' && mode === 'preempt') askPreempt(node);
  else if (action === 'cordon' || action === 'uncordon' || action === 'drain') nodeAction(node, action, mode, b);
}

const nodesBox = $('#nodes');
if (nodesBox) {
  nodesBox.addEventListener('click', (ev) => {
    const b = ev.target.closest('button[data-action]');
    if (b) onNodeButton(b);
  });
}
if ($('#node-confirm')) {
  $('#node-yes').addEventListener('click', () => {
    const name = pendingDrain;
    $('#node-yes').disabled = true;
    closeConfirm();
    if (name) nodeAction(name, 'drain', 'preempt', null);
  });
  $('#node-no').addEventListener('click', closeConfirm);
}

// Heartbeat ages tick locally; the data itself only changes when the server pushes.
setInterval(() => {
  for (const t of $$('time[data-ago]')) t.textContent = fmtAgo(t.getAttribute('datetime'));
}, 1000);

const socket = new LiveSocket('/ws/cluster/', { onMessage, onState: bindIndicator($('#live-indicator')) }).start();
window.trainyard = { socket, state, onMessage };
