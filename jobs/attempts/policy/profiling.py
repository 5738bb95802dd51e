"""Job profiling: what bounds a running job's step, and the one spec change that would help most.

Input: the attempt's recent per-rank per-step samples (step_s, data_s, compute_s, comm_s,
optim_s as workers/runtime/trainer.py defines them) and the job's stored spec. Output: a
JSON-safe profile (`profile`) that jobs/attempts/services/profiling.py stores on the attempt.

Shares of step time (per rank, over the window; then the median over ranks):
- input = data_s / step_s (waiting for the next batch);
- communication = exposed comm / step_s, exposed comm = step_s - data_s - compute_s - optim_s,
  clipped to [0, comm_s]: comm_s counts gradient averaging hidden behind backward too, and only
  the exposed part costs step time (with local SGD the averaging sits in the optimizer step and
  is all exposed, which the same difference measures);
- compute = (compute_s + optim_s) / step_s.
A rank's share is the ratio of its sums over the window's steps (a local-SGD job averages only
every few steps: a per-step median would hide it), leaving out its first WARMUP_STEPS steps of
the attempt and steps over OUTLIER x its median step (a checkpoint save blocking the step).
At least MIN_STEPS steps with every phase reported are needed, else the profile says "not
enough telemetry" (an entrypoint script that reports only step_s is never guessed at).

Classes with hysteresis: a job enters communication-bound at a share >= 0.30 and leaves below
0.20; input-bound enters at >= 0.20 and leaves below 0.12; otherwise it is compute-bound. The
enter thresholds are where the recommended change pays for its restart (which replays at most one
checkpoint interval): removing most of a 0.30 communication share is a >= 1.4x step, and a data
wait of a fifth of the step is far above what the prefetching loader shows when healthy (< 1%).
The gaps (0.10, 0.08) are wider than the spread of one job's window share between checks that
we measured on gloo (0.33-0.40 for the integration test's GPT on this 2-core machine under
load), so a job sitting at a threshold does not flap between classes on every check.

Predicted gains (documented model, per recommendation; `predicted_step_s` and `predicted_gain`,
the fractional speed-up step_s / predicted_step_s - 1):
- compression: comm time scales with the bytes handed to the collectives (bandwidth-bound
  buckets), and the hook's own arithmetic (in comm_s, trainyard/sdk/comm.py) is added: the new
  comm is comm_s x byte ratio + COMPRESSION_COST[kind] x optim_s, of which the part that still
  fits in the overlap window measured now (comm_s - exposed) stays hidden. The cost is in units
  of the job's own optimizer step, measured in the same window: both are memory-bound passes
  over every gradient-sized tensor, so the yardstick carries the device's memory speed (fast
  fused kernels on a GPU, slow single-threaded passes on this CPU). PowerSGD's 1.5 is measured:
  the integration test's GPT (hidden 512) on 2 gloo ranks went from comm_s 79 ms dense to 134 ms
  with PowerSGD at optim_s 88 ms, all but ~1 ms of it arithmetic; bf16's 0.3 counts its two
  casts, top-k's 2.0 its selection over every bucket. Byte ratios: bf16 0.5; PowerSGD rank r
  sends r x (m + n) per m x n gradient matrix torch compresses (when m x n > 2 r (m + n)), every
  1-D tensor dense, computed from the model's shapes (0.0084 for that GPT, 0.0084 measured);
  top-k 2 x ratio (index + value).
- local SGD with period p: the whole model (the same bytes as its gradients) is averaged every
  p steps, with no overlap: exposed comm becomes comm_s / p.
- a larger micro-batch (fewer gradient-accumulation micro-steps, same global batch): compute
  time scales with 1 / GEMM efficiency at the micro-batch's matrix size (the geometric mean of
  tokens x hidden x hidden), on the device's efficiency curve (MATMUL_EFF; the planner's
  calibrated DeviceConstants.matmul_eff replace it once calibrated).
- measured results overrule all of this: after an applied change the next attempt measures it
  (services.profiling, "recommendation_result"); one that made the step slower is recommended
  for reverting (predicted: the step time measured before it), one that did not pay is not
  offered again.
- input-bound: the JobSpec has no loader knob (the runtime already prefetches two batches on a
  thread, workers/runtime/data.py), so the recommendation names the cause and its gain is the
  data wait removed, with no automatic change.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from trainyard.mesh import param_count, train_flops
from trainyard.spec import JobSpec, SpecError, parse_job_spec
from trainyard.spec_parallel import COMPRESSION_COST

COMPUTE, COMM, INPUT, UNKNOWN = "compute", "communication", "input", "unknown"
ENTER = {COMM: 0.30, INPUT: 0.20}
LEAVE = {COMM: 0.20, INPUT: 0.12}
MIN_STEPS = 5
WARMUP_STEPS = 2
OUTLIER = 4.0
MIN_GAIN = 0.05  # below this a change is not worth a restart
# GEMM efficiency (achieved / best FLOP/s) against the geometric-mean matrix dimension.
# cpu: torch fp32 matmul on one thread of this machine (n x n x n: 8 -> 0.004, 16 -> 0.03,
# 32 -> 0.21, 64 -> 0.65, 128 and up -> ~1.0 of 187 GFLOP/s); cuda: a prior of the usual shape.
MATMUL_EFF = {"cpu": ((8, 0.004), (16, 0.03), (32, 0.21), (64, 0.65), (128, 1.0)),
              "cuda": ((128, 0.1), (512, 0.45), (2048, 0.8), (8192, 0.9))}


@dataclass(frozen=True)
class Shares:
    """The window's step-time split (fractions of step_s) and the medians of its seconds."""

    compute: float
    communication: float
    input: float
    step_s: float
    comm_s: float
    exposed_comm_s: float
    data_s: float
    compute_s: float
    optim_s: float
    steps: int
    ranks: int
    from_step: int
    to_step: int


