"""Checkpoints, exact resume and chaos knobs: pure parts in-process, then real 2-rank torchrun.

The process tests (marked procs) run three jobs of 12 steps with every_steps=5:
  A  uninterrupted, async saves;
  B  the same job with chaos: rank 0 slowed (a straggler), rank 1 hanging after step 7; the test
     waits for B's step-5 checkpoint event and the hang, then SIGKILLs the whole torchrun tree;
  C  a new attempt of B's job resuming from B's step-5 checkpoint, sync saves.
C's losses at steps 6..12 must equal A's exactly (bit for bit, asserted with ==).
"""
import gc
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from workers.runtime import chaos as chaos_mod
from trainyard.sdk import checkpoint as ck
from workers.runtime.chaos import Chaos, ChaosPlan
from trainyard.spec import CheckpointSpec, DataSpec, ModelSpec
from workers.runtime.config import ConfigError, parse_run_config
from workers.runtime.data import TokenWindows, build_batches

from .conftest import REPO, SMALL_MODEL, make_launch_config, read_stream, start_torchrun, write_launch_config
from .test_torchrun import Output, by_rank, wait_for


# ---------------------------------------------------------------- manifest and directories

def _partial(root: Path, step: int, attempt: int, payload: bytes = b"x" * 10) -> Path:
    p = root / ck.partial_name(step, attempt)
    p.mkdir(parents=True)
    (p / "__0_0.distcp").write_bytes(payload)
    return p


def test_publish_writes_the_manifest_then_renames_and_read_manifest_accepts_only_that(tmp_path):
    partial = _partial(tmp_path, 5, 21, b"y" * 123)
    assert partial.name == ".partial-step-00000005-a21"
    with pytest.raises(ConfigError, match=f"resume.path {partial} is an unfinished save"):
        ck.read_manifest(partial)
    manifest = {"format": 1, "job_id": 8, "attempt_id": 21, "step": 5, "world_size": 2,
                "created_unixtime": 1.0, "size_bytes": ck.dir_size(partial), "blocking_s": 0.01,
                "save_s": 0.2}
    final = ck.publish(partial, manifest)
    assert final == tmp_path / "step-00000005-a21" and not partial.exists()
    assert sorted(p.name for p in final.iterdir()) == ["__0_0.distcp", "trainyard.json"]
    assert ck.read_manifest(final) == manifest and manifest["size_bytes"] == 123
    with pytest.raises(ValueError, match="not a .partial-"):
        ck.publish(final, manifest)


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist, so no trainyard.json"),
    (lambda d: d.mkdir(), "has no trainyard.json: not a complete checkpoint"),
    (lambda d: (d.mkdir(), (d / "trainyard.json").write_text("{")), "unreadable trainyard.json"),
    (lambda d: (d.mkdir(), (d / "trainyard.json").write_text('{"format": 2}')), "is not format 1"),
])
def test_a_resume_path_that_is_not_a_complete_checkpoint_is_a_config_error_naming_it(
        tmp_path, setup, message):
    path = tmp_path / "step-00000005-a21"
    setup(path)
    with pytest.raises(ConfigError, match=f"resume.path {path}.*{message}"):
        ck.read_manifest(path)


def test_resume_config_is_parsed_and_its_step_checked_against_the_manifest(tmp_path):
    final = ck.publish(_partial(tmp_path / "ckpt", 5, 21), {"format": 1, "step": 5})
    raw = make_launch_config(tmp_path, "redis://x:1/0", checkpoint={"every_steps": 5, "async": False})
    assert parse_run_config(raw).launch.resume is None
    assert parse_run_config(raw).checkpoint == CheckpointSpec.model_validate({"every_steps": 5, "async": False, "keep": 3})
    raw["resume"] = {"path": str(final), "step": 5, "checkpoint_id": 3}
    cfg = parse_run_config(raw)
    assert (cfg.launch.resume.path, cfg.launch.resume.step, cfg.launch.resume.checkpoint_id) == (final, 5, 3)
    assert ck.resume_manifest(cfg.launch.resume)["step"] == 5
    raw["resume"]["step"] = 10
    with pytest.raises(ConfigError, match=r"resume.step=10 but .*-a21/trainyard.json says step 5"):
        ck.resume_manifest(parse_run_config(raw).launch.resume)
    other_job = ck.publish(_partial(tmp_path / "job-99", 5, 21), {"format": 1, "step": 5})
    (tmp_path / "ckpt" / "step-00000006-a21").symlink_to(other_job)
    for bad, message in [({"path": "rel/dir", "step": 5}, "resume.path must be absolute"),
                         ({"step": 5}, "resume must be null or an object with path and step"),
                         # only the job's own checkpoint directory: not another job's, no way out of it
                         ({"path": str(other_job), "step": 5}, "is not a checkpoint directory inside"),
                         ({"path": str(tmp_path / "ckpt" / ".." / "job-99" / other_job.name), "step": 5},
                          "is not a checkpoint directory inside"),
                         ({"path": str(tmp_path / "ckpt" / "step-00000006-a21"), "step": 5},
                          "is not a checkpoint directory inside")]:
        raw["resume"] = bad
        with pytest.raises(ConfigError, match=message):
            parse_run_config(raw)


