"""Run-time prediction: how long will a job run? Pure: the history is passed in.

For the control plane (`predict`): a job's *similarity key* is its model shape (kind, layers,
hidden, heads, seq_len, vocab), batch (global_batch, grad_accum), resources (nodes,
procs_per_node, device) — everything that sets the time of one step. Past runs with the same
key give a per-step time (duration / steps run); the prediction is the median of the last `k`
(5) per-step times x the job's steps, searched at three levels, most specific first: the same
user, the same team, anyone. The median, not the mean: one run slowed by a straggler or a
restart should not move the next prediction much. Without same-key history, the knowledge
base's nearest measured configurations (`knowledge`: `MeasuredStep`s, nearest first, as
jobs/planning/selectors.py reads them) give the step time: the median warm step time of the
last `k` records of the nearest shape (same model kind and device type; distance over the
log-ratios of layers, hidden, seq_len, global batch and world size, at most
KNOWLEDGE_MAX_DISTANCE), each scaled by the model's ratio estimate_step_s(job) /
estimate_step_s(record) so a measured neighbour corrects the model's constants rather than
replacing the job's own size; source "knowledge: N runs of nearest shape". Without either it is
`STARTUP_S + steps x estimate_step_s(shape)`, a FLOP count over throughputs measured on this
repo's models (see the constants).

An entrypoint job (the user's own code) has no model shape to count FLOPs of: its key is the
code (bundle digest and entrypoint: the script or module, without the args) and the resources.
Past runs of the same code give the prediction, each as its per-step time x the job's
`train.steps` when it reported steps through the SDK, else as its whole duration (a script
without the SDK reports none). Searched like the built-in jobs' (user, team, anyone: the
same digest is the same code), then the user's runs of the same entrypoint from an earlier
bundle (code edited between uploads). Without any: no prediction (`predict_user_code` returns
`Prediction(None, "none", 0)`; the scheduler then assumes its default length).

For the simulator (`TraceHistory`): traces carry no model shapes, only the user's declared
`estimate_s` and the slots; users pad their estimates consistently (2-10x in public traces),
so the prediction is estimate_s x the median (duration / estimate) of the user's last `k`
finished jobs with the same slots and an estimate within 2x, else of the user's last `k` jobs
of any shape, else the estimate itself.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from trainyard.mesh import param_count, train_flops

HISTORY_K = 5
# torchrun launch + c10d rendezvous + model build + first checkpoint load on CPU: 10-20 s in the
# integration tests (2 ranks, loopback); the mean of that.
STARTUP_S = 15.0
# One process's training throughput, as 6 x parameters x tokens per second. CPU: one thread per
# slot (the launcher sets OMP_NUM_THREADS per slot); measured 40-55 GFLOP/s for the demo GPT
# (875k parameters, 16 x 128 tokens per rank: 0.24 s a step), a 6.5M-parameter GPT and the MLP
# on the dev machine's cores with torch 2.13. CUDA: a conservative 30% of an A100/H100-class
# device's dense bf16 peak; small models are launch-bound, hence the per-layer floor.
CPU_FLOPS_PER_PROC = 45e9
CUDA_FLOPS_PER_PROC = 100e12
CUDA_S_PER_LAYER_FLOOR = 0.0015
# Gradient all-reduce (ring: 2 (w-1)/w x 4 bytes x parameters): gloo over loopback/TCP ~1 GB/s,
# NCCL ~20 GB/s between nodes; plus a fixed per-step overhead (optimizer step, Python, telemetry).
CPU_ALLREDUCE_BYTES_PER_S = 1e9
CUDA_ALLREDUCE_BYTES_PER_S = 20e9
STEP_OVERHEAD_S = {"cpu": 0.005, "cuda": 0.003}


@dataclass(frozen=True)
class JobShape:
    user: str = ""
    team: str | None = None
    kind: str = "gpt"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 128
    vocab: int = 256
    global_batch: int = 32
    grad_accum: int = 1
    steps: int = 200
    nodes: int = 1
    procs_per_node: int = 1
    device: str = "cpu"
    entrypoint: str | None = None  # user code: the script path or "-m module"; None for a built-in model
    bundle: str | None = None      # user code: the bundle digest (None: code on the nodes' PYTHONPATH)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def key(self) -> tuple:
        """What sets the time of one step (user, team and steps left out)."""
        if self.entrypoint is not None:
            return ("entrypoint", self.entrypoint, self.bundle, self.nodes, self.procs_per_node, self.device)
        return (self.kind, self.layers, self.hidden, self.heads, self.seq_len, self.vocab, self.global_batch,
                self.grad_accum, self.nodes, self.procs_per_node, self.device)


@dataclass(frozen=True)
class PastRun:
    shape: JobShape
    duration_s: float      # wall time of the run (attempts that ran to the end, or stopped early)
    steps_run: int         # steps it actually ran (a run stopped early ran fewer than shape.steps)
    finished_at: float = 0.0


@dataclass(frozen=True)
class MeasuredStep:
    """A knowledge-base record near a job: the shape it ran and its measured warm step time."""

    shape: JobShape
    step_time_s: float
    distance: float  # jobs/planning/policy/knowledge.py's distance from the job asking


# Farther neighbours than this (e.g. one dimension 7x off, or two 4x each) say less than the model.
KNOWLEDGE_MAX_DISTANCE = 2.0


@dataclass(frozen=True)
class Prediction:
    seconds: float | None  # None: no prediction (an entrypoint job that never ran)
    source: str   # "history:user" | "history:team" | "history:any" | "history:entrypoint"
    #               | "knowledge: N runs of nearest shape" | "model" | "none"
    samples: int  # past runs the prediction rests on (0 for the model)


def shape_from_spec(spec: Mapping, user: str = "", team: str | None = None) -> JobShape:
    """A JobShape from a stored (validated, defaults filled) JobSpec dict."""
    m, t, r = spec.get("model") or {}, spec.get("train") or {}, spec.get("resources") or {}
    entry, code = spec.get("entrypoint"), spec.get("code") or {}
    d = JobShape()
    return JobShape(user=user, team=team,
                    entrypoint=None if not entry else entry.get("script") or f"-m {entry.get('module')}",
                    bundle=code.get("bundle"), kind=m.get("kind", d.kind), layers=int(m.get("layers", d.layers)),
                    hidden=int(m.get("hidden", d.hidden)), heads=int(m.get("heads", d.heads)),
                    seq_len=int(m.get("seq_len", d.seq_len)), vocab=int(m.get("vocab", d.vocab)),
                    global_batch=int(t.get("global_batch", d.global_batch)),
                    grad_accum=int(t.get("grad_accum", d.grad_accum)), steps=int(t.get("steps", d.steps)),
                    nodes=int(r.get("nodes", d.nodes)), procs_per_node=int(r.get("procs_per_node", d.procs_per_node)),
                    device=r.get("device", d.device))


def parameters(shape: JobShape) -> int:
    """Parameter count of the runtime's model of this shape (trainyard/mesh.py)."""
    return param_count(shape.kind, layers=shape.layers, hidden=shape.hidden, seq_len=shape.seq_len,
                       vocab=shape.vocab)


