// Knowledge page, staff: the Calibrate form. POST /api/v1/calibrations/ {node, quick} (the node's
// agent runs the harness; its report stores a Calibration), then poll GET /api/v1/calibrations/
// until a row newer than the page's shows up and reload to show it. An error (a busy, lost or
// unknown node; not staff) is shown next to the form and nothing else changes.
import { $, getJSON, postJSON, errorText } from './util.js';

const POLL_MS = 3000;
const LIMIT_MS = 15 * 60 * 1000;
const form = $('#calibrate-form');

// The newest stored calibration's id (0: none yet; null: the API did not answer this time).
async function newestId() {
  try {
    const page = await getJSON('/api/v1/calibrations/');
    return page && page.results && page.results.length ? page.results[0].id : 0;
  } catch (err) {
    return null;
  }
}

async function submit(ev) {
  ev.preventDefault();
  const status = $('#calibrate-status');
  const button = form.querySelector('button[type=submit]');
  const node = form.elements.node.value;
  const before = (await newestId()) || 0;
  button.disabled = true;
  status.className = 'muted';
  status.textContent = `asking ${node} to calibrate…`;
  const { ok, status: code, data } = await postJSON(form.dataset.api, { node, quick: form.elements.quick.checked });
  if (!ok) {
    status.className = 'field-error';
    status.textContent = errorText(data, code);
    button.disabled = false;
    return;
  }
  status.textContent = `${node} is calibrating (matmuls, collectives, a grid of short runs); this page reloads when it reports`;
  const started = Date.now();
  const poll = async () => {
    const newest = await newestId();
    if (newest !== null && newest > before) {
      window.location.reload();
      return;
    }
    if (Date.now() - started > LIMIT_MS) {
      status.className = 'field-error';
      status.textContent = `no calibration from ${node} after ${LIMIT_MS / 60000} min: see the node's agent log`;
      button.disabled = false;
      return;
    }
    setTimeout(poll, POLL_MS);
  };
  setTimeout(poll, POLL_MS);
}

if (form) {
  form.hidden = false;
  form.addEventListener('submit', submit);
}
