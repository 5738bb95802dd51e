import numpy as np
import pytest
import torch

from trainyard.spec import DataSpec, ModelSpec
from workers.runtime.config import ConfigError
from workers.runtime.data import (DEMO_CORPUS, MAX_WINDOWS, TokenWindows, build_batches,
                                  load_tokens, pin_batch, split, to_device, train_loader, val_batches)

MODEL = ModelSpec(seq_len=16, vocab=256)


def test_demo_corpus_is_shipped_plain_text_of_the_promised_size():
    raw = DEMO_CORPUS.read_bytes()
    assert 300_000 <= len(raw) <= 800_000
    text = raw.decode("ascii")  # plain English, byte-level ids < 128
    assert "In the beginning God created the heaven and the earth." in text
    assert (DEMO_CORPUS.parent / "SOURCE.md").is_file()


def test_windows_are_next_token_pairs():
    tokens = np.arange(100, dtype=np.uint16)
    w = TokenWindows(tokens, seq_len=8)
    assert len(w) == 92 and w.stride == 1
    x, y = w.__getitems__([0, 91])
    assert x.dtype == torch.int64 and x.shape == (2, 8)
    assert x[1].tolist() == list(range(91, 99)) and y[1].tolist() == list(range(92, 100))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_big_token_arrays_get_a_stride_that_bounds_the_sampler():
    tokens = np.zeros(3 * MAX_WINDOWS + 100, dtype=np.uint16)
    w = TokenWindows(tokens, seq_len=16)
    assert w.stride == 4 and len(w) <= MAX_WINDOWS
    last_start = (len(w) - 1) * w.stride
    assert last_start + 17 <= len(tokens)  # the last window is in bounds
    w.__getitems__([len(w) - 1])


def test_ranks_get_disjoint_shards_and_the_same_seed_gives_the_same_order():
    w = TokenWindows(np.arange(1000, dtype=np.uint16), seq_len=16)
    shards = []
    for rank in range(2):
        loader, sampler = train_loader(w, rank=rank, world_size=2, batch=8, seed=5)
        sampler.set_epoch(0)
        shards.append([i for i in sampler])
    assert not set(shards[0]) & set(shards[1])
    assert len(shards[0]) == len(shards[1]) == len(w) // 2
    loader, sampler = train_loader(w, rank=0, world_size=2, batch=8, seed=5)
    sampler.set_epoch(0)
    assert list(sampler) == shards[0]
    sampler.set_epoch(1)
    assert list(sampler) != shards[0]  # each epoch reshuffles


def test_val_split_is_held_out_and_fixed():
    tokens = load_tokens(DataSpec(kind="demo"), MODEL, data_root=None, seed=0)
    train, val = split(tokens, "demo")
    assert len(train) + len(val) == len(tokens) and len(val) == pytest.approx(0.05 * len(tokens), abs=1)
    a, b = val_batches(val, 16, 4, 2), val_batches(val, 16, 4, 2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))


def test_batches_run_across_epochs_with_prefetch(tmp_path):
    root = tmp_path
    (root / "t.bin").write_bytes(np.arange(200, dtype=np.uint16).tobytes())
    it, val = build_batches(DataSpec(kind="tokens", path="t.bin"), ModelSpec(seq_len=8, vocab=300), root,
                            rank=1, world_size=2, batch=4, seed=0)
    seen = [next(it) for _ in range(40)]  # 190 train tokens -> 91 windows per rank: several epochs
    for x, y in seen:
        assert x.shape == (4, 8) and torch.equal(x + 1, y)  # consecutive ids => y = x + 1
    assert val is not None and len(val) == 10


def test_the_batches_never_draw_from_the_global_random_generator(tmp_path):
    """The prefetch thread starts before the trainer seeds torch and builds the model; each pass of
    a DataLoader without its own generator drew its base seed from torch's global generator. A
    prefetch thread that got there after the seeding (a loaded machine) changed the initial
    weights: two runs of one job trained from different weights (CI, test_recompute_zero: step
    1's losses differed)."""
    (tmp_path / "t.bin").write_bytes(np.arange(200, dtype=np.uint16).tobytes())
    for balance in (False, True):
        torch.manual_seed(3)
        expected = torch.rand(4)
        torch.manual_seed(3)
        it, _ = build_batches(DataSpec(kind="tokens", path="t.bin"), ModelSpec(seq_len=8, vocab=300), tmp_path,
                              rank=0, world_size=2, batch=4, seed=0, prefetch=False, balance=balance)
        for _ in range(60):  # several epochs: a DataLoader's every pass drew one
            next(it)
        assert torch.equal(torch.rand(4), expected), balance


