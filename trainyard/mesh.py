"""The arithmetic of a parallel plan, shared by the planner, the predictor and the runtime
(standard library only: the control plane imports it without torch).

Mesh layout: the world is a ("pp", "dp", "tp") grid in row-major order, tp innermost, so the
ranks of one tensor-parallel group are consecutive (on one node when procs_per_node >= tp, where
their per-layer collectives are cheapest) and a pipeline stage is a contiguous block of ranks.
`Mesh.coords(rank)` is pure arithmetic, so the planner can say what each rank will be before the
runtime reports what it really holds, and the runtime can build its data loader before the
process group exists.

Stage split: the blocks are split into contiguous ranges as evenly as possible, the first
`layers % pp` stages taking one more (`stage_layers`).

Model size: `param_count` counts the parameters of the built-in models exactly as
workers/runtime/model.py builds them (tests/workers/runtime/test_model.py checks it against
`sum(p.numel())`); `train_flops` is the usual 6 x parameters x tokens of a forward + backward.
"""
from __future__ import annotations

from dataclasses import dataclass

MESH_ORDER = ("pp", "dp", "tp")  # row-major, tp innermost
DIM_MEANING = {
    "pp": "pipeline stages: each holds a contiguous slice of the layers",
    "dp": "data parallel replicas: each trains on its own share of the global batch",
    "tp": "tensor parallel: attention heads and MLP columns split across these ranks",
}
FSDP_MEANING = ("data parallel, fully sharded (FSDP2): each replica holds 1/dp of the parameters, "
                "gradients and optimizer state")


@dataclass(frozen=True)
class Mesh:
    """A (pp, dp, tp) grid of ranks; `fsdp` says whether the dp dimension shards the model."""

    pp: int
    dp: int
    tp: int
    fsdp: bool = False

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None,
                  fsdp: bool = False) -> "Mesh":
        """The mesh of `world_size` ranks; dp None fills the rest (dp = world / (tp x pp)).
        ValueError when the shape does not multiply to the world size."""
        if world_size % (tp * pp):
            raise ValueError(f"the world size {world_size} is not divisible by tp x pp = {tp} x {pp}")
        dp = world_size // (tp * pp) if dp is None else dp
        if dp * tp * pp != world_size:
            raise ValueError(f"parallel dp x tp x pp = {dp} x {tp} x {pp} != world size {world_size}")
        return cls(pp=pp, dp=dp, tp=tp, fsdp=fsdp)

    @property
    def shape(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's place in the grid (tp innermost)."""
        return {"pp": rank // (self.dp * self.tp), "dp": (rank // self.tp) % self.dp,
                "tp": rank % self.tp}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The global rank at the given coordinates (the inverse of `coords`)."""
        return (pp * self.dp + dp) * self.tp + tp

    def meaning(self, dim: str) -> str:
        """What dimension `dim` does in this mesh (dp reads as sharded under fsdp)."""
        return FSDP_MEANING if dim == "dp" and self.fsdp else DIM_MEANING[dim]

    def dims(self) -> list[str]:
        """The dimensions of size > 1, in mesh order."""
        return [d for d in MESH_ORDER if self.shape[d] > 1]

    def describe(self) -> dict:
        """The mesh as the runtime reports it (the `rank_plan` event's "mesh")."""
        return {"shape": self.shape, "order": list(MESH_ORDER), "fsdp": self.fsdp,
                "dims": {d: self.meaning(d) for d in self.dims()}}


def stage_layers(layers: int, pp: int) -> list[range]:
    """The contiguous block range of each of `pp` stages, sizes differing by at most one
    (earlier stages get the extra). ValueError unless 1 <= pp <= layers."""
    if not 1 <= pp <= layers:
        raise ValueError(f"parallel.pp={pp} must be between 1 and model.layers={layers}")
    base, extra = divmod(layers, pp)
    out, lo = [], 0
    for s in range(pp):
        hi = lo + base + (1 if s < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def param_count(kind: str, *, layers: int, hidden: int, seq_len: int, vocab: int) -> int:
    """Parameters of workers/runtime/model.py's model: the demo GPT (layers 4, hidden 128,
    seq_len 128, vocab 256) has 875,264, the MLP of the same size 131,840."""
    h, v, n = hidden, vocab, layers
    head = h * v  # the LM head, untied, no bias
    ln = 2 * h    # a LayerNorm: weight and bias
    if kind == "mlp":  # token embedding, n Linear(h, h), ln_f, head
        return v * h + n * (h * h + h) + ln + head
    # a block: ln1, q/k/v, proj, ln2, mlp Linear(h, 4h), Linear(4h, h)
    block = ln + 3 * (h * h + h) + (h * h + h) + ln + (4 * h * h + 4 * h) + (4 * h * h + h)
    return v * h + seq_len * h + n * block + ln + head


def train_flops(params: int, tokens: int) -> float:
    """FLOPs of one forward + backward over `tokens` tokens: 6 x parameters x tokens (2 for the
    forward's multiply-adds, 4 for the backward's)."""
    return 6.0 * params * tokens