def _rank_shares(rows: list[Mapping]) -> dict | None:
    med = statistics.median(r["step_s"] for r in rows)
    rows = [r for r in rows if r["step_s"] <= OUTLIER * med]
    total = sum(r["step_s"] for r in rows)
    if total <= 0:
        return None
    data = sum(r["data_s"] for r in rows)
    work = sum(r["compute_s"] + r["optim_s"] for r in rows)
    comm = sum(r["comm_s"] for r in rows)
    exposed = sum(min(r["comm_s"], max(0.0, r["step_s"] - r["data_s"] - r["compute_s"] - r["optim_s"]))
                  for r in rows)
    n = len(rows)
    return {"compute": work / total, "communication": exposed / total, "input": data / total,
            "step_s": total / n, "comm_s": comm / n, "exposed_comm_s": exposed / n, "data_s": data / n,
            "compute_s": sum(r["compute_s"] for r in rows) / n, "optim_s": sum(r["optim_s"] for r in rows) / n}


def shares(samples: Iterable[Mapping], *, first_step: int = 0) -> Shares | None:
    """The window's shares, or None without MIN_STEPS complete steps after the warm-up."""
    keys = ("step_s", "data_s", "compute_s", "comm_s", "optim_s")
    by_rank: dict[int, list[Mapping]] = {}
    for s in samples:
        if s["step"] > first_step + WARMUP_STEPS and all(s.get(k) is not None for k in keys) and s["step_s"] > 0:
            by_rank.setdefault(s["rank"], []).append(s)
    steps = {s["step"] for rows in by_rank.values() for s in rows}
    if len(steps) < MIN_STEPS:
        return None
    per = [x for x in (_rank_shares(rows) for rows in by_rank.values()) if x is not None]
    if not per:
        return None
    med = {k: statistics.median(p[k] for p in per) for k in per[0]}
    return Shares(**{k: round(v, 6) for k, v in med.items()}, steps=len(steps), ranks=len(per),
                  from_step=min(steps), to_step=max(steps))