def test_stale_partials_of_other_attempts_are_removed_and_nothing_else(tmp_path):
    mine, old = _partial(tmp_path, 10, 22), _partial(tmp_path, 10, 21)
    older = _partial(tmp_path, 15, 2)  # "-a2" is a suffix of neither -a21 nor -a22
    done = ck.publish(_partial(tmp_path, 5, 21), {"format": 1, "step": 5})
    assert sorted(ck.remove_stale_partials(tmp_path, 22)) == sorted([old, older])
    assert sorted(tmp_path.iterdir()) == sorted([mine, done])


@pytest.mark.parametrize("step, every, last, due", [
    (5, 5, 12, True), (6, 5, 12, False), (10, 5, 12, True), (12, 5, 12, True), (1, 1, 3, True),
    (3, 50, 200, False), (200, 50, 200, True),
])
def test_saves_are_due_every_n_steps_and_at_the_last_step(step, every, last, due):
    assert ck.is_due(step, every, last) is due


# ---------------------------------------------------------------- data position

@pytest.mark.parametrize("start", [0, 3, 22, 23, 30])  # 23 batches per epoch here
def test_starting_at_batch_k_equals_iterating_past_k_batches_and_loads_none_of_them(
        tmp_path, monkeypatch, start):
    (tmp_path / "t.bin").write_bytes(np.arange(400, dtype=np.uint16).tobytes())
    args = dict(data=DataSpec(kind="tokens", path="t.bin"), model=ModelSpec(seq_len=8, vocab=400),
                data_root=tmp_path, rank=1, world_size=2, batch=4, seed=3, prefetch=False)
    full, _ = build_batches(**args)
    expected = [next(full) for _ in range(start + 30)][start:]  # crosses an epoch boundary
    loads = []
    real = TokenWindows.__getitems__
    monkeypatch.setattr(TokenWindows, "__getitems__", lambda self, idx: loads.append(idx) or real(self, idx))
    resumed, _ = build_batches(**args, start_batch=start)
    got = [next(resumed) for _ in range(30)]
    assert len(loads) == 30  # the skipped batches were never gathered
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


# ---------------------------------------------------------------- chaos knobs

def test_chaos_is_off_without_the_env_and_rereads_its_file_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.delenv(chaos_mod.ENV, raising=False)
    assert Chaos.from_environ(8, 0) is None
    monkeypatch.setenv(chaos_mod.ENV, str(tmp_path))
    c = Chaos.from_environ(8, 1, say=lambda line: None)
    assert c.refresh() == ChaosPlan()  # no file: nothing happens
    sleeps = []
    monkeypatch.setattr(chaos_mod.time, "sleep", sleeps.append)

    def write(plan):
        tmp = tmp_path / "tmp.json"
        tmp.write_text(json.dumps(plan))
        os.replace(tmp, tmp_path / "job-8.json")

    write({"slow_rank": 1, "slow_s": 0.25, "hang_at_step": None})
    c.before_compute(1)
    write({"slow_rank": 1, "slow_s": 0.5})
    c.before_compute(2)
    write({"slow_rank": None})
    c.before_compute(3)
    assert sleeps == [0.25, 0.5]
    (tmp_path / "job-8.json").write_text('{"slow_rank": 1, "slo')  # half-written: keep the last plan
    assert c.refresh() == ChaosPlan()
    (tmp_path / "job-8.json").write_text('{"slow_rank": 1, "surprise": 1}')
    with pytest.raises(ValueError, match=r"unknown chaos keys \['surprise'\]"):
        c.refresh()


