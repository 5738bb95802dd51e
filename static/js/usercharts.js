// The job page's charts of the user's own metrics (one card per metric name the job reports, after the
// standard charts) and the "telemetry unavailable" notice for a job whose code never sent a sample.
import { userMetricChart } from './charts.js';
import { el, TERMINAL } from './util.js';

// Adds a chart for every metric name in the store that has none yet; returns how many it added.
export function addUserCharts(container, store, charts) {
  let added = 0;
  for (const name of [...store.metricNames].sort()) {
    const key = `metric:${name}`;
    if (charts[key]) continue;
    const root = el('section', { class: 'card chart user-metric', dataset: { metric: name, points: '0' } },
      el('div', { class: 'chart-head' }, el('h2', {}, name, ' ', el('small', {}, 'your metric: the lowest rank, min–max band'))),
      el('div', { class: 'chart-plot' }, el('p', { class: 'chart-empty' }, 'Waiting for the first step…')));
    container.append(root);
    charts[key] = userMetricChart(root, name);
    added += 1;
  }
  return added;
}

// Decided from data: `hasTelemetry` is the server's has_telemetry (a sample stored for the job) or a
// sample received here. A finished job without any says so instead of showing empty charts; a running
// one keeps its charts (samples may still come) and says why they could stay empty once its attempt
// has run for a while.
export function renderTelemetryNote(note, charts, { status, hasTelemetry, runningSince }) {
  const finished = TERMINAL.has(status);
  const quietRun = status === 'RUNNING' && runningSince && Date.now() - Date.parse(runningSince) > 30000;
  const show = !hasTelemetry && (finished || quietRun);
  note.hidden = !show;
  note.dataset.state = show ? (finished ? 'unavailable' : 'waiting') : '';
  if (show) {
    note.textContent = finished
      ? 'Telemetry unavailable: no attempt of this job sent metrics (its code does not use the Trainyard SDK, or it stopped before its first step). Its logs are below.'
      : "No telemetry yet: if this job's code does not use the Trainyard SDK it sends none (its logs are below).";
  }
  charts.hidden = show && finished;
}