def test_synthetic_is_seeded_and_within_vocab():
    m = ModelSpec(vocab=50)
    a = load_tokens(DataSpec(kind="synthetic"), m, None, seed=1)
    b = load_tokens(DataSpec(kind="synthetic"), m, None, seed=1)
    c = load_tokens(DataSpec(kind="synthetic"), m, None, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() == 49
    assert split(a, "synthetic")[1] is None


def test_token_file_errors_are_clear(tmp_path):
    m = ModelSpec(seq_len=8, vocab=100)
    with pytest.raises(FileNotFoundError, match="missing.bin.*does not exist"):
        load_tokens(DataSpec(kind="tokens", path="missing.bin"), m, tmp_path, 0)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="not a whole number of uint16"):
        load_tokens(DataSpec(kind="tokens", path="odd.bin"), m, tmp_path, 0)
    (tmp_path / "big.bin").write_bytes(np.array([1, 2, 100], dtype=np.uint16).tobytes())
    with pytest.raises(ConfigError, match="contains id 100 >= model.vocab=100"):
        load_tokens(DataSpec(kind="tokens", path="big.bin"), m, tmp_path, 0)
    with pytest.raises(ConfigError, match="outside the data root"):
        load_tokens(DataSpec(kind="tokens", path="../x.bin"), m, tmp_path / "sub", 0)
    (tmp_path / "short.bin").write_bytes(np.arange(40, dtype=np.uint16).tobytes())
    with pytest.raises(ConfigError, match="fewer than one per-rank batch"):
        build_batches(DataSpec(kind="tokens", path="short.bin"), m, tmp_path, rank=0, world_size=2,
                      batch=16, seed=0)


@pytest.fixture
def pinned(monkeypatch):
    """Tensor.pin_memory faked at the torch boundary (no CUDA here): records the layout of what
    would be page-locked and returns a fresh contiguous copy, like the real call."""
    calls: list[tuple[tuple[int, ...], bool]] = []

    def fake_pin(self, device=None):
        calls.append((tuple(self.shape), self.is_contiguous()))
        return self.clone(memory_format=torch.contiguous_format)

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # so a DataLoader would pin too
    return calls


@pytest.mark.parametrize("balance", [False, True])
def test_a_pinned_batch_pins_and_copies_its_contiguous_window(tmp_path, pinned, balance):
    """Finding 8: pinning x = window[:, :-1] and y = window[:, 1:] pins strided views, and a CUDA
    non_blocking copy of a strided view goes through a pageable contiguous copy (synchronous).
    Only the contiguous (batch, seq_len + 1) window is pinned and copied; the shift is taken after."""
    (tmp_path / "t.bin").write_bytes(np.arange(200, dtype=np.uint16).tobytes())
    spec, model = DataSpec(kind="tokens", path="t.bin"), ModelSpec(seq_len=8, vocab=300)
    plain, _ = build_batches(spec, model, tmp_path, rank=1, world_size=2, batch=4, seed=0,
                             prefetch=False, balance=balance)
    it, _ = build_batches(spec, model, tmp_path, rank=1, world_size=2, batch=4, seed=0,
                          pin_memory=True, prefetch=False, balance=balance)
    copied: list[tuple[tuple[int, ...], bool]] = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copied.append((tuple(self.shape), self.is_contiguous()))
        return real_to(self, *args, **kwargs)

    for _ in range(3):
        batch, want = next(it), next(plain)
        assert pinned[-1] == ((4, 9), True)
        copied.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "to", recording_to)
            x, y = to_device(batch, "cpu")
        assert copied == [((4, 9), True)]
        assert torch.equal(x, want[0]) and torch.equal(y, want[1]) and torch.equal(x[:, 1:], y[:, :-1])
    assert pinned == [((4, 9), True)] * 3


def test_on_the_cpu_a_batch_is_the_same_views_without_pinning(pinned):
    windows = TokenWindows(np.arange(50, dtype=np.uint16), seq_len=8)
    batch = windows.__getitems__([0, 3])
    x, y = to_device(batch, "cpu")
    assert x.data_ptr() == batch[0].data_ptr() and y.data_ptr() == batch[1].data_ptr()
    assert x.shape == y.shape == (2, 8) and torch.equal(x + 1, y)
    assert to_device((x, y), "cpu")[0] is x and not pinned
    assert pin_batch((x, y))[0].is_contiguous() and pinned == [((2, 8), True)] * 2  # a plain pair
