// Quota page (staff): each row edits one team's (or user's) quota in place with PUT /api/v1/quotas/
// (CSRF token, field errors next to their inputs), and the numbers follow the cluster: whenever
// /ws/cluster/ pushes (jobs started, ended, queued; quotas changed) the page re-reads GET
// /api/v1/quotas/, at most once every 2 s. The audit log below is the server's own fragment
// (/quotas/?part=audit), re-read after a save or when a quota changed elsewhere.
import { LiveSocket, bindIndicator } from './live.js';
import { $, $$, el, errorText, getJSON, isNum, putJSON } from './util.js';

const FIELDS = ['max_slots', 'device_hours'];
const REFRESH_MIN_MS = 2000;
const state = { rows: new Map(), fetches: 0, auditFetches: 0, saves: 0 };

const keyOf = (r) => (r.team !== null && r.team !== undefined ? `team:${r.team}` : `user:${r.user}`);
const rowEl = (key) => $$('#quota-rows tr[data-kind]').find((tr) => `${tr.dataset.kind}:${tr.dataset.name}` === key);
const fmtHours = (v) => (isNum(v) ? String(Number(v.toFixed(2))) : '');
const inputValue = (v) => (v === null || v === undefined ? '' : String(v));

// ---------------------------------------------------------------- rendering

function setCell(tr, col, text) {
  const td = $(`td[data-col="${col}"]`, tr);
  if (td) td.textContent = text;
}

// Numbers always follow the server; an input only when the user is not editing it.
function renderRow(tr, r, { force = false } = {}) {
  setCell(tr, 'in_use', String(r.in_use ?? 0));
  setCell(tr, 'borrowed', String(r.borrowed ?? 0));
  setCell(tr, 'queued', String(r.queued ?? 0));
  const used = fmtHours(r.device_hours_used) || '0';
  setCell(tr, 'device_hours_used', isNum(r.device_hours) ? `${used} / ${fmtHours(r.device_hours)}` : used);
  tr.classList.toggle('over', isNum(r.max_slots) && (r.in_use || 0) > r.max_slots);
  for (const f of FIELDS) {
    const input = $(`input[name="${f}"]`, tr);
    if (!input) continue;
    const server = inputValue(r[f]);
    const editing = document.activeElement === input || input.value !== (input.dataset.server ?? input.value);
    if (force || !editing) input.value = server;
    input.dataset.server = server;
  }
}

function newRow(r) {
  const kind = r.team !== null && r.team !== undefined ? 'team' : 'user';
  const name = kind === 'team' ? r.team : r.user;
  const input = (f, step, placeholder, label) => el('td', {}, el('input', {
    type: 'number', min: 0, step, name: f, class: 'q-input', placeholder, 'aria-label': label }));
  return el('tr', { dataset: { kind, name } },
    el('td', {}, el('b', {}, name), kind === 'user' ? [' ', el('span', { class: 'badge' }, 'user')] : ''),
    input('max_slots', 1, 'none', 'max slots'),
    el('td', { class: 'num', dataset: { col: 'in_use' } }), el('td', { class: 'num', dataset: { col: 'borrowed' } }),
    el('td', { class: 'num', dataset: { col: 'queued' } }),
    input('device_hours', 'any', 'no limit', 'device-hours limit'),
    el('td', { class: 'num', dataset: { col: 'device_hours_used' } }),
    el('td', { class: 'actions-cell' }, el('button', { type: 'button', class: 'small', dataset: { action: 'save' } },
      'Save'), ' ', el('span', { class: 'row-note', role: 'status' })));
}

// Returns true when a quota (not just usage) differs from what the page had: the audit log moved.
function applyRows(rows, { force = null } = {}) {
  let quotasMoved = false;
  const body = $('#quota-rows');
  for (const r of rows || []) {
    const key = keyOf(r);
    const before = state.rows.get(key);
    if (before && (before.max_slots !== r.max_slots || before.device_hours !== r.device_hours)) quotasMoved = true;
    state.rows.set(key, r);
    let tr = rowEl(key);
    if (!tr) {
      $('tr:not([data-kind])', body)?.remove();  // the empty state
      tr = newRow(r);
      body.append(tr);
    }
    renderRow(tr, r, { force: force === key });
  }
  return quotasMoved;
}

// ---------------------------------------------------------------- errors and notes

function clearErrors(tr) {
  for (const p of $$('.field-error', tr)) p.remove();
  for (const i of $$('input', tr)) i.removeAttribute('aria-invalid');
}

function showFieldError(tr, field, text) {
  const input = $(`input[name="${field}"]`, tr);
  if (!input) return false;
  input.setAttribute('aria-invalid', 'true');
  input.after(el('p', { class: 'field-error', dataset: { errorFor: field } }, text));
  return true;
}

function setRowNote(tr, text, bad = false) {
  const note = $('.row-note', tr);
  note.textContent = text;
  note.classList.toggle('bad', bad);
  note.classList.toggle('ok', !bad && !!text);
}