class Fired(Exception):
    pass


@pytest.mark.parametrize("knob", ["exit", "hang", "raise"])
def test_exit_hang_and_raise_fire_once_per_job_on_the_named_rank_only(tmp_path, monkeypatch, knob):
    (tmp_path / "job-8.json").write_text(json.dumps({f"{knob}_at_step": 7, f"{knob}_rank": 1}))

    def fire(*_):
        raise Fired

    monkeypatch.setattr(chaos_mod.os, "_exit", fire)
    monkeypatch.setattr(chaos_mod.time, "sleep", fire)  # the hang loop's first sleep
    lines = []
    ranks = [Chaos(tmp_path, 8, r, say=lines.append) for r in (0, 1)]
    for c in ranks:
        c.refresh()
        c.after_step(6)
    ranks[0].after_step(7)
    with pytest.raises(chaos_mod.ChaosError if knob == "raise" else Fired):
        ranks[1].after_step(7)
    assert (tmp_path / f"job-8.{knob}-fired").exists()
    said = {"exit": "exiting with 137", "hang": "hanging", "raise": "raising"}[knob]
    assert lines == [f"rank 1 chaos: {said} after step 7"]
    restarted = Chaos(tmp_path, 8, 1)  # the next attempt passes step 7
    restarted.refresh()
    restarted.after_step(7)


# ---------------------------------------------------------------- Checkpointer, one rank in-process

class Events:
    def __init__(self):
        self.events = []

    def event(self, kind, **fields):
        self.events.append((kind, fields))


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            opt.state_dict()["state"][0]["exp_avg"].clone())


def _assert_state(model, opt, snapshot):
    weights, exp_avg = snapshot
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], exp_avg)


@pytest.mark.parametrize("async_", [True, False])
def test_save_publishes_once_and_load_restores_weights_optimizer_and_rng(tmp_path, one_rank, async_):
    reporter = Events()
    saver = ck.Checkpointer(CheckpointSpec.model_validate({"every_steps": 1, "async": async_}), tmp_path, job_id=8,
                            attempt_id=21, rank=0, world_size=1, device=torch.device("cpu"),
                            reporter=reporter)
    model, opt = _model_and_opt()
    _train_step(model, opt)
    at3 = _snapshot(model, opt)
    random.seed(5)
    blocking_s = saver.save(3, model, opt)
    after_save = (random.random(), torch.rand(3))  # the RNG draws a resumed run would make next
    # as the trainer: wait for the (async) state copy before the optimizer changes the state
    blocking_s += saver.wait_for_staging()
    _train_step(model, opt)
    at4 = _snapshot(model, opt)
    saver.save(4, model, opt)  # waits for 3, then restages into the same (cached) CPU copy
    saver.wait_for_staging()
    _train_step(model, opt)
    saver.close()
    saver.close()  # idempotent: nothing in flight
    final = tmp_path / "step-00000003-a21"
    assert [(kind, f["step"]) for kind, f in reporter.events] == [("checkpoint", 3), ("checkpoint", 4)]
    fields = reporter.events[0][1]
    manifest = ck.read_manifest(final)
    assert set(manifest) == set(ck.MANIFEST_KEYS)
    assert fields == {"step": 3, "path": str(final), "size_bytes": manifest["size_bytes"],
                      "blocking_s": manifest["blocking_s"], "save_s": manifest["save_s"]}
    assert fields["blocking_s"] == blocking_s and 0 < blocking_s and 0 < fields["save_s"] < 30
    assert fields["size_bytes"] == ck.dir_size(final) - (final / ck.MANIFEST).stat().st_size
    assert (manifest["job_id"], manifest["attempt_id"], manifest["world_size"]) == (8, 21, 1)
    assert {p.name for p in final.iterdir()} >= {".metadata", "rank-0.pt", ck.MANIFEST}
    assert not list(tmp_path.glob(".partial-*"))

    for step, path, snapshot in [(4, tmp_path / "step-00000004-a21", at4), (3, final, at3)]:
        fresh, fresh_opt = _model_and_opt(seed=1)
        resumed = saver.load(path, fresh, fresh_opt, seed=0)
        assert (resumed.step, resumed.batches_consumed, resumed.rng_restored) == (step, step, True)
        _assert_state(fresh, fresh_opt, snapshot)
    assert random.random() == after_save[0] and torch.equal(torch.rand(3), after_save[1])


