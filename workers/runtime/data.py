"""Training data: every data kind becomes a 1-D token array cut into random windows.

- demo: the shipped public-domain corpus (corpus/demo.txt), byte-level ids in [0, 256).
- synthetic: seeded uniform random ids in [0, vocab), generated in memory (throughput runs).
- tokens: a uint16 file under data_root, memory-mapped so a large file costs no RAM up front.

A sample is a window of seq_len+1 consecutive tokens starting anywhere in the training split
(x = window[:-1], y = window[1:]). DistributedSampler shuffles the window starts with the job
seed and gives each rank a disjoint share; demo and tokens hold out their last 5% for
validation. Batches are gathered with one vectorised numpy index per batch (`__getitems__`).
A resumed run starts `start_batch` batches in (epoch start_batch // batches per epoch, that
epoch's index order cut after the batches already consumed), so step k gets the same batch
whether or not the run was interrupted before it.

With train.balance=auto (trainyard/sdk/balance.py) ranks take unequal, changing shares of each step's global
batch: every rank walks the same global batch order (`global_batches`) and gathers only its own
contiguous slice (`SliceBatches`); an equal split gives exactly the samples above.

Loader choice, measured on 2 shared cores (16 x 129-token batches next to a small GPT step):
gathering inline costs ~0.05-0.2 ms per batch; a forked DataLoader worker (num_workers=1)
made the wait 1.7-3.6 ms (pickling the batch through a pipe); a prefetch thread made it
~0.1 ms and, unlike inline gathering, hides page faults when a large `tokens` memmap is not in
the page cache. So: num_workers=0 behind a one-thread prefetcher.

Pinned batches (CUDA): a batch is a `WindowBatch`, (x, y) viewing one contiguous (B, seq_len+1)
window. `pin_batch` pins that window, never the shifted views, and `to_device` copies the window
and shifts on the device: a CUDA copy of a non-contiguous view first makes a contiguous copy in
pageable memory, which turns `non_blocking=True` into a synchronous copy.
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainyard.spec import DataSpec, ModelSpec

from .config import ConfigError

DEMO_CORPUS = Path(__file__).resolve().parent / "corpus" / "demo.txt"
VAL_FRACTION = 0.05
# DistributedSampler materialises a shuffled Python list of every index each epoch (~36 bytes
# per index), so a big `tokens` file gets window starts on a stride that keeps the count at
# or under 1M (~40 MB, ~0.1 s per epoch) instead of one window per token.
MAX_WINDOWS = 1 << 20
# Synthetic data: 1M ids is generated in a few ms and holds more distinct windows than a
# throughput run consumes; its content does not matter, only its shape.
SYNTHETIC_TOKENS = 1 << 20

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenWindows(Dataset):
    """Map-style dataset: index i is the window tokens[s : s + seq_len + 1], s = i * stride.

    stride defaults to the smallest that keeps len(self) <= MAX_WINDOWS (1 for the demo corpus).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, stride: int | None = None):
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"{len(tokens)} tokens cannot fill one window of seq_len+1={seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len
        starts = len(tokens) - seq_len  # possible start positions
        self.stride = stride or -(-starts // MAX_WINDOWS)
        self._len = (starts - 1) // self.stride + 1
        self._offsets = np.arange(seq_len + 1)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> Batch:
        x, y = self.__getitems__([i])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> Batch:
        # One fancy-index gather for the whole batch instead of B slices + a collate.
        rows = np.asarray(indices, dtype=np.int64)[:, None] * self.stride + self._offsets
        return WindowBatch(torch.from_numpy(self.tokens[rows].astype(np.int64)))


class WindowBatch(tuple):
    """(x, y) = (window[:, :-1], window[:, 1:]), keeping the contiguous window both view as
    `.window`, so pinning and the host-to-device copy move one contiguous block."""

    window: torch.Tensor

    def __new__(cls, window: torch.Tensor) -> "WindowBatch":
        batch = super().__new__(cls, (window[:, :-1], window[:, 1:]))
        batch.window = window
        return batch


def pin_batch(batch: Batch) -> Batch:
    """The batch in page-locked memory: a WindowBatch's contiguous window, pinned once (x and y
    stay views of it); a plain (x, y) pins a contiguous copy of each."""
    window = getattr(batch, "window", None)
    if window is None:
        return tuple(t.contiguous().pin_memory() for t in batch)
    return WindowBatch(window.contiguous().pin_memory())


def to_device(batch: Batch, device: torch.device | str) -> Batch:
    """(x, y) on `device`: a WindowBatch copies its contiguous window (asynchronously when pinned)
    and takes the shifted views there; on the CPU that is the same views as before."""
    window = getattr(batch, "window", None)
    if window is None:
        x, y = batch
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    w = window.to(device, non_blocking=True)
    return w[:, :-1], w[:, 1:]


def _already_batched(batch: Batch) -> Batch:
    return batch


def load_tokens(data: DataSpec, model: ModelSpec, data_root: Path, seed: int) -> np.ndarray:
    """The whole token array for this data kind (a memmap for `tokens`)."""
    if data.kind == "demo":
        return np.frombuffer(DEMO_CORPUS.read_bytes(), dtype=np.uint8)
    if data.kind == "synthetic":
        rng = np.random.default_rng(seed)
        dtype = np.uint16 if model.vocab <= 65536 else np.int64
        return rng.integers(0, model.vocab, size=SYNTHETIC_TOKENS, dtype=dtype)
    return _load_token_file(data, model, data_root)


def _load_token_file(data: DataSpec, model: ModelSpec, data_root: Path) -> np.ndarray:
    root = Path(data_root).resolve()
    path = (root / str(data.path)).resolve()
    if not path.is_relative_to(root):  # the control plane checks this too; a launch config is not trusted twice
        raise ConfigError(f"data.path {data.path!r} lies outside the data root {root}")
    if not path.is_file():
        raise FileNotFoundError(f"data.path {data.path!r}: token file {path} does not exist")
    size = path.stat().st_size
    if size % 2:
        raise ConfigError(f"token file {path} has {size} bytes, not a whole number of uint16 ids")
    if size == 0:
        raise ConfigError(f"token file {path} is empty")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    # One streaming pass (~0.3 s per GB): an id >= vocab would otherwise surface as an opaque
    # embedding index error (or a device-side assert on CUDA) mid-run.
    top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))
    if top >= model.vocab:
        raise ConfigError(f"token file {path} contains id {top} >= model.vocab={model.vocab}")
    return tokens


