// The job page's profile panel: what bounds the running attempt's step (compute, communication or
// data wait, jobs/attempts/policy/profiling.py), the shares, the recommendation with its predicted gain, and
// an Apply button (owner, team or staff: whoever sees the page) that POSTs
// /api/v1/jobs/<id>/apply_recommendation/ with the change shown, so a newer recommendation is a 409.
import { $, el, postJSON, errorText } from './util.js';

const NAMES = { compute: 'compute-bound', communication: 'communication-bound', input: 'input-bound',
  unknown: 'not enough telemetry' };
const SHARES = [['compute', 'compute + optimizer'], ['communication', 'exposed communication'],
  ['input', 'data wait']];

const pct = (x) => `${(100 * x).toFixed(0)}%`;

export class ProfilePanel {
  constructor(root, jobId, { onApplied } = {}) {
    this.root = root;
    this.jobId = jobId;
    this.onApplied = onApplied || (() => {});
    this.profile = null;
    this.running = false;
    this.busy = false;
    $('.profile-apply', root).addEventListener('click', () => this.apply());
  }

  // profile: the job JSON's `profile` (null when no attempt runs); status: the job's status.
  render(profile, status) {
    this.profile = profile || null;
    this.running = status === 'RUNNING';
    const p = this.profile;
    this.root.hidden = !p;
    if (!p) return;
    this.root.dataset.class = p.class;
    $('.profile-class', this.root).textContent = NAMES[p.class] || p.class;
    const bars = $('.profile-shares', this.root);
    bars.replaceChildren(...(p.shares ? SHARES.map(([k, label]) => el('li', { dataset: { share: k } },
      el('span', { class: 'share-label' }, label),
      el('span', { class: 'share-bar' }, el('span', { style: { width: pct(p.shares[k]) } })),
      el('b', {}, pct(p.shares[k])))) : [el('li', { class: 'muted' }, p.reason || '')]));
    const rec = p.recommendation;
    $('.profile-text', this.root).textContent = rec ? rec.text : '';
    const gain = $('.profile-gain', this.root);
    gain.hidden = !(rec && rec.predicted_gain > 0);
    if (rec) {
      gain.textContent = `predicted ${pct(rec.predicted_gain)} faster (step ${rec.predicted_step_s.toFixed(3)} s ` +
        `instead of ${p.window.step_s.toFixed(3)} s)`;
    }
    const flops = p.achieved_tflops ? ` · compute at ${(1000 * p.achieved_tflops).toFixed(1)} GFLOP/s per rank` : '';
    $('.profile-window', this.root).textContent = p.window
      ? `median of ${p.window.ranks} ranks over steps ${p.window.from_step}–${p.window.to_step}${flops}` : '';
    const button = $('.profile-apply', this.root);
    button.hidden = !(rec && rec.change);
    button.disabled = this.busy || !this.running;
  }

  async apply() {
    const rec = this.profile && this.profile.recommendation;
    if (!rec || !rec.change || this.busy) return;
    this.busy = true;
    $('.profile-apply', this.root).disabled = true;
    const r = await postJSON(`/api/v1/jobs/${this.jobId}/apply_recommendation/`, { change: rec.change });
    this.busy = false;
    const note = $('.profile-note', this.root);
    note.hidden = false;
    note.classList.toggle('bad', !r.ok);
    note.textContent = r.ok
      ? 'Applied: the job restarts from its latest checkpoint with ' +
        Object.entries(rec.change).map(([k, v]) => `${k} ${v}`).join(', ') + '.'
      : `Apply refused: ${errorText(r.data, r.status)}`;
    if (r.ok && r.data) this.onApplied(r.data);
    else this.render(this.profile, this.running ? 'RUNNING' : '');
  }
}
