"""Fit the cost model's constants (constants.DeviceConstants) to a node's calibration
measurements (trainyard/calibration.py, written by `python -m workers.calibrate`), and evaluate
constants against measured runs. Pure: stdlib only, no Django, no torch.

The fit, in order (each step uses the previous ones):
1. matmul_eff: every GEMM of the sweep gives (n = geometric mean of m, k, n; TFLOP/s / peak);
   points of one n (rounded) take their median. `peak` is what the requests of this device will
   say (`peak_tflops`); by default the best TFLOP/s the sweep measured (factor 1.0: on a CPU
   there is no datasheet peak for one thread, and the best measured GEMM is the ceiling the
   runs can reach), so efficiencies are <= 1.
2. links: per link (intra, inter), a least-squares line seconds = alpha + bus_bytes / bandwidth
   over every collective, where bus_bytes is what one rank moves (nccl-tests' bus bandwidth
   factors: all_reduce 2(g-1)/g, all_gather and reduce_scatter (g-1)/g, send_recv 1). alpha is
   the latency of one call. `intra_gbs` is send_recv's bandwidth alone (the raw link) and
   `comm_eff` the collectives' bandwidth over it, capped at 1.
3. activation_factor: least squares of the relative error of one micro-batch's saved activation
   bytes (the harness's measure) against Korthikanti's bytes x factor plus the loss's saved
   log-probabilities (4 x b x s x vocab / t on the last stage).
4. step time: step_overhead_s, layer_overhead_s, 1 / optimizer_gbs, the collectives' latency
   and bandwidth inside a training step (the sweep's alpha and comm_eff are the floor and the
   ceiling: a DTensor or FSDP collective in a step costs more than a bare one) and the non-GEMM
   bytes per layer (elementwise_bytes at elementwise_gbs 1) enter the predicted step time
   (piecewise) linearly, overlap does not: for each overlap on a grid, a non-negative least
   squares of the relative step-time error over the runs (Gauss-Newton rounds); the overlap
   with the smallest error wins.

`evaluate` compares predictions with measured runs: Spearman rank correlation, median and max
relative step-time error, and memory errors (parameters + gradients + optimizer state, and
activations), on the given runs (held-out indices).
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
from collections.abc import Sequence

from trainyard.calibration import Measurements, parse_measurements

from .constants import DeviceConstants
from .cost import Candidate, Ctx, context, layer_activation_bytes, memory_ctx, step_time_ctx
from .inputs import parse_plan_request
from .job import KIND_DEFAULTS

BUS_FACTOR = {"all_reduce": lambda g: 2 * (g - 1) / g, "all_gather": lambda g: (g - 1) / g,
              "reduce_scatter": lambda g: (g - 1) / g, "send_recv": lambda g: 1.0}
OVERLAP_GRID = tuple(i / 10 for i in range(11))
MEMORY_GB = 1_000.0  # the runs fit: the request's memory is not what is evaluated


def peak_of(m: Measurements) -> float:
    """The default peak TFLOP/s of the device: the best GEMM the sweep measured."""
    return max(p.tflops for p in m.matmul)


def fit_matmul(m: Measurements, peak: float) -> tuple[tuple[float, float], ...]:
    by_n: dict[float, list[float]] = {}
    for p in m.matmul:
        n = float(f"{(p.m * p.k * p.n) ** (1 / 3):.3g}")
        by_n.setdefault(n, []).append(p.tflops / peak)
    return tuple((n, statistics.median(v)) for n, v in sorted(by_n.items()))


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; intercept >= 0, slope > 0."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    if intercept < 0:  # a line through the origin instead
        intercept = 0.0
        slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    if slope <= 0:  # latency only: no bandwidth visible; the largest message's rate
        i = max(range(n), key=lambda j: xs[j])
        slope = ys[i] / xs[i]
    return intercept, slope


def fit_links(m: Measurements) -> dict:
    """The link fields of DeviceConstants measured here (links without points are not set)."""
    out: dict = {}
    for link in ("intra", "inter"):
        pts = [c for c in m.collectives if c.link == link]
        coll = [c for c in pts if c.op != "send_recv"]
        p2p = [c for c in pts if c.op == "send_recv"]
        if not coll and not p2p:
            continue
        alpha, slope = _line([c.bytes * BUS_FACTOR[c.op](c.group) for c in coll or p2p],
                             [c.seconds for c in coll or p2p])
        coll_gbs = 1 / slope / 1e9
        link_gbs = 1 / _line([c.bytes for c in p2p], [c.seconds for c in p2p])[1] / 1e9 if p2p else coll_gbs
        out[f"{link}_alpha_s"] = alpha
        out[f"{link}_gbs"] = link_gbs
        if link == "intra":
            out["comm_eff"] = min(1.0, coll_gbs / link_gbs)
    return out


# ---- the runs as planner requests -------------------------------------------------------------

def run_request(m: Measurements, run, peak: float):
    """The planner request of one measured run, as job.job_request builds it for a job on this
    device kind (its link bandwidths; calibrated constants override them), except the peak
    and the precision (the runtime trains in fp32)."""
    gbs = KIND_DEFAULTS[m.device.kind]["intra_node_gbs"]
    data = {"model": run.model.model_dump(),
            "cluster": {"nodes": 1, "devices_per_node": run.procs,
                        "device": {"name": m.device.name, "memory_gb": MEMORY_GB, "peak_tflops": peak},
                        "intra_node_gbs": gbs, "inter_node_gbs": gbs},
            "global_batch": run.global_batch, "precision": "fp32"}
    return parse_plan_request(data)


def candidate(run) -> Candidate:
    return Candidate(**run.plan.model_dump())


class _Case:
    """One run with what every prediction of it needs, computed once."""

    def __init__(self, m: Measurements, run, peak: float, k: DeviceConstants):
        self.run, self.cand = run, candidate(run)
        self.req = run_request(m, run, peak)
        self.x: Ctx = context(self.req, k)

    def step(self, k: DeviceConstants, bw_scale: float = 1.0) -> float:
        """Predicted step time; `bw_scale` divides the link bandwidths (the fit's comm_eff column)."""
        x = self.x if bw_scale == 1.0 else dataclasses.replace(
            self.x, intra_bps=self.x.intra_bps / bw_scale, inter_bps=self.x.inter_bps / bw_scale)
        return step_time_ctx(x, self.cand, k).total_s

    def states(self, k: DeviceConstants) -> float:
        mem = memory_ctx(self.x, self.cand, k)
        return mem.params + mem.grads + mem.optimizer

    def activation_parts(self, k: DeviceConstants) -> tuple[float, float]:
        """(Korthikanti bytes at factor 1, loss bytes) of one micro-batch on the rank holding
        the most: the harness's activation measure."""
        x, c = self.x, self.cand
        one = layer_activation_bytes(x, c, dataclasses.replace(k, activation_factor=1.0))
        if c.recompute == "full":  # what the checkpointed blocks keep, plus one block's working set
            one = 2 * x.seq * c.micro_batch * x.hidden * 2.0
        base, extra = divmod(x.layers, c.pp)
        first_layers = base + (1 if extra else 0)
        last_layers = base
        loss = 4.0 * c.micro_batch * x.seq * x.vocab / c.tp
        if c.pp == 1:
            return first_layers * one, loss
        return max((first_layers * one, 0.0), (last_layers * one, loss), key=lambda p: p[0] * k.activation_factor + p[1])

    def activations(self, k: DeviceConstants) -> float:
        kb, loss = self.activation_parts(k)
        return kb * k.activation_factor + loss


def _cases(m: Measurements, k: DeviceConstants, peak: float, runs=None) -> list[_Case]:
    return [_Case(m, r, peak, k) for r in (m.runs if runs is None else runs)]


# ---- the fit ----------------------------------------------------------------------------------

def fit_activation_factor(cases: list[_Case], k: DeviceConstants) -> float:
    num = den = 0.0
    for c in cases:
        kb, loss = c.activation_parts(k)
        y = c.run.memory.activation_bytes
        if y <= 0 or kb <= 0:
            continue
        num += kb * (y - loss) / y ** 2
        den += kb * kb / y ** 2
    return num / den if den > 0 and num > 0 else k.activation_factor


def _nnls(rows: list[list[float]], rhs: list[float]) -> list[float]:
    """Non-negative least squares for a handful of columns: every subset of free columns, the
    best feasible one (6 columns here: 63 subsets)."""
    ncol = len(rows[0])
    best, best_sse = [0.0] * ncol, sum(r * r for r in rhs)
    for mask in range(1, 1 << ncol):
        cols = [j for j in range(ncol) if mask >> j & 1]
        sol = _lstsq([[row[j] for j in cols] for row in rows], rhs)
        if sol is None or min(sol) < 0:
            continue
        full = [0.0] * ncol
        for j, v in zip(cols, sol):
            full[j] = v
        sse = sum((sum(a * b for a, b in zip(row, full)) - y) ** 2 for row, y in zip(rows, rhs))
        if sse < best_sse:
            best, best_sse = full, sse
    return best


def _lstsq(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Normal equations solved by Gaussian elimination; None when singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, rhs))]
         for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [vi - f * vc for vi, vc in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


# The step-time parameters the runs fit, each >= 0: step_overhead_s, layer_overhead_s,
# 1 / optimizer_gbs, the collectives' extra per-call latency inside a step (over the sweep's
# intra-node alpha: the runs are on one node), non-GEMM bytes per layer per token per hidden unit
# at 1 GB/s, the extra slowdown of the links inside a step (comm_eff / (1 + it)), and the per-layer
# cost of tensor-parallel and FSDP modules beyond their bytes (DTensor dispatch, gather
# bookkeeping: on gloo it dominates a small model's tp step); with the finite-difference step of each.
THETA_STEPS = (1e-3, 1e-4, 0.1, 1e-4, 1.0, 0.1, 1e-4, 1e-4)
GAUSS_NEWTON_ROUNDS = 6


def _with_theta(k: DeviceConstants, theta: Sequence[float]) -> tuple[DeviceConstants, float]:
    """(the constants at `theta`, the bandwidth divisor) from the sweep's constants `k`."""
    a, b, inv, alpha, elem, slower, tp_layer, fsdp_layer = theta
    return dataclasses.replace(
        k, step_overhead_s=a, layer_overhead_s=b, optimizer_gbs=1 / inv if inv > 0 else 1e30,
        tp_layer_overhead_s=tp_layer, fsdp_layer_overhead_s=fsdp_layer,
        intra_alpha_s=k.intra_alpha_s + alpha,  # the runs are on one node: intra only
        elementwise_gbs=1.0 if elem > 0 else 0.0, elementwise_bytes=elem), 1 + slower


def _predict(c: _Case, k: DeviceConstants, theta: Sequence[float]) -> float:
    kk, scale = _with_theta(k, theta)
    return c.step(kk, scale)


def _fit_theta(cases: list[_Case], k: DeviceConstants) -> tuple[float, list[float]]:
    """(sum of squared log errors, theta) for `k`'s overlap: non-negative least squares of
    log(predicted / measured) step time (symmetric: over- and under-prediction by the same
    factor weigh the same), linearized around the current theta (Gauss-Newton rounds)."""
    theta = [0.0] * len(THETA_STEPS)
    for _ in range(GAUSS_NEWTON_ROUNDS):
        rows, rhs = [], []
        for c in cases:
            y, base = c.run.step_time_s, _predict(c, k, theta)
            jac = []
            for j, h in enumerate(THETA_STEPS):
                moved = list(theta)
                moved[j] += h
                jac.append((_predict(c, k, moved) - base) / h)
            rows.append([d / base for d in jac])
            rhs.append(math.log(y / base) + sum(d * t for d, t in zip(jac, theta)) / base)
        theta = _nnls(rows, rhs)
    sse = sum(math.log(_predict(c, k, theta) / c.run.step_time_s) ** 2 for c in cases)
    return sse, theta


def fit_overheads(cases: list[_Case], k: DeviceConstants) -> DeviceConstants:
    """overlap (the best of OVERLAP_GRID) and the step-time parameters (THETA_STEPS) that
    minimize the relative step-time error over `cases` (module docstring, step 4)."""
    if not cases:
        return k
    best = None
    for overlap in OVERLAP_GRID:
        ko = dataclasses.replace(k, overlap=overlap)
        sse, theta = _fit_theta(cases, ko)
        if best is None or sse < best[0]:
            best = (sse, ko, theta)
    _, ko, theta = best
    fitted, scale = _with_theta(ko, theta)
    return dataclasses.replace(fitted, comm_eff=ko.comm_eff / scale)


def fit(measurements: dict, base: DeviceConstants, *, peak_tflops: float | None = None,
        runs: Sequence[int] | None = None, now: datetime.datetime | None = None) -> DeviceConstants:
    """Constants for the measured device, starting from `base` (module docstring). `runs`: the
    indices of the runs to fit on (default all); `peak_tflops`: the peak the requests will state
    (default: the best measured GEMM)."""
    m = parse_measurements(measurements)
    peak = peak_tflops or peak_of(m)
    k = dataclasses.replace(base, name=m.device.name, matmul_eff=fit_matmul(m, peak), **fit_links(m))
    chosen = m.runs if runs is None else [m.runs[i] for i in runs]
    cases = _cases(m, k, peak, chosen)
    k = dataclasses.replace(k, activation_factor=fit_activation_factor(cases, k))
    k = fit_overheads(cases, k)
    when = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    return dataclasses.replace(k, source=f"calibrated {when} on {m.device.host} ({len(chosen)} runs)")


# ---- evaluation -------------------------------------------------------------------------------

def _ranks(v: Sequence[float]) -> list[float]:
    order = sorted(range(len(v)), key=lambda i: v[i])
    ranks = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman rank correlation (average ranks for ties); None under 3 points or no spread."""
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    sa = math.sqrt(sum((x - ma) ** 2 for x in ra))
    sb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (sa * sb) if sa > 0 and sb > 0 else None


def _rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas > 0 else 0.0


def evaluate(measurements: dict, constants: DeviceConstants, held_out: Sequence[int] | None = None,
             *, peak_tflops: float | None = None) -> dict:
    """Predicted vs measured on the runs `held_out` (indices; default all): step time (Spearman,
    median and max relative error) and memory (relative errors of parameters + gradients +
    optimizer state, and of activations: median and max), plus each run's figures."""
    m = parse_measurements(measurements)
    peak = peak_tflops or peak_of(m)
    idx = list(range(len(m.runs))) if held_out is None else list(held_out)
    cases = _cases(m, constants, peak, [m.runs[i] for i in idx])
    rows = []
    for i, c in zip(idx, cases):
        mem = c.run.memory
        states = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes
        rows.append({"run": i, "plan": c.run.plan.model_dump(), "model": c.run.model.model_dump(),
                     "step_time_s": c.run.step_time_s, "predicted_step_time_s": c.step(constants),
                     "states_bytes": states, "predicted_states_bytes": c.states(constants),
                     "activation_bytes": mem.activation_bytes,
                     "predicted_activation_bytes": c.activations(constants)})
    for r in rows:
        r["step_error"] = _rel(r["predicted_step_time_s"], r["step_time_s"])
        r["states_error"] = _rel(r["predicted_states_bytes"], r["states_bytes"])
        r["activation_error"] = _rel(r["predicted_activation_bytes"], r["activation_bytes"])

    def stat(key: str, fn) -> float | None:
        return fn([r[key] for r in rows]) if rows else None
    return {"constants": constants.source, "peak_tflops": peak, "runs": len(rows),
            "spearman": spearman([r["predicted_step_time_s"] for r in rows], [r["step_time_s"] for r in rows]),
            "step_error_median": stat("step_error", statistics.median),
            "step_error_max": stat("step_error", max),
            "states_error_median": stat("states_error", statistics.median),
            "states_error_max": stat("states_error", max),
            "activation_error_median": stat("activation_error", statistics.median),
            "activation_error_max": stat("activation_error", max),
            "per_run": rows}


def held_out_split(n: int, every: int = 3) -> tuple[list[int], list[int]]:
    """(fit indices, held-out indices): every `every`-th run (1, 4, 7, ...) is held out."""
    held = [i for i in range(n) if i % every == 1]
    return [i for i in range(n) if i % every != 1], held
