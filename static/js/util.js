// Small DOM and formatting helpers shared by the pages (no framework, no build step).

// The job statuses after which a job no longer moves: trainyard/status.py, which every page carries
// (templates/base.html, a json_script) so there is no copy here to fall out of step.
export const TERMINAL = new Set(readJSONScript('job-statuses')?.terminal);

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

// el('td', {class: 'num', title: 'x'}, 'text', otherNode) -> element. null/false children are skipped.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k === 'dataset') Object.assign(node.dataset, v);
    else if (k === 'style' && typeof v === 'object') Object.assign(node.style, v);
    else node.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export function statusBadge(status) {
  return el('span', { class: `status s-${String(status || '').toLowerCase()}` }, status || '');
}

export function isNum(v) {
  return typeof v === 'number' && Number.isFinite(v);
}

// 1234 -> "1.23k", 0.000123 -> "0.000123"
export function fmtNum(v, digits = 3) {
  if (!isNum(v)) return '–';
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toPrecision(digits) + 'G';
  if (a >= 1e6) return (v / 1e6).toPrecision(digits) + 'M';
  if (a >= 1e4) return (v / 1e3).toPrecision(digits) + 'k';
  if (a >= 100) return v.toFixed(0);
  if (a === 0) return '0';
  return Number(v.toPrecision(digits)).toString();
}

export function fmtSeconds(s) {
  if (!isNum(s)) return '–';
  if (s === 0) return '0';
  if (s < 1e-3) return (s * 1e6).toFixed(0) + ' µs';
  if (s < 1) return (s * 1e3).toPrecision(3) + ' ms';
  if (s < 120) return s.toPrecision(3) + ' s';
  const m = Math.floor(s / 60), sec = Math.round(s % 60);
  if (m < 120) return `${m} min ${sec} s`;
  return `${Math.floor(m / 60)} h ${m % 60} min`;
}

export function fmtBytes(b) {
  if (!isNum(b)) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function fmtClock(iso) {
  if (!iso) return '';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return '';
  return d.toLocaleTimeString([], { hour12: false });
}

export function fmtDateTime(iso) {
  if (!iso) return '';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return '';
  return d.toLocaleString([], { hour12: false, year: 'numeric', month: '2-digit', day: '2-digit',
    hour: '2-digit', minute: '2-digit', second: '2-digit' });
}

export function fmtAgo(iso, now = Date.now()) {
  if (!iso) return 'never';
  const s = Math.max(0, (now - new Date(iso).getTime()) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

export async function getJSON(url) {
  const resp = await fetch(url, { credentials: 'same-origin', headers: { Accept: 'application/json' } });
  if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
  return resp.json();
}

// Runs fn at most once per animation frame and at most every minMs: many socket messages, one redraw.
export function frameThrottle(fn, minMs = 100) {
  let queued = false, last = 0, timer = null;
  const run = () => {
    queued = false;
    last = performance.now();
    fn();
  };
  return function schedule() {
    if (queued) return;
    queued = true;
    const wait = Math.max(0, minMs - (performance.now() - last));
    clearTimeout(timer);
    // rAF stops in hidden tabs; the timeout keeps data flowing into the DOM in the background too.
    timer = setTimeout(() => {
      if (document.hidden) run();
      else requestAnimationFrame(run);
    }, wait);
  };
}

export function readJSONScript(id) {
  const node = document.getElementById(id);
  return node ? JSON.parse(node.textContent) : null;
}

// Django's CSRF token: the csrftoken cookie, else the hidden input of any form on the page (base.html's
// logout form always has one). DRF's session auth wants it in X-CSRFToken on every unsafe request.
export function csrfToken() {
  const m = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
  if (m) return decodeURIComponent(m[1]);
  const input = document.querySelector('input[name=csrfmiddlewaretoken]');
  return input ? input.value : '';
}

// Send a JSON body with the session and CSRF token -> {ok, status, data}; never throws on a 4xx/5xx.
export async function sendJSON(method, url, body = {}) {
  let resp;
  try {
    resp = await fetch(url, {
      method, credentials: 'same-origin', body: JSON.stringify(body),
      headers: { Accept: 'application/json', 'Content-Type': 'application/json', 'X-CSRFToken': csrfToken() },
    });
  } catch (err) {
    return { ok: false, status: 0, data: { errors: { detail: [`network error: ${err.message || err}`] } } };
  }
  let data = null;
  try {
    data = await resp.json();
  } catch (err) {
    data = null;
  }
  return { ok: resp.ok, status: resp.status, data };
}

export const postJSON = (url, body = {}) => sendJSON('POST', url, body);
export const putJSON = (url, body = {}) => sendJSON('PUT', url, body);

// The API's {"errors": {"field": ["msg", ...]}} (or DRF's bare {"detail": "..."}) as one line of text.
export function errorText(data, status) {
  const errors = (data && (data.errors || data)) || {};
  const parts = [];
  for (const [field, msgs] of Object.entries(errors)) {
    const text = (Array.isArray(msgs) ? msgs : [msgs]).filter((m) => typeof m === 'string').join(' ');
    if (text) parts.push(field === 'detail' || field === 'non_field_errors' ? text : `${field}: ${text}`);
  }
  return parts.join('; ') || `the server answered HTTP ${status || '?'}`;
}

// Replace a container's children, keeping open the <details data-key> that were open before, so a
// live re-render does not snap shut what the user expanded.
export function replaceKeepingOpen(container, nodes) {
  const open = new Set($$('details[open][data-key]', container).map((d) => d.dataset.key));
  container.replaceChildren(...nodes);
  if (!open.size) return;
  for (const d of $$('details[data-key]', container)) if (open.has(d.dataset.key)) d.open = true;
}