RAN = []


def _ran_on_load():  # what a crafted pickle in a checkpoint would call: any function at all
    RAN.append(True)
    return 0


class Crafted:
    def __reduce__(self):
        return (_ran_on_load, ())


def test_loading_a_checkpoint_never_unpickles_code(tmp_path, one_rank):
    """DCP's default planner reads a checkpoint's non-tensor values with weights_only=False; the
    SDK's reads them as weights only, so a crafted value fails the load instead of running."""
    saver = ck.Checkpointer(CheckpointSpec.model_validate({"every_steps": 1, "async": False}), tmp_path, job_id=8,
                            attempt_id=21, rank=0, world_size=1, device=torch.device("cpu"), reporter=Events())
    model, opt = _model_and_opt()
    saver.save_state(3, {"model": model, "optim": opt, "trainer": {"step": 3, "lr": 0.1, "betas": (0.9, 0.99)},
                         "extra": Crafted()})
    saver.close()
    path = tmp_path / "step-00000003-a21"
    RAN.clear()
    with pytest.raises(CheckpointException) as raised:  # DCP wraps each rank's UnpicklingError
        saver.load_state(path, {"model": model, "optim": opt, "trainer": {}, "extra": None}, seed=0)
    assert "Weights only load failed" in str(raised.value) and RAN == []
    state = {"model": model, "optim": opt, "trainer": {"step": -1, "lr": 0.0, "betas": (0.0, 0.0)}}
    saver.load_state(path, state, seed=0)  # what the SDK itself saves (and DCP's .metadata) loads
    assert state["trainer"] == {"step": 3, "lr": 0.1, "betas": (0.9, 0.99)} and RAN == []
    (path / ".metadata").write_bytes(pickle.dumps(Crafted()))  # DCP unpickles .metadata with pickle.load
    with pytest.raises(CheckpointException) as raised:
        saver.load_state(path, state, seed=0)
    assert "may not name tests.workers.runtime.test_checkpoint._ran_on_load" in str(raised.value) and RAN == []


class GatedStager(DefaultStager):
    """The runtime's CPU stager, except that each copy starts only once `gate` is set (and then
    raises `fail` if given): the test decides when the save thread's copy runs."""

    def __init__(self, gate: threading.Event, fail: BaseException | None = None):
        super().__init__(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))
        self.gate, self.fail = gate, fail

    def stage(self, state_dict, **kwargs):
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        return super().stage(state_dict, **kwargs)


