"""The cost model: memory per device and step time of one candidate plan (issue 13, section 1).

Memory (bytes, the most loaded device): parameters, gradients and optimizer state (bytes per
parameter per precision; FSDP shards all three over dp, ZeRO-1 the optimizer state), activations
(Korthikanti et al. 2022: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes per layer per micro-batch in
16-bit, which is s*b*h*(34 + 5*a*s/h) at t = 1; full recompute keeps 2*s*b*h per layer plus one
layer's working set) times the micro-batches in flight on the first stage (1F1B: min(p, m);
GPipe: m), and the last stage's logits (fp32, with their gradient).

Step time: (m + p - 1) x (compute + tp + p2p of one micro-batch on the slowest stage), plus the
data-parallel reduction not hidden under backward, the optimizer step and a fixed overhead.
Compute = FLOPs / (peak x efficiency(per-device GEMM size)); tp moves 8*b*s*h*(t-1)/t elements
per layer per micro-batch (12 with full recompute) over the intra-node link; the pipeline sends
b*s*h per boundary per micro-batch each way
(split over the boundary's tp ranks, each sending its 1/t slice); dp reduces 2*(d-1)/d x gradient bytes over the
slowest link its group crosses (FSDP: gathers twice per micro-batch, reduce-scatters once).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .constants import DeviceConstants
from .inputs import PlanRequest

# bytes per parameter: (weights, gradients, optimizer state). bf16 mixed precision keeps bf16
# weights, fp32 gradients and fp32 master weights + Adam m and v; fp32 keeps fp32 weights + m, v.
STATE_BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}
ACT_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int
    pp: int
    micro_batch: int
    fsdp: bool = False
    shard_optimizer: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"


@dataclass(frozen=True)
class MemoryBreakdown:
    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    total: float
    gathered: float = 0.0
    """FSDP: the unsharded parameters of the layers computing now (transient; in `total`, not in
    `params`, which is what a rank keeps between steps)"""


@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float
    tp_s: float
    pp_s: float
    dp_exposed_s: float
    optimizer_s: float
    overhead_s: float
    bubble_fraction: float
    total_s: float
    flops_per_step: float = 0.0
    """hardware FLOPs of one step over all devices (recomputation included)"""
    comm_bytes: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """bytes one device sends per step for tp, pp and dp"""


@dataclass(frozen=True)
class Ctx:
    """What a request fixes, computed once for the whole search."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    params: float
    layer_params: float
    sized_only: bool
    batch: int
    devices: int
    per_node: int
    memory: float
    peak: float
    intra_bps: float
    inter_bps: float
    dtype: str
    scores: bool = False
    """the attention score matrices are kept for backward (materialized attention)"""


def context(req: PlanRequest, k: DeviceConstants) -> Ctx:
    m, c = req.model, req.cluster
    if m.sized_only:
        h = max(1, round((m.params * 128 / 12) ** (1 / 3)))
        layers, heads, layer_params, params = 1, 1, float(m.params), float(m.params)
    else:
        h, layers, heads = m.hidden, m.layers, m.heads
        layer_params = 12.0 * h * h + 13.0 * h
        params = layers * layer_params + 2.0 * m.vocab * h + m.seq_len * h + 2.0 * h  # + the final LayerNorm
    intra = (k.intra_gbs or c.intra_node_gbs) * 1e9 * k.comm_eff
    inter = (k.inter_gbs or c.inter_node_gbs) * 1e9 * k.comm_eff
    return Ctx(layers=layers, hidden=h, heads=heads, seq=m.seq_len, vocab=m.vocab, params=params,
               layer_params=layer_params, sized_only=m.sized_only, batch=req.global_batch,
               devices=c.devices, per_node=c.devices_per_node, memory=c.device.memory_gb * 1e9,
               peak=c.device.peak_tflops * 1e12, intra_bps=intra, inter_bps=inter, dtype=req.dtype,
               scores=m.attention == "materialized")


