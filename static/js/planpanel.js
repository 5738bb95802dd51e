// The planner's prediction next to what the job measures (parallel: auto jobs; the server renders
// the predicted row in templates/jobs/_plan_auto.html). Measured: the median over the last 20 steps
// of the ranks' mean step time, the largest memory any rank reported in them, and the FLOPs of one
// step (the planner's, recomputation included) over that step time per device.
import { $, fmtSeconds, fmtBytes, isNum } from './util.js';

const WINDOW = 20;

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  if (!s.length) return null;
  const mid = s.length >> 1;
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

// `steps`: the page's StepStore (each step's mean over ranks and max of mem_bytes, issue 26).
export function measuredPlan(steps, window = WINDOW) {
  const stepTimes = [];
  let mem = null;
  for (let i = steps.steps.length - 1; i >= 0 && stepTimes.length < window; i--) {
    const row = steps.rows.get(steps.steps[i]);
    if (Array.isArray(row.step_s) && isNum(row.step_s[1])) stepTimes.push(row.step_s[1]);
    if (Array.isArray(row.mem_bytes) && isNum(row.mem_bytes[2])) mem = Math.max(mem ?? 0, row.mem_bytes[2]);
  }
  return { stepS: median(stepTimes), memBytes: mem, steps: stepTimes.length };
}

export function renderPlanMeasured(store) {
  const panel = $('#plan-auto');
  if (!panel) return;
  const m = measuredPlan(store);
  if (!isNum(m.stepS)) return;
  $('#plan-meas-step').textContent = fmtSeconds(m.stepS);
  if (isNum(m.memBytes)) $('#plan-meas-mem').textContent = fmtBytes(m.memBytes);
  const flops = Number(panel.dataset.flopsPerStep);
  const world = Number(panel.dataset.world) || 1;
  if (flops > 0) $('#plan-meas-tflops').textContent = (flops / m.stepS / world / 1e12).toFixed(3);
}