def _bn_model_and_opt(seed=0):
    """With BatchNorm: a forward in training mode updates its buffers (running stats)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full_state(model, opt):
    """Every tensor and value a checkpoint holds, as plain copies."""
    osd = opt.state_dict()
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in st.items()} for i, st in osd["state"].items()},
            [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]])


def _assert_same_state(a, b):
    (wa, sa, ga), (wb, sb, gb) = a, b
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sa.keys() == sb.keys()
    assert all(sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i])
               for i in sa)
    assert ga == gb


def test_the_state_copy_overlaps_the_next_forward_and_backward_and_saves_the_state_at_save_time(
        tmp_path, one_rank, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(ck, "make_stager", lambda device, pin_limit: GatedStager(gate))
    reporter = Events()
    saver = ck.Checkpointer(CheckpointSpec(every_steps=1), tmp_path, job_id=8, attempt_id=21,
                            rank=0, world_size=1, device=torch.device("cpu"), reporter=reporter)
    model, opt = _bn_model_and_opt()
    for _ in range(2):
        _train_step(model, opt)
    for group in opt.param_groups:
        group["lr"] = 0.02  # the trainer's lr_at(step)
    at_save = _full_state(model, opt)
    sync_s = saver.save(2, model, opt)
    assert not gate.is_set()  # save() returned before the copy began
    # The next step, as the trainer runs it, all before the copy has begun: the lr write, then
    # forward (BatchNorm updates its running stats and batch count in place) and backward.
    for group in opt.param_groups:
        group["lr"] = 0.01
    model(torch.randn(4, 8)).pow(2).mean().backward()
    assert not _full_state(model, opt)[0]["1.running_mean"].equal(at_save[0]["1.running_mean"])
    threading.Timer(0.2, gate.set).start()  # the copy runs after 0.2 s
    waited = saver.wait_for_staging()  # before the optimizer step: waits for the copy
    assert gate.is_set() and waited >= 0.1
    assert saver.wait_for_staging() == 0.0  # waited for already
    opt.step()  # now the optimizer changes weights, moments and step counts in place
    opt.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    saver.close()
    assert saver.wait_for_staging() == 0.0  # nothing in flight

    [(kind, fields)] = reporter.events
    path = tmp_path / "step-00000002-a21"
    manifest = ck.read_manifest(path)
    # blocking_s: the save call plus the wait before the optimizer step
    assert fields["blocking_s"] == manifest["blocking_s"] == sync_s + waited
    assert (kind, fields["step"], fields["path"]) == ("checkpoint", 2, str(path))
    fresh, fresh_opt = _bn_model_and_opt(seed=1)
    assert saver.load(path, fresh, fresh_opt, seed=0).step == 2
    _assert_same_state(_full_state(fresh, fresh_opt), at_save)


def test_a_failed_state_copy_fails_the_save_on_the_training_thread_and_publishes_nothing(
        tmp_path, one_rank, monkeypatch):
    gate = threading.Event()
    gate.set()
    monkeypatch.setattr(ck, "make_stager", lambda device, pin_limit: GatedStager(gate, MemoryError("no room")))
    reporter = Events()
    saver = ck.Checkpointer(CheckpointSpec(), tmp_path, job_id=8, attempt_id=21, rank=0,
                            world_size=1, device=torch.device("cpu"), reporter=reporter)
    model, opt = _model_and_opt()
    saver.save(5, model, opt)
    assert saver.wait_for_staging() >= 0.0  # returns; the error belongs to the save
    with pytest.raises(RuntimeError, match=r"checkpoint save of step 5 .* failed: MemoryError"):
        saver.wait()
    saver.close()
    assert reporter.events == [] and not list(tmp_path.glob("step-*"))


def test_without_its_rank_file_a_rank_seeds_its_rngs_deterministically(tmp_path, one_rank):
    saver = ck.Checkpointer(CheckpointSpec.model_validate({"async": False}), tmp_path, job_id=8, attempt_id=21, rank=0,
                            world_size=1, device=torch.device("cpu"), reporter=Events())
    model, opt = _model_and_opt()
    _train_step(model, opt)
    saver.save(6, model, opt)
    path = tmp_path / "step-00000006-a21"
    (path / "rank-0.pt").unlink()  # as if saved by a world without this rank
    draws = []
    for _ in range(2):
        resumed = saver.load(path, *_model_and_opt(seed=len(draws) + 1), seed=0)
        assert (resumed.step, resumed.rng_restored) == (6, False)
        draws.append((random.random(), np.random.rand(), torch.rand(2)))
    assert draws[0][:2] == draws[1][:2] and torch.equal(draws[0][2], draws[1][2])


def test_a_failed_async_save_is_raised_on_the_training_thread_and_never_published(
        tmp_path, one_rank, monkeypatch):
    def failing_save(state, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(ck.dcp, "save", failing_save)
    reporter = Events()
    saver = ck.Checkpointer(CheckpointSpec(), tmp_path, job_id=8, attempt_id=21, rank=0,
                            world_size=1, device=torch.device("cpu"), reporter=reporter)
    model, opt = _model_and_opt()
    saver.save(5, model, opt)
    with pytest.raises(RuntimeError, match=r"checkpoint save of step 5 into .*\.partial-step-00000005-a21 "
                                           r"failed: OSError\('disk full'\)"):
        for _ in range(3000):  # as the trainer: poll() after each step until the save is done
            saver.poll()
            time.sleep(0.01)
    saver.poll()  # reported once
    assert reporter.events == [] and not list(tmp_path.glob("step-*"))


# ---------------------------------------------------------------- real torchrun: A, B (killed), C

STEPS, EVERY = 12, 5
SLOW_S = 0.15  # B's straggler: ~6x the ~25 ms step of SMALL_MODEL on 2 cores


def _job(tmp_path, name, redis_url, job_id, attempt_id, **sections):
    cfg = make_launch_config(tmp_path / name, redis_url, model=SMALL_MODEL,
                             train={"steps": STEPS, "global_batch": 16},
                             checkpoint={"every_steps": EVERY, "async": True}, **sections)
    cfg.update(job_id=job_id, attempt_id=attempt_id, stream=f"trainyard:job:{job_id}")
    return cfg


def _losses(samples, attempt):
    return {(s["rank"], s["step"]): s["loss"] for s in samples if s["attempt"] == attempt}


def _kill_tree(proc):
    procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(30)


@pytest.mark.procs
def test_a_killed_job_resumes_from_its_checkpoint_with_the_same_losses(tmp_path, redis_server, repo_env):
    url = redis_server.url
    # ---- A: uninterrupted, async checkpoints at 5, 10 and the last step, 12
    a = _job(tmp_path, "a", url, job_id=7, attempt_id=9)
    proc = start_torchrun(write_launch_config(tmp_path, a), repo_env)
    out = Output(proc)
    assert proc.wait(120) == 0, out.text()
    samples_a, events_a, _ = read_stream(url, "trainyard:job:7")
    ckpts = [e for e in events_a if e["kind"] == "checkpoint"]
    assert [(e["step"], e["rank"], e["attempt"]) for e in ckpts] == [(5, 0, 9), (10, 0, 9), (12, 0, 9)]
    step_s = {(s["rank"], s["step"]): s["step_s"] for s in samples_a}
    for e in ckpts:
        path = Path(e["path"])
        assert path == Path(a["checkpoint_dir"]) / f"step-{e['step']:08d}-a9"
        manifest = ck.read_manifest(path)
        assert manifest == {"format": 1, "job_id": 7, "attempt_id": 9, "step": e["step"],
                            "world_size": 2, "created_unixtime": manifest["created_unixtime"],
                            "size_bytes": e["size_bytes"], "blocking_s": e["blocking_s"],
                            "save_s": e["save_s"], "files": manifest["files"]}
        # every file but the manifest, with its size: what the control plane checks before registering
        assert manifest["files"] == {p.name: p.stat().st_size for p in path.iterdir() if p.name != ck.MANIFEST}
        assert abs(manifest["created_unixtime"] - time.time()) < 120
        assert e["size_bytes"] == ck.dir_size(path) - (path / ck.MANIFEST).stat().st_size > 1e6
        assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= {p.name for p in path.iterdir()}
        # the block lands in step_s: the save call in its step's, the wait for its state copy
        # (before the next optimizer step) in the next step's
        assert 0 < e["blocking_s"] <= step_s[(0, e["step"])] + step_s.get((0, e["step"] + 1), 0)
        assert 0 < e["save_s"] < 30
    kinds = [e["kind"] for e in events_a if e["rank"] == 0]
    assert kinds.index("rank_finished") > max(i for i, k in enumerate(kinds) if k == "checkpoint")
    assert not list(Path(a["checkpoint_dir"]).glob(".partial-*"))

    # ---- B: same job, rank 0 a straggler, rank 1 hangs after step 7; SIGKILL once the
    # step-5 checkpoint is reported and the hang has begun
    chaos_dir = tmp_path / "chaos"
    chaos_dir.mkdir()
    (chaos_dir / "job-8.json").write_text(json.dumps(
        {"slow_rank": 0, "slow_s": SLOW_S, "hang_at_step": 7, "hang_rank": 1}))
    env = {**repo_env, chaos_mod.ENV: str(chaos_dir)}
    b = _job(tmp_path, "b", url, job_id=8, attempt_id=21)
    proc = start_torchrun(write_launch_config(tmp_path, b), env)
    out = Output(proc)

    def b_state():
        samples, events, _ = read_stream(url, "trainyard:job:8")
        return ({(s["rank"], s["step"]) for s in samples},
                [e for e in events if e["kind"] == "checkpoint"])

    wait_for(lambda: proc.poll() is not None or (
        (chaos_dir / "job-8.hang-fired").exists() and {(0, 7), (1, 7)} <= b_state()[0]
        and b_state()[1]), 90, "B's step-5 checkpoint and the hang after step 7")
    assert proc.poll() is None, "B ended instead of hanging:\n" + out.text()
    time.sleep(0.5)  # a hung job stays hung: no rank reports step 8
    _kill_tree(proc)
    samples_b, events_b, _ = read_stream(url, "trainyard:job:8")
    assert "rank 1 chaos: hanging after step 7" in out.text()
    assert sorted({(s["rank"], s["step"]) for s in samples_b}) == [
        (r, s) for r in (0, 1) for s in range(1, 8)]
    [ckpt_b] = [e for e in events_b if e["kind"] == "checkpoint"]
    b_dir = Path(b["checkpoint_dir"])
    b5 = b_dir / "step-00000005-a21"
    assert ckpt_b["step"] == 5 and Path(ckpt_b["path"]) == b5 and (b5 / ck.MANIFEST).is_file()
    losses_a = _losses(samples_a, 9)
    assert _losses(samples_b, 21) == {k: v for k, v in losses_a.items() if k[1] <= 7}  # chaos changes no math

    # The straggler is visible per rank: its sleep is in its compute_s; its peer waits for it in
    # comm (comm_s and step_s grow, compute_s does not). Step 1 (warm-up) is left out.
    med = {r: {k: float(np.median([s[k] for s in rs if s["step"] > 1]))
               for k in ("compute_s", "comm_s", "step_s")} for r, rs in by_rank(samples_b).items()}
    assert med[0]["compute_s"] >= SLOW_S, med
    assert med[1]["compute_s"] < SLOW_S / 2 and med[1]["step_s"] >= 0.8 * SLOW_S, med
    assert med[1]["comm_s"] >= 0.6 * SLOW_S, med

    # A crash mid-save leaves a .partial dir: never a checkpoint, and the next attempt deletes it.
    stale = _partial(b_dir, 10, 21)
    assert not any(".partial" in e["path"] for e in events_a + events_b if e["kind"] == "checkpoint")

    # ---- C: a new attempt of B's job resumes from B's step-5 checkpoint (sync saves this time);
    # the chaos file still says hang at 7, but that fired once already
    c = dict(b, attempt_id=22, run_dir=str(tmp_path / "c" / "run"),
             resume={"path": str(b5), "step": 5, "checkpoint_id": 1})
    c["spec"] = {**b["spec"], "checkpoint": {"every_steps": EVERY, "async": False, "keep": 3}}
    proc = start_torchrun(write_launch_config(tmp_path, c), env)
    out = Output(proc)
    assert proc.wait(120) == 0, out.text()
    text = out.text()
    for rank in (0, 1):
        assert f"rank {rank} resumed from step 5 ({b5}) in " in text, text
    samples_c, events_c, _ = read_stream(url, "trainyard:job:8")
    [resumed] = [e for e in events_c if e["kind"] == "resumed"]
    assert (resumed["attempt"], resumed["rank"], resumed["step"], resumed["path"]) == (22, 0, 5, str(b5))
    assert 0 < resumed["load_s"] < 30
    losses_c = _losses(samples_c, 22)
    assert sorted(losses_c) == [(r, s) for r in (0, 1) for s in range(6, STEPS + 1)]
    # Exact equality holds (not just |diff| <= 1e-6): same weights, optimizer state, batches,
    # and lr, and gloo's 2-rank sum is order-independent.
    assert losses_c == {k: v for k, v in losses_a.items() if k[1] > 5}
    assert not stale.exists()
    assert sorted(p.name for p in b_dir.iterdir()) == [
        "step-00000005-a21", "step-00000010-a22", "step-00000012-a22"]
    assert [e["step"] for e in events_c if e["kind"] == "checkpoint" and e["attempt"] == 22] == [10, 12]


def test_the_checkpointer_decides_which_steps_it_saves(tmp_path, one_rank):
    """Every every_steps steps and the last; a forced (preemption) save of a step already saved
    is skipped, of another step taken."""
    reporter = Events()
    saver = ck.Checkpointer(CheckpointSpec.model_validate({"every_steps": 3, "async": False}), tmp_path, job_id=8,
                            attempt_id=21, rank=0, world_size=1, device=torch.device("cpu"),
                            reporter=reporter)
    model, opt = _model_and_opt()
    _train_step(model, opt)
    saved = []
    for step in range(1, 8):
        saver.save_if_due(step, model, opt, last_step=7)
        if saver.saved_step == step:
            saved.append(step)
    assert saved == [3, 6, 7]
    saver.save_if_due(7, model, opt, last_step=7, force=True)  # saved already: nothing
    saver.save_if_due(5, model, opt, last_step=7, force=True)  # not due, but forced
    saver.close()
    assert [e[1]["step"] for e in reporter.events] == [3, 6, 7, 5]


# ---------------------------------------------------------------- staging: share, cap, device

@pytest.mark.procs
def test_under_ddp_each_rank_stages_only_its_share_and_three_async_saves_reload_exactly(
        tmp_path, repo_env):
    """2 ranks on gloo (staging_cases.py): each rank copies about half the replicated state per
    save (it copied all of it when every rank staged everything and DCP dropped half of it at
    write), together they write all of it, and every save reloads bit for bit, RNG included."""
    cases = Path(__file__).with_name("staging_cases.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(cases), str(tmp_path)]
    done = subprocess.run(argv, cwd=REPO, env=repo_env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    total = ranks[0]["state_bytes"]
    for r in ranks:
        assert r["state_bytes"] == total and len(r["staged_bytes"]) == 3
        assert all(0.3 * total < staged < 0.7 * total for staged in r["staged_bytes"]), (r, total)
        assert r["exact"] == [True] * 3 and r["rng"] == [True] * 3
    assert all(sum(r["staged_bytes"][i] for r in ranks) >= total for i in range(3))


class _Pins:
    """torch's host-register calls, faked at the library boundary (no CUDA here)."""

    def __init__(self):
        self.bytes, self.live = 0, {}

    def pin(self, ptr, size):
        self.bytes += size
        self.live[ptr] = size

    def unpin(self, ptr):
        self.live.pop(ptr)