def estimate_step_s(shape: JobShape) -> float:
    """Seconds per training step from FLOPs and all-reduce bytes (the constants above)."""
    p = parameters(shape)
    w = max(1, shape.world_size)
    flops_per_rank = train_flops(p, shape.global_batch * shape.seq_len) / w
    if shape.device == "cuda":
        compute = max(flops_per_rank / CUDA_FLOPS_PER_PROC, CUDA_S_PER_LAYER_FLOOR * shape.layers)
        bw = CUDA_ALLREDUCE_BYTES_PER_S
    else:
        compute = flops_per_rank / CPU_FLOPS_PER_PROC
        bw = CPU_ALLREDUCE_BYTES_PER_S
    comm = 2.0 * (w - 1) / w * 4.0 * p / bw if w > 1 else 0.0
    return compute + comm + STEP_OVERHEAD_S.get(shape.device, 0.005)


def predict(shape: JobShape, history: Iterable[PastRun], *, k: int = HISTORY_K,
            knowledge: Sequence[MeasuredStep] = ()) -> Prediction:
    """Predicted run time of `shape` from past runs of similar specs, else from the knowledge
    base's nearest measured steps, else from the model (see the module docstring). An
    entrypoint job that never ran: `Prediction(None, "none", 0)`, nothing to estimate from."""
    if shape.entrypoint is not None:
        return predict_user_code(shape, history, k=k) or Prediction(None, "none", 0)
    same = [r for r in history if r.shape.key == shape.key and r.steps_run > 0 and r.duration_s > 0]
    same.sort(key=lambda r: r.finished_at)
    for source, runs in (("history:user", [r for r in same if r.shape.user == shape.user]),
                         ("history:team", [r for r in same if shape.team is not None and r.shape.team == shape.team]),
                         ("history:any", same)):
        if runs:
            last = runs[-k:]
            per_step = statistics.median(max(r.duration_s - STARTUP_S, 0.0) / r.steps_run for r in last)
            return Prediction(STARTUP_S + per_step * shape.steps, source, len(last))
    near = knowledge_step_s(shape, knowledge, k=k)
    if near is not None:
        per_step, n = near
        return Prediction(STARTUP_S + per_step * shape.steps, f"knowledge: {n} run{'s' * (n != 1)} of nearest shape", n)
    return Prediction(STARTUP_S + shape.steps * estimate_step_s(shape), "model", 0)


