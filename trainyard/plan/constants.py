"""The few constants the cost model (cost.py) needs per device type, and their defaults.

`DEFAULT_GPU` was fit on published large-scale runs (published.py; the fit is fit.py, re-run by
`bench/planner_published.py --fit`); `DEFAULT_CPU` is this machine's order of magnitude until a
calibration (workers/calibrate, fit by trainyard/plan/calibration.py) replaces it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceConstants:
    name: str
    matmul_eff: tuple[tuple[float, float], ...]
    """(n, efficiency) points sorted by n: achieved / peak TFLOP/s of a GEMM whose geometric-mean
    dimension is n; interpolated log-linearly in n, clamped at the ends."""
    intra_alpha_s: float = 10e-6
    """latency of one collective call inside a node"""
    inter_alpha_s: float = 30e-6
    """latency of one collective call across nodes"""
    intra_gbs: float | None = None
    """measured one-way GB/s per device inside a node (None: the request's intra_node_gbs)"""
    inter_gbs: float | None = None
    """measured one-way GB/s per node across nodes (None: the request's inter_node_gbs)"""
    comm_eff: float = 0.7
    """fraction of the link bandwidth a collective achieves"""
    overlap: float = 0.0
    """fraction of the dp reduction hidden under backward (DDP/FSDP/ZeRO-1), at most the last
    micro-batch's backward (FSDP: all the compute of the step)"""
    step_overhead_s: float = 0.0
    """fixed time per optimizer step (data loading, logging, launch)"""
    layer_overhead_s: float = 0.0
    """per layer per micro-batch, forward + backward: kernel launches, Python"""
    tp_layer_overhead_s: float = 0.0
    """tp > 1: per layer per micro-batch, fwd+bwd, the sharded modules' own cost beyond their
    collectives' bytes and latency (DTensor dispatch, redistributes): calibrated"""
    fsdp_layer_overhead_s: float = 0.0
    """fsdp: per layer per micro-batch, fwd+bwd, the unit's gather/free bookkeeping beyond its bytes:
    calibrated"""
    activation_factor: float = 1.0
    """multiplies the Korthikanti activation bytes (calibrated for our GPT)"""
    optimizer_gbs: float = 1000.0
    """memory bandwidth of the optimizer step, GB/s"""
    elementwise_gbs: float = 0.0
    """memory bandwidth of the non-GEMM work (norms, activations, softmax), GB/s; 0: not counted"""
    elementwise_bytes: float = 0.0
    """bytes the non-GEMM work moves per layer, per token, per hidden unit, fwd+bwd (per tp shard)"""
    attention_bytes: float = 0.0
    """bytes the softmax, mask and dropout of materialized attention move per score element
    (a*s*s per sequence per layer), fwd+bwd; fused attention has none"""
    source: str = "default"

    def efficiency(self, n: float) -> float:
        """GEMM efficiency at geometric-mean dimension n (log-linear between the points)."""
        pts = self.matmul_eff
        if n <= pts[0][0]:
            return pts[0][1]
        if n >= pts[-1][0]:
            return pts[-1][1]
        for (n0, e0), (n1, e1) in zip(pts, pts[1:]):
            if n <= n1:
                w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
                return e0 + w * (e1 - e0)
        return pts[-1][1]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["matmul_eff"] = [list(p) for p in self.matmul_eff]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceConstants":
        """The constants in `d` (from to_dict, maybe older or newer: unknown keys are ignored,
        missing ones take their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        pts = tuple(sorted((float(n), float(e)) for n, e in kw.get("matmul_eff") or ((1.0, 0.5),)))
        kw["matmul_eff"] = pts
        return cls(**kw)


# Fit by trainyard/plan/fit.py on the training rows of published.py (fit.TRAIN); held-out
# errors in tests/trainyard/plan/test_published.py. Re-fit: `bench/planner_published.py --fit`.
DEFAULT_GPU = DeviceConstants(
    name="gpu",
    matmul_eff=((1024.0, 0.384), (4096.0, 0.6489920622500002), (16384.0, 0.6579999999999999)),
    comm_eff=0.6162933279999998,
    overlap=0.47,
    layer_overhead_s=4.439024493897474e-07,
    elementwise_gbs=2000.0,
    elementwise_bytes=594.2915393575277,
    attention_bytes=6.553707270903999,
    source='published-fit on megatron21-1.7B, megatron21-18.4B, megatron21-145.6B, megatron21-1008.0B, mtnlg-530B-2240 (loss 0.0468)',
)

# This machine's CPUs (one training thread per rank, fp32), order of magnitude until `manage.py
# calibrate` measures them: a 1-thread fp32 matmul reached ~0.04 / 0.15 / 0.19 / 0.10 / 0.075
# TFLOP/s at n = 64 / 128 / 256 / 512 / 1024 (torch, loaded machine, 2026-12-01), against the
# 0.2 TFLOP/s peak trainyard/plan/job.py assumes for a "cpu" process.
DEFAULT_CPU = DeviceConstants(
    name="cpu",
    matmul_eff=((64.0, 0.2), (128.0, 0.6), (256.0, 0.8), (1024.0, 0.4)),
    intra_alpha_s=50e-6,
    inter_alpha_s=200e-6,
    comm_eff=0.5,
    overlap=0.3,
    step_overhead_s=0.01,
    layer_overhead_s=0.0005,
    optimizer_gbs=5.0,
    source="default (order of magnitude for this machine's CPUs)",
)
