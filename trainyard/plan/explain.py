"""One human sentence per plan: the layout, the schedule, what fits, where the time goes, and for
a runner-up how much slower than the best it is and mostly why."""
from __future__ import annotations

from .cost import Candidate, Ctx, MemoryBreakdown, TimeBreakdown

PARTS = (("compute_s", "compute"), ("tp_s", "tensor-parallel communication"),
         ("pp_s", "pipeline transfers"), ("dp_exposed_s", "exposed data-parallel reduction"),
         ("optimizer_s", "the optimizer step"), ("overhead_s", "fixed overhead"))


def _layout(x: Ctx, c: Candidate) -> str:
    bits = []
    if c.tp > 1:
        bits.append(f"tp {c.tp} {'inside each node' if c.tp <= x.per_node else 'across nodes'}")
    if c.pp > 1:
        per = -(-x.layers // c.pp)
        bits.append(f"pp {c.pp} stages of {per if x.layers % c.pp == 0 else f'up to {per}'} layers")
    kind = "fsdp" if c.fsdp else "dp"
    bits.append(f"{kind} {c.dp}" + (" with ZeRO-1 optimizer sharding" if c.shard_optimizer else ""))
    return " x ".join(bits)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}" if n >= 1e9 else f"{n / 1e9:.2g}"


def explain(x: Ctx, c: Candidate, t: TimeBreakdown, m: MemoryBreakdown, best: TimeBreakdown | None) -> str:
    mbs = x.batch // c.dp // c.micro_batch
    sched = (f"{c.schedule.upper() if c.schedule == 'gpipe' else '1F1B'} over {mbs} micro-batches of "
             f"{c.micro_batch} (bubble {t.bubble_fraction:.0%})") if c.pp > 1 else (
        f"{mbs} micro-batch{'es' if mbs > 1 else ''} of {c.micro_batch}")
    shares = sorted(((getattr(t, k) / t.total_s, name) for k, name in PARTS), reverse=True)
    where = ", ".join(f"{name} {share:.0%}" for share, name in shares[:3] if share >= 0.01)
    text = (f"{_layout(x, c)}; {sched}; {'full recompute; ' if c.recompute == 'full' else ''}"
            f"{_gb(m.total)} of {x.memory / 1e9:g} GB per device"
            f"{' (activations not counted: the model is given only by its size)' if x.sized_only else ''}; "
            f"step {t.total_s:.3g} s ({where})")
    if best is not None and t.total_s > best.total_s * 1.0005:
        deltas = sorted(((getattr(t, k) - getattr(best, k), name) for k, name in PARTS), reverse=True)
        text += f"; {t.total_s / best.total_s - 1:.1%} slower than the best, mostly from {deltas[0][1]}"
    return text