def classify(s: Shares, previous: str | None) -> str:
    """compute, communication or input, with hysteresis: a bound class is kept while its share
    stays at or above its LEAVE threshold, unless the other bound class enters with a larger
    share; from compute-bound a class needs its ENTER threshold."""
    share = {COMM: s.communication, INPUT: s.input}
    if previous in share and share[previous] >= LEAVE[previous]:
        other = INPUT if previous == COMM else COMM
        return other if share[other] >= ENTER[other] and share[other] > share[previous] else previous
    entered = [c for c in (COMM, INPUT) if share[c] >= ENTER[c]]
    return max(entered, key=lambda c: share[c]) if entered else COMPUTE


# ---------------------------------------------------------------- byte ratios of the model

def _matrices(model: Mapping) -> tuple[list[tuple[int, int]], int]:
    """The gradient matrices (rows, cols) of the built-in model (trainyard.mesh.param_count's
    layout) and the number of elements in its 1-D tensors."""
    h, v, n, s = int(model["hidden"]), int(model["vocab"]), int(model["layers"]), int(model["seq_len"])
    if model.get("kind") == "mlp":
        return [(v, h)] + [(h, h)] * n + [(v, h)], n * h + 2 * h
    block = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]
    vectors = n * (2 * h + 3 * h + h + 2 * h + 4 * h + h) + 2 * h
    return [(v, h), (s, h)] + block * n + [(v, h)], vectors


def powersgd_byte_ratio(model: Mapping, rank: int) -> float:
    """Bytes PowerSGD hands to its all-reduces / dense gradient bytes (torch compresses a matrix
    when rows x cols > 2 x rank x (rows + cols))."""
    mats, vectors = _matrices(model)
    dense = sum(m * n for m, n in mats) + vectors
    sent = sum(rank * (m + n) if m * n > 2 * rank * (m + n) else m * n for m, n in mats) + vectors
    return sent / dense


def compression_byte_ratio(comm: Mapping, model: Mapping) -> float:
    kind = comm.get("compression", "none")
    if kind in ("fp16", "bf16"):
        return 0.5
    if kind == "powersgd":
        if model.get("kind") == "user":  # run.prepare's description: priced as a transformer of its shape
            model = {**model, "kind": "gpt", "vocab": model.get("vocab") or model["hidden"],
                     "seq_len": model.get("seq_len") or 1}
        return powersgd_byte_ratio(model, int(comm.get("rank", 2)))
    if kind == "topk" and comm.get("ratio") != "auto":
        return min(1.0, 2 * float(comm["ratio"]))
    return 1.0


# ---------------------------------------------------------------- recommendations

def _with_change(spec: dict, change: Mapping[str, object]) -> dict:
    """A deep copy of `spec` with dotted paths set ("comm.compression": "powersgd")."""
    import copy

    out = copy.deepcopy(spec)
    for path, value in change.items():
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


def _get(spec: Mapping, path: str):
    node = spec
    for p in path.split("."):
        node = node[p]
    return node


def spec_with_change(spec: dict, change: Mapping[str, object]) -> JobSpec:
    """A new JobSpec: the stored spec with `change` applied, validated like a submit (SpecError if
    invalid); no data-root check (the data does not change)."""
    if not change:
        raise SpecError({"recommendation": ["there is no spec change to apply"]})
    return parse_job_spec(_with_change(spec, change))


def _valid(spec: dict, change: Mapping[str, object]) -> bool:
    try:
        spec_with_change(spec, change)
    except (SpecError, KeyError, TypeError):
        return False
    return True


def _gain(step_s: float, new_step_s: float) -> tuple[float, float]:
    new_step_s = max(new_step_s, 1e-9)
    return round(new_step_s, 6), round(step_s / new_step_s - 1, 4)