function setPageNote(text, bad = false) {
  const note = $('#quota-note');
  note.textContent = text || '';
  note.hidden = !text;
  note.classList.toggle('bad', bad);
}

// {"errors": {"max_slots": [...], "0.device_hours": [...], "detail": [...]}}: field errors go under
// their inputs, the rest into the row's note.
function showErrors(tr, data, status) {
  const errors = data && data.errors;
  if (!errors) {
    setRowNote(tr, `Not saved: ${errorText(data, status)}`, true);
    return;
  }
  const rest = {};
  for (const [key, msgs] of Object.entries(errors)) {
    const field = key.replace(/^\d+\./, '');
    const text = (Array.isArray(msgs) ? msgs : [msgs]).join(' ');
    if (!FIELDS.includes(field) || !showFieldError(tr, field, text)) rest[key] = msgs;
  }
  const other = Object.keys(rest).length ? errorText({ errors: rest }, status) : '';
  setRowNote(tr, other ? `Not saved: ${other}` : 'Not saved.', true);
}

// ---------------------------------------------------------------- saving

// "" -> null; a number stays a number; anything else goes as typed so the server names the problem.
function readField(input) {
  const raw = input.value.trim();
  if (raw === '') return input.validity.badInput ? input.value : null;
  const n = Number(raw);
  return Number.isFinite(n) ? n : raw;
}

function describe(r) {
  const hours = isNum(r.device_hours) ? `${fmtHours(r.device_hours)} device-hours` : 'no device-hour limit';
  return `${r.max_slots} slots, ${hours}`;
}

async function save(tr, button) {
  const kind = tr.dataset.kind;
  const name = tr.dataset.name;
  const body = { [kind]: name };
  for (const f of FIELDS) body[f] = readField($(`input[name="${f}"]`, tr));
  clearErrors(tr);
  setPageNote('');
  setRowNote(tr, 'Saving…');
  button.disabled = true;
  state.saves += 1;
  const r = await putJSON('/api/v1/quotas/', body);
  button.disabled = false;
  if (!r.ok) {
    showErrors(tr, r.data, r.status);
    return;
  }
  const key = `${kind}:${name}`;
  applyRows(r.data && r.data.results, { force: key });
  const saved = state.rows.get(key);
  setRowNote(tr, 'Saved.');
  setPageNote(saved ? `Saved the quota of ${kind} ${name}: ${describe(saved)}.` : '');
  refreshAudit();
}

// ---------------------------------------------------------------- live refresh

async function refreshAudit() {
  state.auditFetches += 1;
  try {
    const resp = await fetch('/quotas/?part=audit', { credentials: 'same-origin' });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    // The server's own template (escaped there): parsed, never assigned as innerHTML.
    const doc = new DOMParser().parseFromString(`<table>${await resp.text()}</table>`, 'text/html');
    const fresh = doc.querySelector('#quota-audit');
    if (fresh) $('#quota-audit').replaceWith(document.adoptNode(fresh));
  } catch (err) {
    console.warn('trainyard: could not refresh the quota audit log', err);
  }
}

async function refreshRows() {
  state.fetches += 1;
  try {
    const data = await getJSON('/api/v1/quotas/');
    if (applyRows(data.results)) refreshAudit();
  } catch (err) {
    console.warn('trainyard: could not refresh quotas', err);
  }
}

let timer = null;
let last = 0;
function refreshSoon() {
  if (timer) return;
  const wait = Math.max(0, REFRESH_MIN_MS - (performance.now() - last));
  timer = setTimeout(() => {
    timer = null;
    last = performance.now();
    refreshRows();
  }, wait);
}

// Any cluster push may have moved usage (jobs start, end, queue) or quotas: re-read the table.
function onMessage(msg) {
  if (msg.type === 'snapshot' || msg.type === 'jobs' || msg.type === 'nodes') refreshSoon();
}

// ---------------------------------------------------------------- start

function seedFromPage() {
  for (const tr of $$('#quota-rows tr[data-kind]')) {
    const r = { team: tr.dataset.kind === 'team' ? tr.dataset.name : null,
      user: tr.dataset.kind === 'user' ? tr.dataset.name : null };
    for (const f of FIELDS) {
      const input = $(`input[name="${f}"]`, tr);
      input.dataset.server = input.value;
      r[f] = input.value === '' ? null : Number(input.value);
    }
    state.rows.set(keyOf(r), r);
  }
}

const body = $('#quota-rows');
seedFromPage();
body.addEventListener('click', (ev) => {
  const b = ev.target.closest('button[data-action="save"]');
  if (b) save(b.closest('tr'), b);
});
body.addEventListener('keydown', (ev) => {
  if (ev.key !== 'Enter' || !ev.target.matches('input.q-input')) return;
  ev.preventDefault();
  const tr = ev.target.closest('tr');
  save(tr, $('button[data-action="save"]', tr));
});

const socket = new LiveSocket('/ws/cluster/', { onMessage, onState: bindIndicator($('#live-indicator')) }).start();
window.trainyard = { socket, state, onMessage, refreshRows };