def stage_layers(x: Ctx, c: Candidate) -> int:
    """Layers on the most loaded stage (uneven splits give the earlier stages one more)."""
    return -(-x.layers // c.pp)


def stage_params(x: Ctx, c: Candidate) -> float:
    """Parameters on the most loaded device: its stage's layers (split over tp) and the
    embedding or LM head a first or last stage holds."""
    if x.sized_only:
        return x.params
    t, h = c.tp, x.hidden
    # Under tp a block's two LayerNorms (4h) and its row-parallel Linears' biases (2h) stay whole
    # on every rank; the token embedding and LM head split by vocab only when it divides evenly,
    # and the position embedding is never split (workers/runtime/sharded.py tp_plan).
    whole = 6.0 * h if t > 1 else 0.0
    per_layer = (x.layer_params - whole) / t + whole
    vocab_split = t if x.vocab % t == 0 else 1
    ends = x.vocab * h / vocab_split + x.seq * h
    if c.pp == 1:
        ends += x.vocab * h / vocab_split + 2.0 * h  # the LM head and the final LayerNorm
    return stage_layers(x, c) * per_layer + ends


def embedding_grad_extra(x: Ctx, c: Candidate) -> float:
    """Elements of gradient beyond the parameters a rank holds: under tp the vocab-split token
    embedding's gradient is materialized whole (its input is replicated, so the backward of the
    row-wise lookup produces every row), measured by the calibration harness."""
    if x.sized_only or c.tp == 1 or x.vocab % c.tp:
        return 0.0
    return x.vocab * x.hidden * (1.0 - 1.0 / c.tp)


def layer_activation_bytes(x: Ctx, c: Candidate, k: DeviceConstants) -> float:
    """Korthikanti's bytes per layer per micro-batch, scaled to the precision and calibrated;
    fused attention keeps no a*s*s score matrices (the 5*a*s/(h*t) term)."""
    s, b, h, t = x.seq, c.micro_batch, x.hidden, c.tp
    per = s * b * h * (10 + 24 / t + (5 * x.heads * s / (h * t) if x.scores else 0.0))
    return per * (ACT_BYTES[x.dtype] / 2) * k.activation_factor


def _activations(x: Ctx, c: Candidate, k: DeviceConstants) -> tuple[float, float]:
    """(first stage, last stage) activation bytes."""
    if x.sized_only:
        return 0.0, 0.0
    m = x.batch // c.dp // c.micro_batch
    in_flight = m if c.schedule == "gpipe" and c.pp > 1 else min(c.pp, m)
    last_in_flight = m if c.schedule == "gpipe" and c.pp > 1 else 1
    one = layer_activation_bytes(x, c, k)
    n = stage_layers(x, c)
    if c.recompute == "full":
        kept = 2 * x.seq * c.micro_batch * x.hidden * (ACT_BYTES[x.dtype] / 2) * k.activation_factor
        return n * kept * in_flight + one, n * kept * last_in_flight + one
    return n * one * in_flight, n * one * last_in_flight


def memory_ctx(x: Ctx, c: Candidate, k: DeviceConstants) -> MemoryBreakdown:
    wb, gb, ob = STATE_BYTES[x.dtype]
    p = stage_params(x, c)
    params, grads, opt = p * wb, (p + embedding_grad_extra(x, c)) * gb, p * ob
    gathered = 0.0
    if c.fsdp:
        # two layers' parameters unsharded at a time (the one computing, the next prefetched):
        # transient, beside the shards every rank keeps between steps
        gathered = 2 * x.layer_params / c.tp * ACT_BYTES[x.dtype] if not x.sized_only else 0.0
        params, grads, opt = params / c.dp, grads / c.dp, opt / c.dp
    elif c.shard_optimizer:
        opt = opt / c.dp
    first, last = _activations(x, c, k)
    logits = 0.0 if x.sized_only else 8.0 * c.micro_batch * x.seq * x.vocab / c.tp
    states = params + grads + opt + gathered
    activations = first if c.pp == 1 or first >= last + logits else last
    total = max(states + first + (logits if c.pp == 1 else 0.0), states + last + logits)
    return MemoryBreakdown(params=params, grads=grads, optimizer=opt, activations=activations,
                           logits=logits, total=total, gathered=gathered)


def memory(req: PlanRequest, cand: Candidate, constants: DeviceConstants) -> MemoryBreakdown:
    return memory_ctx(context(req, constants), cand, constants)


def _link(x: Ctx, span: int) -> tuple[float, bool]:
    """(bytes/s per device, crosses nodes) for a group whose ranks span `span` consecutive ranks:
    inside a node the intra link; across nodes the node's network shared by its devices."""
    if span <= x.per_node:
        return x.intra_bps, False
    return x.inter_bps / x.per_node, True


def microbatch_compute(x: Ctx, c: Candidate, k: DeviceConstants) -> tuple[float, float, float]:
    """(seconds of forward+backward compute of one micro-batch on the slowest stage,
    backward part of it, hardware FLOPs of one sequence) on one device."""
    b, s, h, t = c.micro_batch, x.seq, x.hidden, c.tp
    passes = 4.0 if c.recompute == "full" else 3.0
    if x.sized_only:
        f = 2.0 * x.params * b * s
        t_f = f / (x.peak * k.efficiency((b * s * h * h) ** (1 / 3)))
        return 3 * t_f, 2 * t_f, 3.0 * 2.0 * x.params * s
    f_layer = (24.0 * b * s * h * h + 4.0 * b * s * s * h) / t
    eff = k.efficiency((b * s * h * 4.0 * h / t) ** (1 / 3))
    t_layer = f_layer / (x.peak * eff)
    if k.elementwise_gbs > 0:
        moved = k.elementwise_bytes * b * s * h + (k.attention_bytes * x.heads * b * s * s if x.scores else 0.0)
        t_layer += moved / t / (k.elementwise_gbs * 1e9) / 3.0
    per_layer = passes * t_layer + k.layer_overhead_s * passes / 3.0
    logits = 3.0 * 2.0 * b * s * h * x.vocab / t / (x.peak * k.efficiency((b * s * h * x.vocab / t) ** (1 / 3)))
    stage = stage_layers(x, c) * per_layer + logits
    bwd = stage_layers(x, c) * (passes - 1) * t_layer + logits * 2 / 3
    seq_flops = passes * x.layers * (24.0 * s * h * h + 4.0 * s * s * h) + 6.0 * s * h * x.vocab
    return stage, bwd, seq_flops


def _dp_time(x: Ctx, c: Candidate, k: DeviceConstants, m: int, t_mb: float, t_bwd: float) -> tuple[float, float]:
    """(exposed seconds, bytes sent per device) of the data-parallel reduction of one step."""
    d = c.dp
    if d == 1:
        return 0.0, 0.0
    grad_bytes = stage_params(x, c) * ACT_BYTES[x.dtype]
    bw, crosses = _link(x, d * c.tp)
    alpha = k.inter_alpha_s if crosses else k.intra_alpha_s
    calls = 2 * math.ceil(math.log2(d)) * max(1, stage_layers(x, c))
    if c.fsdp:  # all-gather for forward and backward of every micro-batch, one reduce-scatter
        sent = (2 * m + 1) * (d - 1) / d * grad_bytes
        busy = sent / bw + (2 * m + 1) * calls * alpha / 2
        return busy - min(k.overlap * busy, m * t_mb), sent  # hidden under all the compute at most
    sent = 2 * (d - 1) / d * grad_bytes  # all-reduce (ZeRO-1: reduce-scatter + all-gather)
    busy = sent / bw + calls * alpha
    return busy - min(k.overlap * busy, t_bwd), sent  # hidden under the last micro-batch's backward at most


def step_time_ctx(x: Ctx, c: Candidate, k: DeviceConstants) -> TimeBreakdown:
    m = x.batch // c.dp // c.micro_batch
    t_mb, t_bwd, seq_flops = microbatch_compute(x, c, k)
    act = ACT_BYTES[x.dtype]
    tp_s = tp_bytes = 0.0
    if c.tp > 1 and not x.sized_only:
        bw, crosses = _link(x, c.tp)
        n, calls = (12.0, 6) if c.recompute == "full" else (8.0, 4)
        tp_bytes = n * c.micro_batch * x.seq * x.hidden * (c.tp - 1) / c.tp * act * (stage_layers(x, c))
        tp_s = tp_bytes / bw + calls * (stage_layers(x, c)) * (k.inter_alpha_s if crosses else k.intra_alpha_s)
        tp_s += stage_layers(x, c) * k.tp_layer_overhead_s * calls / 4.0
    if c.fsdp and not x.sized_only:
        t_mb += stage_layers(x, c) * k.fsdp_layer_overhead_s
    pp_s = pp_bytes = 0.0
    if c.pp > 1:
        bw, crosses = _link(x, c.dp * c.tp + 1)
        pp_bytes = 2.0 * c.micro_batch * x.seq * x.hidden * act / c.tp  # each tp rank sends its slice
        pp_s = pp_bytes / bw + 2 * (k.inter_alpha_s if crosses else k.intra_alpha_s)
    slots = m + c.pp - 1
    pipeline = slots * (t_mb + tp_s + pp_s)
    dp_s, dp_bytes = _dp_time(x, c, k, m, t_mb, t_bwd)
    wb, gb, ob = STATE_BYTES[x.dtype]
    owned = stage_params(x, c) / (c.dp if c.fsdp or c.shard_optimizer else 1)
    opt_s = owned * (wb + gb + ob) / (k.optimizer_gbs * 1e9)
    total = pipeline + dp_s + opt_s + k.step_overhead_s
    return TimeBreakdown(compute_s=slots * t_mb, tp_s=slots * tp_s, pp_s=slots * pp_s, dp_exposed_s=dp_s,
                         optimizer_s=opt_s, overhead_s=k.step_overhead_s,
                         bubble_fraction=(c.pp - 1) / slots, total_s=total,
                         flops_per_step=seq_flops * x.batch,
                         comm_bytes=(tp_bytes * m, pp_bytes * m, dp_bytes))


def step_time(req: PlanRequest, cand: Candidate, constants: DeviceConstants) -> TimeBreakdown:
    return step_time_ctx(context(req, constants), cand, constants)