def _after_compression(s: Shares, ratio: float, now: str, new: str) -> float:
    """Predicted step_s when the bytes scale by `ratio` and the hook changes from `now` to `new`:
    comm_s = bytes time + COMPRESSION_COST[now] x optim_s, before and after."""
    hidden = max(0.0, s.comm_s - s.exposed_comm_s)  # the overlap window measured now
    wire = max(0.0, s.comm_s - COMPRESSION_COST[now] * s.optim_s)
    comm = wire * ratio + COMPRESSION_COST[new] * s.optim_s
    return s.step_s - s.exposed_comm_s + max(0.0, comm - hidden)


def _comm_candidates(spec: dict, s: Shares, model: Mapping) -> list[tuple[dict, float, str]]:
    """(change, predicted step_s, why) for the communication-bound job's possible changes."""
    comm = spec["comm"]
    out = []
    if comm["sync"] == "allreduce":
        now = compression_byte_ratio(comm, model)
        for kind, extra in (("powersgd", {"comm.rank": int(comm.get("rank", 2))}), ("bf16", {})):
            ratio = compression_byte_ratio({**comm, "compression": kind}, model) / now
            if ratio < 1:
                out.append(({"comm.compression": kind, **extra},
                            _after_compression(s, ratio, comm["compression"], kind),
                            f"{kind} sends {ratio:.3f} x the bytes {comm['compression']} sends now, "
                            f"its arithmetic counted"))
        if comm["compression"] == "topk" and comm["ratio"] != "auto" and float(comm["ratio"]) > 0.001:
            new = max(0.001, float(comm["ratio"]) / 4)
            out.append(({"comm.ratio": new}, _after_compression(s, new / float(comm["ratio"]), "topk", "topk"),
                        f"top-k ratio {new:g} sends a quarter of the bytes of {comm['ratio']:g}"))
        # local SGD averages the dense model (the gradients' bytes) every 4 steps, in the optimizer
        # step (nothing hidden), with no hook arithmetic
        dense = max(0.0, s.comm_s - COMPRESSION_COST[comm["compression"]] * s.optim_s) / now
        change = {"comm.sync": "local_sgd", "comm.period": 4}
        out.append(({**change, "comm.compression": "none"} if comm["compression"] != "none" else change,
                    s.step_s - s.exposed_comm_s + dense / 4,
                    "local SGD averages the model every 4 steps instead of the gradients every step"))
    elif comm["sync"] == "local_sgd" and int(comm["period"]) < 64:
        p = int(comm["period"])
        out.append(({"comm.period": 2 * p}, s.step_s - s.exposed_comm_s / 2,
                    f"averaging every {2 * p} steps instead of every {p} halves the averaging"))
    return [c for c in out if c[1] < s.step_s / (1 + MIN_GAIN)]


def _comm_recommendation(spec: dict, s: Shares, model: Mapping | None = None) -> dict:
    model = model or spec.get("model")
    valid = [c for c in _comm_candidates(spec, s, model) if _valid(spec, c[0])] if model else []
    if not valid:
        why = ("your script's own communication: train through run.prepare (the JobSpec's comm.compression "
               "and comm.sync then apply) or register a DDP comm hook yourself" if spec.get("entrypoint") else
               "no compression or averaging change is valid for this plan (they need plain data "
               "parallelism, tp 1, pp 1, fsdp false): another plan with fewer data-parallel ranks "
               "across nodes would cut the traffic")
        return _advice("another_plan", f"communication takes {s.communication:.0%} of the step; {why}",
                       s, s.step_s - s.exposed_comm_s / 2, None)
    change, new_step, why = min(valid, key=lambda c: c[1])
    change = {k: v for k, v in change.items() if _get(spec, k) != v}  # local SGD's period may be 4 already
    kind = "local_sgd" if change.get("comm.sync") == "local_sgd" or "comm.period" in change else "compression"
    text = (f"communication takes {s.communication:.0%} of the step ({s.exposed_comm_s * 1000:.1f} ms exposed of "
            f"{s.comm_s * 1000:.1f} ms): set " + ", ".join(f"{k} {v}" for k, v in change.items()) + f" ({why})")
    return _advice(kind, text, s, new_step, change, spec)


