"""Matmul throughput against matrix size, in this process: the thread count a slot gets (the
caller sets OMP_NUM_THREADS, as the launcher does), fp32 on CPU, bf16 on CUDA.

Each shape: warm-up calls, then `repeats` timed batches of calls (enough calls that a batch
lasts about MIN_BATCH_S), TFLOP/s = 2 m k n / (median seconds per call).
"""
from __future__ import annotations

import statistics
import time

import torch

MIN_BATCH_S = 0.02


def shapes(quick: bool, cuda: bool) -> list[tuple[int, int, int]]:
    """(m, k, n): square GEMMs over a range of sizes, plus the transformer's rectangular ones
    (tokens x hidden x 4 hidden and back)."""
    if cuda:
        square = [256, 512, 1024, 2048, 4096, 8192] if not quick else [512, 2048, 8192]
        rect = [(8192, 1024, 4096), (8192, 4096, 1024), (16384, 8192, 8192)] if not quick else []
    else:
        square = [32, 64, 128, 256, 512, 1024] if not quick else [64, 256, 512]
        rect = [(1024, 128, 512), (1024, 512, 128), (2048, 256, 1024), (512, 64, 256)] if not quick else []
    return [(n, n, n) for n in square] + rect


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """Median TFLOP/s of an (m x k) @ (k x n) product."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    _sync(device)
    t0 = time.perf_counter()
    torch.matmul(a, b, out=out)
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(1000, int(MIN_BATCH_S / one)))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b, out=out)
        _sync(device)
        per_call.append((time.perf_counter() - t0) / calls)
    return 2.0 * m * k * n / statistics.median(per_call) / 1e12


def sweep(device: torch.device, quick: bool) -> list[dict]:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    repeats = 3 if quick else 5
    return [{"m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."),
             "tflops": measure(m, k, n, device, dtype, repeats)}
            for m, k, n in shapes(quick, cuda)]