def knowledge_step_s(shape: JobShape, knowledge: Sequence[MeasuredStep], *, k: int = HISTORY_K
                     ) -> tuple[float, int] | None:
    """(per-step seconds, records used) from the nearest measured records, or None when none is
    within KNOWLEDGE_MAX_DISTANCE. The nearest group: every record as near as the nearest one
    (the same configuration measured again); the median of the last `k` of them (the input is
    nearest first, newest first among equals), each scaled by the model's size ratio."""
    usable = [m for m in knowledge if m.distance <= KNOWLEDGE_MAX_DISTANCE and m.step_time_s > 0
              and m.shape.kind == shape.kind]
    if not usable:
        return None
    nearest = min(m.distance for m in usable)
    group = [m for m in usable if m.distance <= nearest + 1e-9][:k]
    mine = estimate_step_s(shape)
    return statistics.median(m.step_time_s * mine / estimate_step_s(m.shape) for m in group), len(group)


def _user_code_run_s(run: PastRun, steps: int) -> float:
    # Reported steps: per-step time x this job's steps; none (no SDK): the run's whole duration.
    if run.steps_run > 0:
        return STARTUP_S + max(run.duration_s - STARTUP_S, 0.0) / run.steps_run * steps
    return run.duration_s


def predict_user_code(shape: JobShape, history: Iterable[PastRun], *, k: int = HISTORY_K) -> Prediction | None:
    """An entrypoint job's run time from past runs of the same code (the module docstring), or
    None when it never ran."""
    where = (shape.nodes, shape.procs_per_node, shape.device)
    runs = sorted((r for r in history if r.shape.entrypoint == shape.entrypoint and r.duration_s > 0
                   and (r.shape.nodes, r.shape.procs_per_node, r.shape.device) == where), key=lambda r: r.finished_at)
    same = [r for r in runs if r.shape.bundle == shape.bundle]
    for source, found in (("history:user", [r for r in same if r.shape.user == shape.user]),
                          ("history:team", [r for r in same if shape.team is not None and r.shape.team == shape.team]),
                          ("history:any", same),
                          ("history:entrypoint", [r for r in runs if r.shape.user == shape.user])):
        if found:
            last = found[-k:]
            return Prediction(statistics.median(_user_code_run_s(r, shape.steps) for r in last), source, len(last))
    return None


class TraceHistory:
    """The simulator's predictor: learns each user's (duration / declared estimate) from the jobs
    that finished so far. Ratios are clamped to [1/50, 2] so one odd job cannot make a
    prediction absurd."""

    def __init__(self, k: int = HISTORY_K):
        self.k = k
        self.by_user: dict[str, deque] = {}

    def add(self, user: str, slots: int, estimate_s: float, duration_s: float) -> None:
        if estimate_s <= 0:
            return
        ratio = min(max(duration_s / estimate_s, 0.02), 2.0)
        self.by_user.setdefault(user, deque(maxlen=64)).append((slots, estimate_s, ratio))

    def predict(self, user: str, slots: int, estimate_s: float) -> float:
        runs = self.by_user.get(user)
        if not runs:
            return estimate_s
        similar = [r for s, e, r in runs if s == slots and estimate_s / 2 <= e <= estimate_s * 2]
        ratios = similar[-self.k:] if similar else [r for _, _, r in list(runs)[-self.k:]]
        return estimate_s * statistics.median(ratios)

