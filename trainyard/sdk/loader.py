"""`run.loader(dataset)`: this rank's share of each global batch of a map-style Dataset, in an
order fixed by the job's seed, prefetched in a background thread, with a position that
checkpoints and resumes exactly.

- Order: epoch e is torch.randperm(len(dataset)) from a generator seeded with (seed + e) (or
  0..n-1 with shuffle=False); global batch i of the epoch is positions [i x G, (i + 1) x G) of
  it, G = the global batch; the last incomplete global batch of an epoch is dropped, so every
  step is one whole global batch.
- Share: data-parallel rank r of dp takes positions [r x b, (r + 1) x b) of the global batch,
  b = G / dp. Single-process training with batch G sees the same samples per step: under DDP's
  gradient averaging the same update (tests/workers/runtime/test_prepare.py).
- Balance (train.balance auto, trainyard/sdk/balance.py through run.prepare): `set_slice(offset,
  n)` makes this rank's share positions [offset, offset + n) of each global batch from the next
  batch it hands out (prefetched ones are read again); `batch_size` is the current share. The
  ranks' slices tile the global batch, so the samples of a step are the same whatever the split.
- Prefetch: the next `prefetch` batches are read and collated in one background thread; on
  CUDA each is pinned and copied to the rank's device without blocking. On the CPU a thread only
  pays where reading a batch takes a while: the first INLINE_PROBE batches are read in the
  caller and timed, and if their median is under INLINE_S the loader goes on reading in the
  caller (`mode` "inline"; an in-memory dataset: the hand-off to a thread and its contention for
  the GIL cost more than the read, 5% of a 16 ms step in bench/prepare.py), else in the thread
  (`mode` "thread"). prefetch=0 always reads in the caller.
- Position: `state_dict()` is {"consumed": batches handed out, "global_batch", "seed"};
  `run.restore({"data": loader, ...})` puts it back, and the next batch is the one an
  uninterrupted run would have seen next (mid-epoch too). A position saved under another
  global batch or seed is refused (the order it indexes would not be this one).
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.utils.data import default_collate


INLINE_PROBE = 3  # batches read in the caller and timed before a CPU loader picks its mode
INLINE_S = 0.002  # a CPU batch read faster than this (median) stays in the caller


class Loader:
    """An endless iterator of this rank's batches, one per step (see the module docstring)."""

    def __init__(self, dataset: Any, *, batch_size: int, dp_rank: int, dp: int, seed: int,
                 device: torch.device, shuffle: bool = True, collate: Callable[[list], Any] | None = None,
                 prefetch: int = 2):
        try:
            n = len(dataset)
        except TypeError:
            raise TypeError("run.loader needs a map-style dataset (with __len__ and __getitem__), "
                            f"got {type(dataset).__name__}") from None
        if batch_size < 1:
            raise ValueError(f"run.loader: batch_size must be at least 1, got {batch_size}")
        self.dataset, self.batch_size, self.dp_rank, self.dp = dataset, batch_size, dp_rank, dp
        self.global_batch = batch_size * dp
        self.per_epoch = n // self.global_batch
        if self.per_epoch < 1:
            raise ValueError(f"run.loader: the dataset has {n} samples, fewer than one global batch "
                             f"({batch_size} x {dp} data-parallel ranks = {self.global_batch})")
        self.n, self.seed, self.shuffle, self.device = n, seed, shuffle, device
        self.collate = collate or default_collate
        self.prefetch = max(0, prefetch)
        # "probe" (CPU: timing the first reads), "inline" or "thread" (loader.py's docstring)
        self.mode = "inline" if self.prefetch == 0 else "thread" if device.type == "cuda" else "probe"
        self._probe_s: list[float] = []
        self.consumed = 0
        self.offset = dp_rank * batch_size  # this rank's slice of each global batch (set_slice)
        self.balanced = False  # set_slice was called: the shares follow train.balance
        self._orders: dict[int, torch.Tensor] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}

    def __len__(self) -> int:
        """Steps per epoch."""
        return self.per_epoch

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> Any:
        if self.mode != "thread":
            t0 = time.perf_counter()
            batch = self._load(self.consumed)
            if self.mode == "probe":
                self._probe_s.append(time.perf_counter() - t0)
                if len(self._probe_s) == INLINE_PROBE:
                    self.mode = "inline" if statistics.median(self._probe_s) < INLINE_S else "thread"
            self.consumed += 1
            return batch
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainyard-loader")
        for pos in range(self.consumed, self.consumed + self.prefetch + 1):
            if pos not in self._ahead:
                self._ahead[pos] = self._pool.submit(self._load, pos)
        batch = self._ahead.pop(self.consumed).result()
        self.consumed += 1
        return batch

    def indices(self, pos: int) -> list[int]:
        """The dataset indices of this rank's share of global batch `pos` (counted over epochs)."""
        epoch, i = divmod(pos, self.per_epoch)
        order = self._order(epoch)
        start = i * self.global_batch + self.offset
        return order[start:start + self.batch_size].tolist()

    def set_slice(self, offset: int, n: int) -> None:
        """From the next batch on, this rank's share is positions [offset, offset + n) of each
        global batch (train.balance auto); batches prefetched for the old share are dropped."""
        if not (0 <= offset and 1 <= n and offset + n <= self.global_batch):
            raise ValueError(f"run.loader: slice [{offset}, {offset + n}) is not inside a global batch of "
                             f"{self.global_batch}")
        self.balanced = True
        if (offset, n) != (self.offset, self.batch_size):
            self._drop_ahead()
            self.offset, self.batch_size = offset, n

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
                            if self.shuffle else torch.arange(self.n)}
        return self._orders[epoch]

    def _load(self, pos: int) -> Any:
        batch = self.collate([self.dataset[j] for j in self.indices(pos)])
        if self.device.type == "cuda":
            batch = _to(batch, lambda t: t.pin_memory().to(self.device, non_blocking=True))
        return batch

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "global_batch": self.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("global_batch"), state.get("seed")) != (self.global_batch, self.seed):
            raise ValueError(f"run.loader: the checkpoint's data position was saved with global batch "
                             f"{state.get('global_batch')} and seed {state.get('seed')}; this run has "
                             f"{self.global_batch} and {self.seed}, so the position would index another order")
        self._drop_ahead()
        self.consumed = int(state["consumed"])

    def _drop_ahead(self) -> None:
        for f in self._ahead.values():
            f.cancel()
        for f in self._ahead.values():
            if not f.cancelled():
                try:
                    f.result()
                except Exception:  # a read for a position no one asks for any more
                    pass
        self._ahead = {}

    def close(self) -> None:
        self._drop_ahead()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def for_run(run: Any, dataset: Any, batch_size: int | None, **options: Any) -> Loader:
    """`run.loader`'s Loader: this rank's dp coordinate and share of train.global_batch (or
    `batch_size`); under train.balance auto the share the balancer decided (loaders made before
    prepare got it from the Balance)."""
    from trainyard.mesh import Mesh

    from .config import ConfigError

    spec = run.spec
    mesh = Mesh.for_world(run.world_size, tp=spec.plan.tp if spec else 1)
    balance = run._prepared.balance if run._prepared is not None else None
    if balance is not None and batch_size not in (None, balance.total // mesh.dp):
        raise ConfigError(f"run.loader: under train.balance auto each rank's share of the global batch "
                          f"({balance.total}) follows its speed: leave batch_size out (got {batch_size})")
    if batch_size is None:
        if spec is None:
            raise ValueError("run.loader: without a launch config (standalone) pass batch_size")
        if spec.train.global_batch % mesh.dp:
            raise ConfigError(f"run.loader: train.global_batch {spec.train.global_batch} does not split "
                              f"over {mesh.dp} data-parallel ranks: make it a multiple, or pass batch_size")
        batch_size = spec.train.global_batch // mesh.dp
    loader = Loader(dataset, batch_size=batch_size, dp_rank=mesh.coords(run.rank)["dp"], dp=mesh.dp,
                    seed=run._seed, device=run.device, **options)
    if balance is not None:
        loader.set_slice(balance.offset, balance.n)
    return loader


def _to(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, fn) for k, v in batch.items()}
    return batch
