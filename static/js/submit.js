// Submit page: the common-option fields and the JSON/YAML spec text are two views of one spec.
// Editing a field rewrites the text (in the text's own format); editing the text refills the fields.
// The form posts the text alone; the server parses and validates it and puts errors next to fields.
import { load as yamlLoad, dump as yamlDump } from '../vendor/js-yaml-5.5.0/js-yaml.esm.min.js';
import { $, $$, readJSONScript } from './util.js';

const text = $('#id_spec');
const status = $('#editor-status');
const fields = $$('[data-path]');
const demo = readJSONScript('demo-spec');
let format = 'json';

function parse(src) {
  const trimmed = src.trim();
  if (!trimmed) return { error: 'the spec is empty' };
  try {
    return { obj: JSON.parse(trimmed), format: 'json' };
  } catch (jsonErr) {
    try {
      const obj = yamlLoad(trimmed);
      return { obj, format: /^\s*[{[]/.test(trimmed) ? 'json' : 'yaml' };
    } catch (yamlErr) {
      return { error: `neither valid JSON nor YAML: ${String(yamlErr.message || yamlErr).split('\n')[0]}` };
    }
  }
}

// {"a": 1, "b": {"c": 2}} with one top-level key per line and nested values inline, like the demo.
function compactJSON(v) {
  if (Array.isArray(v)) return `[${v.map(compactJSON).join(', ')}]`;
  if (v && typeof v === 'object') {
    return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${compactJSON(x)}`).join(', ')}}`;
  }
  return JSON.stringify(v);
}

function serialize(obj, fmt) {
  if (fmt === 'yaml') return yamlDump(obj, { flowLevel: 1, lineWidth: 120 });
  const lines = Object.entries(obj).map(([k, v]) => `  ${JSON.stringify(k)}: ${compactJSON(v)}`);
  return `{\n${lines.join(',\n')}\n}`;
}

function getPath(obj, path) {
  let cur = obj;
  for (const part of path.split('.')) {
    if (!cur || typeof cur !== 'object' || !(part in cur)) return undefined;
    cur = cur[part];
  }
  return cur;
}

function setPath(obj, path, value) {
  const parts = path.split('.');
  let cur = obj;
  for (const part of parts.slice(0, -1)) {
    if (!cur[part] || typeof cur[part] !== 'object' || Array.isArray(cur[part])) {
      if (value === undefined) return;
      cur[part] = {};
    }
    cur = cur[part];
  }
  const last = parts[parts.length - 1];
  if (value === undefined) {
    delete cur[last];
    // drop a section left empty by the deletion, so removing a field removes its noise too
    if (parts.length > 1 && !Object.keys(cur).length) setPath(obj, parts.slice(0, -1).join('.'), undefined);
  } else {
    cur[last] = value;
  }
}

function fieldValue(input) {
  const raw = input.value.trim();
  if (raw === '') return undefined;
  const kind = input.dataset.kind;
  if (kind === 'int' && /^[-+]?\d+$/.test(raw)) return parseInt(raw, 10);
  if (kind === 'float' && raw !== '' && Number.isFinite(Number(raw))) return Number(raw);
  if (kind === 'bool' && (raw === 'true' || raw === 'false')) return raw === 'true';
  return raw; // a malformed number goes through as text; the server names the field in its error
}

function setStatus(msg, bad = false) {
  status.textContent = msg;
  status.classList.toggle('bad', bad);
}

function setFormat(fmt) {
  format = fmt;
  for (const b of $$('#format-toggle button')) b.setAttribute('aria-pressed', String(b.dataset.format === fmt));
}

function fillFields(obj) {
  for (const input of fields) {
    if (input === document.activeElement) continue;
    const v = getPath(obj, input.dataset.path);
    input.value = v === undefined || v === null || typeof v === 'object' ? '' : String(v);
  }
}

// An entrypoint job (the user's own code) has no built-in model or data: their fields would only
// add the keys the server refuses next to an entrypoint, so they are off while the spec has one.
function builtinGroups(obj) {
  const userCode = !!(obj && typeof obj === 'object' && obj.entrypoint);
  for (const fs of $$('#spec-fields fieldset[data-group="model"], #spec-fields fieldset[data-group="data"]')) {
    fs.disabled = userCode;
    fs.title = userCode ? 'an entrypoint job runs its own code: no built-in model or data' : '';
  }
}

function textChanged() {
  const r = parse(text.value);
  if (r.error || !r.obj || typeof r.obj !== 'object' || Array.isArray(r.obj)) {
    setStatus(r.error || 'the spec must be a mapping (an object)', true);
    return;
  }
  setFormat(r.format);
  fillFields(r.obj);
  builtinGroups(r.obj);
  setStatus('');
}

function fieldChanged(ev) {
  const input = ev.target;
  const r = parse(text.value);
  if (r.error || !r.obj || typeof r.obj !== 'object' || Array.isArray(r.obj)) {
    setStatus(`fix the spec text before using the fields: ${r.error || 'it must be a mapping'}`, true);
    return;
  }
  setPath(r.obj, input.dataset.path, fieldValue(input));
  text.value = serialize(r.obj, r.format);
  setFormat(r.format);
  setStatus('');
}

let textTimer = null;
text.addEventListener('input', () => {
  clearTimeout(textTimer);
  textTimer = setTimeout(textChanged, 150);
});
for (const input of fields) {
  input.addEventListener(input.tagName === 'SELECT' ? 'change' : 'input', fieldChanged);
}
$('#format-toggle').addEventListener('click', (ev) => {
  const b = ev.target.closest('button[data-format]');
  if (!b) return;
  const r = parse(text.value);
  if (r.error) {
    setStatus(`cannot convert: ${r.error}`, true);
    return;
  }
  text.value = serialize(r.obj, b.dataset.format);
  setFormat(b.dataset.format);
});
$('#reset-demo').addEventListener('click', () => {
  text.value = demo;
  textChanged();
});

// The fields work only with this script, so they start disabled and come alive here.
for (const fs of $$('#spec-fields fieldset')) fs.disabled = false;
$('#format-toggle').hidden = false;
$('#reset-demo').hidden = false;
const first = parse(text.value);
if (!first.error) {
  setFormat(first.format);
  builtinGroups(first.obj);
}
else setStatus(first.error, true);
window.trainyard = { parse, serialize };