def test_the_pinned_copy_stops_at_the_cap_and_the_rest_is_staged_pageable(monkeypatch):
    from torch.cuda import _pin_memory_utils
    from trainyard.sdk.staging import ShareStager
    pins = _Pins()
    monkeypatch.setattr(_pin_memory_utils, "pin_memory", pins.pin)
    monkeypatch.setattr(_pin_memory_utils, "unpin_memory", pins.unpin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else torch's stager never pins
    flat = {"a": torch.randn(256), "b": torch.randn(512), "c": torch.randn(128)}  # 1, 2, 0.5 KiB
    stager = ShareStager(pin_memory=True, pin_limit_bytes=1536 + 100)
    first = None
    for round_ in range(3):
        out = stager.stage(flat)
        assert out.keys() == flat.keys() and all(torch.equal(out[k], flat[k]) for k in flat)
        assert all(out[k].data_ptr() != flat[k].data_ptr() for k in flat)
        first = first or {k: v.data_ptr() for k, v in out.items()}
        assert {k: v.data_ptr() for k, v in out.items()} == first  # the same host memory, refilled
        # a (1 KiB) pinned; b (2 KiB) would pass the cap: pageable; c (0.5 KiB) still fits
        assert stager.pinned_bytes == 1536 == pins.bytes == sum(pins.live.values()), round_
        assert stager.staged_bytes == 3584
        for t in flat.values():
            t.add_(1.0)  # the next save copies the new values into the same host memory
    stager.close()
    del out
    gc.collect()
    assert pins.live == {} and stager.pinned_bytes == 0
    nothing = ShareStager(pin_memory=True, pin_limit_bytes=0)
    assert torch.equal(nothing.stage(flat)["b"], flat["b"]) and nothing.pinned_bytes == 0
    assert pins.bytes == 1536


def test_the_cap_is_a_share_of_host_ram_per_local_rank():
    from trainyard.sdk.staging import pin_limit_bytes
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert pin_limit_bytes(0.25, 8) == int(ram * 0.25) // 8
    assert pin_limit_bytes(0.0, 8) == 0
    assert CheckpointSpec().pinned_host_fraction == 0.25


def test_the_save_thread_binds_the_ranks_device_before_any_cuda_call(tmp_path, one_rank, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread(), d)))
    saver = ck.Checkpointer(CheckpointSpec(), tmp_path, job_id=8, attempt_id=21, rank=0, world_size=1,
                            device=torch.device("cuda", 1), reporter=Events())
    thread = saver._thread.submit(threading.current_thread).result()
    saver.close()
    assert calls == [(thread, torch.device("cuda", 1))]