def split(tokens: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(train, val): the last VAL_FRACTION of real text is held out; synthetic has no val."""
    if kind == "synthetic":
        return tokens, None
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    return tokens[:cut], tokens[cut:]


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose current epoch can start `skip` indices in.

    The skipped indices are cut from the epoch's index list, never fetched: skipping 10k
    batches costs one pass over a list of ints (~4 ms per 1M indices), not 10k batch loads.
    """

    skip = 0

    def __iter__(self):
        it = super().__iter__()
        return itertools.islice(it, self.skip, None) if self.skip else it

    def __len__(self) -> int:
        return super().__len__() - self.skip


def train_loader(windows: TokenWindows, *, rank: int, world_size: int, batch: int, seed: int,
                 pin_memory: bool = False) -> tuple[DataLoader, ResumableSampler]:
    sampler = ResumableSampler(windows, num_replicas=world_size, rank=rank, shuffle=True,
                               seed=seed, drop_last=True)
    if len(sampler) < batch:
        raise ConfigError(
            f"the training split has {len(windows)} windows, {len(sampler)} per rank: fewer than "
            f"one per-rank batch of {batch}; use more data or a smaller batch / seq_len")
    # Its own generator: each pass of a DataLoader draws a base seed from it, and without one from
    # torch's global generator, on the prefetch thread, racing the trainer's torch.manual_seed and
    # model build (two runs of one job could start from different weights on a loaded machine).
    loader = DataLoader(windows, batch_size=batch, sampler=sampler, drop_last=True,
                        num_workers=0, collate_fn=pin_batch if pin_memory else _already_batched,
                        generator=torch.Generator().manual_seed(seed))
    return loader, sampler


def forever(loader: DataLoader, sampler: ResumableSampler, start_batch: int = 0) -> Iterator[Batch]:
    """Endless batches; each pass over the split reshuffles (set_epoch) identically on all ranks.

    The first `start_batch` batches (those a resumed run consumed before its checkpoint) are
    skipped without being loaded.
    """
    per_epoch = len(sampler) // loader.batch_size  # drop_last: only whole batches
    epoch, skip = divmod(start_batch, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        sampler.skip = skip * loader.batch_size
        yield from loader
        epoch, skip = epoch + 1, 0


class Prefetcher:
    """Fetches the next batches on a daemon thread so `next()` usually returns at once.

    Depth 2 bounds memory to two batches; errors in the source re-raise on the consumer.
    """

    _END = object()

    def __init__(self, source: Iterator[Batch], depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._source = source
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainyard-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._source:
                self._q.put(item)
        except BaseException as e:  # surfaced on the training thread by __next__
            self._error = e
        self._q.put(self._END)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Batch:
        item = self._q.get()
        if item is self._END:
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item


def build_batches(data: DataSpec, model: ModelSpec, data_root: Path, *, rank: int,
                  world_size: int, batch: int, seed: int, pin_memory: bool = False,
                  prefetch: bool = True, start_batch: int = 0,
                  balance: bool = False) -> tuple[Iterator[Batch], np.ndarray | None]:
    """The endless training batch iterator for this rank, from batch `start_batch` on, and the
    held-out val tokens. balance=True: a SliceBatches over global batches of batch x world_size,
    starting with this rank's equal share (the same samples as balance=False)."""
    train, val = split(load_tokens(data, model, data_root, seed), data.kind)
    if balance:
        windows = TokenWindows(train, model.seq_len)
        orders = global_batches(windows, world_size=world_size, global_batch=batch * world_size,
                                seed=seed, start_batch=start_batch)
        return SliceBatches(windows, orders, rank * batch, batch, pin_memory=pin_memory,
                            prefetch=prefetch), val
    loader, sampler = train_loader(TokenWindows(train, model.seq_len), rank=rank,
                                   world_size=world_size, batch=batch, seed=seed,
                                   pin_memory=pin_memory)
    it = forever(loader, sampler, start_batch)
    return (Prefetcher(it) if prefetch else it), val


def global_batches(windows: TokenWindows, *, world_size: int, global_batch: int, seed: int,
                   start_batch: int = 0) -> Iterator[np.ndarray]:
    """Endless index arrays of whole global batches (train.balance=auto), from `start_batch` on.

    Batch b of an epoch is perm[b*N:(b+1)*N] (perm: DistributedSampler's shuffle, the same for
    any num_replicas), ordered rank-major: position r*B + k holds perm[b*N + r + k*world], which
    is what DistributedSampler(num_replicas=world) gives rank r as the k-th sample of its batch
    (B = N / world). So an equal split of these arrays is exactly the unbalanced runs' per-rank
    batches, and epoch lengths and resume positions are those of `forever`.
    """
    per_rank_batch = global_batch // world_size
    perms = DistributedSampler(windows, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    per_epoch = (len(windows) // world_size) // per_rank_batch
    if per_epoch < 1:
        raise ConfigError(
            f"the training split has {len(windows)} windows, {len(windows) // world_size} per rank: "
            f"fewer than one per-rank batch of {per_rank_batch}; use more data or a smaller batch / seq_len")
    return _global_batches(perms, len(windows), world_size, global_batch, per_epoch, start_batch)


def _global_batches(perms: DistributedSampler, count: int, world_size: int, global_batch: int,
                    per_epoch: int, start_batch: int) -> Iterator[np.ndarray]:
    per_rank_batch = global_batch // world_size
    epoch, skip = divmod(start_batch, per_epoch)
    while True:
        perms.set_epoch(epoch)
        perm = np.fromiter(iter(perms), dtype=np.int64, count=count)
        for b in range(skip, per_epoch):
            block = perm[b * global_batch:(b + 1) * global_batch]
            yield block.reshape(per_rank_batch, world_size).T.reshape(-1)
        epoch, skip = epoch + 1, 0


class SliceBatches:
    """This rank's contiguous slice [offset, offset + count) of every step's global batch.

    `set_slice` changes the slice from the next `next()` on (load balancing re-splits between
    steps). The prefetch thread runs ahead with the slice in force when it fetched, and keeps the
    step's index array with the batch: a batch fetched under an older slice is re-gathered
    inline (one ~0.1 ms gather, only on the <= depth+1 steps after a change), so a change takes
    effect at exactly the next step. Only this rank's indices are ever gathered.
    """

    def __init__(self, windows: TokenWindows, orders: Iterator[np.ndarray], offset: int, count: int,
                 *, pin_memory: bool = False, prefetch: bool = True):
        self.windows, self.pin_memory = windows, pin_memory
        self._slice = (offset, count)
        self.refetched = 0  # batches re-gathered after a slice change (tests, diagnosis)
        source = self._fetch(orders)
        self._it = Prefetcher(source) if prefetch else source

    def set_slice(self, offset: int, count: int) -> None:
        if offset < 0 or count < 1:
            raise ValueError(f"bad slice offset={offset} count={count}")
        self._slice = (offset, count)  # one tuple store: atomic for the prefetch thread

    @property
    def slice(self) -> tuple[int, int]:
        return self._slice

    def _load(self, order: np.ndarray, sl: tuple[int, int]) -> Batch:
        offset, count = sl
        if offset + count > len(order):
            raise ValueError(f"slice [{offset}, {offset + count}) outside a global batch of {len(order)}")
        batch = self.windows.__getitems__(order[offset:offset + count].tolist())
        return pin_batch(batch) if self.pin_memory else batch

    def _fetch(self, orders: Iterator[np.ndarray]):
        for order in orders:
            sl = self._slice
            yield order, sl, self._load(order, sl)

    def __iter__(self) -> "SliceBatches":
        return self

    def __next__(self) -> Batch:
        order, sl, batch = next(self._it)
        current = self._slice
        if sl != current:  # fetched ahead under the previous split
            self.refetched += 1
            batch = self._load(order, current)
        return batch


def val_batches(val: np.ndarray, seq_len: int, batch: int, count: int) -> list[Batch]:
    """`count` fixed, evenly spaced val batches: the same on every rank and every run."""
    windows = TokenWindows(val, seq_len, stride=1)
    starts = np.linspace(0, len(windows) - 1, num=batch * count).astype(np.int64)
    return [windows.__getitems__(starts[i * batch:(i + 1) * batch].tolist()) for i in range(count)]
