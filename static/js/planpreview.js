// Submit page: the planner's plan for the spec being edited, live. Each edit (debounced) posts the
// spec to POST /api/v1/plan/ as {"spec": ...}, which plans it exactly as a submit would (the
// cluster's devices, the calibrated constants): with parallel auto, the plan the job would get;
// with an explicit parallel section, the planner's prediction for it and the best alternative.
// Only the newest answer is shown (an older request that returns late is dropped).
import { load as yamlLoad } from '../vendor/js-yaml-5.5.0/js-yaml.esm.min.js';
import { $, el, postJSON, errorText, fmtSeconds } from './util.js';

const DEBOUNCE_MS = 400;
const card = $('#plan-preview');
const text = $('#id_spec');
let timer = null;
let seq = 0;
let lastSent = null;

function specOf(src) {
  try {
    return JSON.parse(src);
  } catch (e) {
    try {
      return yamlLoad(src);
    } catch (e2) {
      return null;
    }
  }
}

export function planLabel(p) {
  const bits = [`dp ${p.dp}`, `tp ${p.tp}`, `pp ${p.pp}`, `micro-batch ${p.micro_batch}`];
  if (p.fsdp) bits.push('fsdp');
  if (p.shard_optimizer) bits.push('ZeRO-1');
  if (p.recompute && p.recompute !== 'none') bits.push(`recompute ${p.recompute}`);
  if (p.pp > 1) bits.push(p.schedule);
  return bits.join(' · ');
}

function figures(p) {
  return `${fmtSeconds(p.step_time_s)} a step, ${p.memory_gb_per_device.toFixed(3)} GB and `
    + `${p.tflops_per_device.toFixed(3)} TFLOP/s per device`;
}

function show(status, data) {
  const body = $('#plan-preview-body');
  if (status !== 200) {
    body.replaceChildren(el('p', { class: 'field-error', id: 'plan-preview-error' }, errorText(data, status)));
    return;
  }
  const plans = data.plans || [];
  const nodes = [];
  if (data.spec_plan) {
    nodes.push(el('p', { id: 'plan-preview-yours' }, `Your plan (${planLabel(data.spec_plan)}): ${figures(data.spec_plan)}.`));
  }
  if (!plans.length) {
    nodes.push(el('p', { class: 'field-error', id: 'plan-preview-error' }, data.shortfall || 'no plan fits'));
  } else {
    const best = plans[0];
    nodes.push(el('p', { id: 'plan-preview-best' }, el('b', {}, planLabel(best)), `: ${figures(best)}`));
    nodes.push(el('p', { class: 'muted' }, best.explain));
    const rest = (data.runners_up || []).map((r) => el('li', {}, el('b', {}, r.label), ` ${r.why}`));
    if (rest.length) nodes.push(el('ul', { class: 'plan-runners', id: 'plan-preview-runners' }, ...rest));
    nodes.push(el('p', { class: 'muted' }, `${plans.length} feasible plans, ${data.rejected_count ?? (data.rejected || []).length} rejected; constants: ${data.constants_source || 'default'}`));
  }
  body.replaceChildren(...nodes);
}

async function refresh() {
  const spec = specOf(text.value);
  if (!spec || typeof spec !== 'object' || spec.entrypoint || spec.code) {
    card.hidden = true;
    return;
  }
  const key = JSON.stringify(spec);
  if (key === lastSent) return;
  lastSent = key;
  card.hidden = false;
  const mine = ++seq;
  card.dataset.state = 'loading';
  const { status, data } = await postJSON('/api/v1/plan/', { spec });
  if (mine !== seq) return;
  show(status, data);
  card.dataset.state = status === 200 ? 'ok' : 'error';
  card.dataset.requests = String(mine);
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(refresh, DEBOUNCE_MS);
}

if (card && text) {
  $('#submit-form').addEventListener('input', schedule);
  $('#submit-form').addEventListener('change', schedule);
  // submit.js rewrites the text when a field changes, and fills it on load: watch the value too.
  setInterval(() => { if (JSON.stringify(specOf(text.value)) !== lastSent) schedule(); }, 1000);
  schedule();
}