def _gemm_dim(tokens: int, hidden: int) -> float:
    return (tokens * hidden * hidden) ** (1 / 3)


def matmul_eff(device: str, n: float) -> float:
    """Efficiency at geometric-mean dimension n: log-linear between MATMUL_EFF's points, clamped."""
    pts = MATMUL_EFF.get(device, MATMUL_EFF["cuda"])
    if n <= pts[0][0]:
        return pts[0][1]
    for (n0, e0), (n1, e1) in zip(pts, pts[1:]):
        if n <= n1:
            return e0 + (e1 - e0) * (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
    return pts[-1][1]


def _compute_recommendation(spec: dict, s: Shares) -> dict:
    model, train = spec.get("model"), spec["train"]
    par = spec["parallel"] if isinstance(spec["parallel"], dict) else {"pp": 1, "tp": 1, "dp": None}
    ga = int(train["grad_accum"])
    if model and int(par.get("pp", 1)) == 1 and ga > 1:
        world = int(spec["resources"]["nodes"]) * int(spec["resources"]["procs_per_node"])
        dp = int(par.get("dp") or world // int(par.get("tp", 1)))
        new_ga = ga // 2 if ga % 2 == 0 else 1
        rows = train["global_batch"] // (dp * ga) * (model["seq_len"] if model["kind"] == "gpt" else 1)
        device = spec["resources"]["device"]
        now = matmul_eff(device, _gemm_dim(rows, int(model["hidden"])))
        new = matmul_eff(device, _gemm_dim(rows * ga // new_ga, int(model["hidden"])))
        new_step = s.step_s - s.compute_s * (1 - now / new)
        change = {"train.grad_accum": new_ga}
        if new_step < s.step_s / (1 + MIN_GAIN) and _valid(spec, change):
            text = (f"compute is under-used: micro-batches of {rows} rows run at about {now:.0%} of the device's "
                    f"best matrix throughput; set train.grad_accum {new_ga} (micro-batch x{ga // new_ga}, same "
                    f"global batch; activations grow as much)")
            return _advice("larger_micro_batch", text, s, new_step, change, spec)
    return _advice("none", f"compute-bound: compute and the optimizer take {s.compute:.0%} of the step; "
                   "no spec change is predicted to help (a faster step needs another plan or more devices)",
                   s, s.step_s, None)


def _input_recommendation(spec: dict, s: Shares) -> dict:
    where = ("your script's data loader: more DataLoader workers (num_workers) or a deeper prefetch_factor"
             if spec.get("entrypoint") else
             "the loader (one prefetch thread, two batches ahead) cannot keep up: put data.path on local "
             "storage or in the page cache; the JobSpec has no loader-worker setting to change")
    return _advice("loader", f"input-bound: waiting for data takes {s.input:.0%} of the step; {where}",
                   s, s.step_s - s.data_s, None)


def _advice(kind: str, text: str, s: Shares, new_step_s: float, change: dict | None,
            spec: dict | None = None) -> dict:
    predicted, gain = _gain(s.step_s, new_step_s)
    return {"kind": kind, "text": text, "change": change,
            "before": {k: _get(spec, k) for k in change} if change and spec else None,
            "predicted_step_s": predicted, "predicted_gain": gain}


def achieved_tflops(spec: Mapping, s: Shares) -> float | None:
    """Per rank: forward+backward FLOPs of its share of the step (6 x parameters x tokens,
    trainyard.mesh) over its compute_s; None for user code (the model is the script's) or tp/pp
    (a rank holds part of the model)."""
    model, par = spec.get("model"), spec.get("parallel")
    if not model or s.compute_s <= 0 or (isinstance(par, dict) and (par.get("tp", 1) > 1 or par.get("pp", 1) > 1)):
        return None
    world = int(spec["resources"]["nodes"]) * int(spec["resources"]["procs_per_node"])
    tokens = int(spec["train"]["global_batch"]) // world * (int(model["seq_len"]) if model["kind"] == "gpt" else 1)
    params = param_count(model["kind"], layers=int(model["layers"]), hidden=int(model["hidden"]),
                         seq_len=int(model["seq_len"]), vocab=int(model["vocab"]))
    return round(train_flops(params, tokens) / s.compute_s / 1e12, 6)


def _tried(change: Mapping, results: list[Mapping]) -> Mapping | None:
    """The measured result of an earlier application of `change` that did not pay, if any."""
    return next((r for r in results if all((r.get("after") or {}).get(k) == v for k, v in change.items())
                 and (r.get("measured_gain") or 0) < MIN_GAIN), None)


def _revert(spec: dict, s: Shares, results: list[Mapping]) -> dict | None:
    """Undo the last applied change when the job measured slower with it (still in the spec)."""
    last = results[-1] if results else None
    if (not last or (last.get("measured_gain") or 0) > -MIN_GAIN or not last.get("before")
            or last.get("recommendation") == "revert"):  # never undo an undo
        return None
    try:
        if any(_get(spec, k) != v for k, v in last["after"].items()) or not _valid(spec, last["before"]):
            return None
    except (KeyError, TypeError):
        return None
    undo = ", ".join(f"{k} {v}" for k, v in last["before"].items())
    text = (f"the last applied change made the step slower ({last['step_s_after'] * 1000:.1f} ms against "
            f"{last['step_s_before'] * 1000:.1f} ms before it): set {undo} again")
    return _advice("revert", text, s, last["step_s_before"], dict(last["before"]), spec)


def profile(samples: Iterable[Mapping], spec: dict, previous: Mapping | None = None, *,
            first_step: int = 0, results: Iterable[Mapping] = (), model: Mapping | None = None) -> dict:
    """The attempt's profile: class, shares, the window, and the recommendation. `previous` is
    the attempt's last profile (for hysteresis); `first_step` the attempt's first step - 1;
    `results` the measured outcomes of the job's applied recommendations, oldest first ({before,
    after, step_s_before, step_s_after, measured_gain}): measurements overrule the model, so a
    change that measured slower is reverted and one that did not pay is not offered again.
    `model`: a user-code job's model as run.prepare described it (its comm changes are then
    offered as for a built-in job: prepare applies them)."""
    s = shares(samples, first_step=first_step)
    if s is None:
        has = "entrypoint" in spec and spec.get("entrypoint")
        return {"class": UNKNOWN, "reason": "not enough telemetry: needs " + str(MIN_STEPS) + " steps with data, "
                "compute, comm and optimizer times after the warm-up" + (" (a script reports them with run.phase)"
                                                                          if has else ""),
                "shares": None, "recommendation": None}
    results = list(results)
    cls = classify(s, (previous or {}).get("class"))
    rec = _revert(spec, s, results) or (_comm_recommendation(spec, s, model) if cls == COMM else
                                        {INPUT: _input_recommendation}.get(cls, _compute_recommendation)(spec, s))
    tried = rec["change"] and rec["kind"] != "revert" and _tried(rec["change"], results)
    if tried:
        rec = _advice("none", f"{rec['text']}; but this change was applied before and measured "
                      f"{tried['measured_gain']:+.0%} speed against {rec['predicted_gain']:+.0%} predicted: "
                      "not offered again", s, s.step_s, None)
    return {"class": cls, "reason": "", "shares": {k: getattr(s, k) for k in (COMPUTE, COMM, INPUT)},
            "window": {k: v for k, v in asdict(s).items() if k not in (COMPUTE, COMM, INPUT)},
            "achieved_tflops": achieved_tflops(spec, s),
            "thresholds": {"enter": ENTER, "leave": LEAVE}, "recommendation": rec}
