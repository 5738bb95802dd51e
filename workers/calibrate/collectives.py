"""Collective time against bytes, under torchrun (every rank calls `sweep`; gloo on CPU, NCCL
on CUDA). `bytes` is the size of the whole tensor (trainyard/calibration.py): all_reduce's
buffer, all_gather's output, reduce_scatter's input, send_recv's message (rank 0 sends to rank 1
and back: half the round trip is one message's time).

Each (op, size): warm-up calls, then `repeats` timed calls, each preceded by a barrier so the
ranks start together; a call's time is the slowest rank's (all-reduced MAX); the median is kept.
`link`: intra when every rank of the group is on this node (torchrun's LOCAL_WORLD_SIZE is the
world), inter otherwise.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def sizes(quick: bool) -> list[int]:
    """Powers of 4 from 4 KiB (latency-bound) to 16 MiB (bandwidth-bound); quick: 4 of them."""
    return [1 << p for p in (range(12, 25, 4) if quick else range(12, 25, 2))]


def _op(op: str, nbytes: int, device: torch.device):
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = max(world, nbytes // 4 // world * world)  # float32, divisible by the world
    full = torch.ones(numel, device=device)
    part = torch.empty(numel // world, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full), numel * 4
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part), numel * 4
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full), numel * 4

    def send_recv():  # a round trip between ranks 0 and 1; the others wait
        if rank == 0:
            dist.send(full, 1)
            dist.recv(full, 1)
        elif rank == 1:
            dist.recv(full, 0)
            dist.send(full, 0)
    return send_recv, numel * 4


def _time(fn, device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def sweep(device: torch.device, quick: bool) -> list[dict]:
    world = dist.get_world_size()
    link = "intra" if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world else "inter"
    repeats = 5 if quick else 9
    out = []
    for op in OPS:
        for nbytes in sizes(quick):
            fn, real = _op(op, nbytes, device)
            for _ in range(2):
                fn()
            times = torch.tensor([_time(fn, device) for _ in range(repeats)], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            seconds = statistics.median(times.tolist())
            if op == "send_recv":
                seconds /= 2
            out.append({"op": op, "group": world, "link": link, "bytes": real, "seconds": seconds})
    return out
