"""run.prepare / run.loader / run.micro_batches for a model that is not Trainyard's
(user_model_script.py: a minGPT-style GPT with its own attention, MLP and block list), under real
torchrun with 2 gloo ranks and a real Redis: under each data-parallel plan the mean of the ranks'
per-step losses is single-process training's on the same global batch and seed (fp32); top-k
compression with error feedback cuts the bytes each rank sends; local SGD averages models; a
checkpoint resumes the loader mid-epoch exactly; a spec that needs prepare fails fast without it."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, RedisServer
from trainyard.sdk import RUN_CONFIG_ENV
from trainyard.sdk.loader import Loader
from trainyard.sdk.prepare import find_blocks, split

from .conftest import make_launch_config, read_stream, write_launch_config

SCRIPT = REPO / "tests" / "workers" / "runtime" / "user_model_script.py"
FULL_PARAM_BYTES = 4 * 30_080  # the example MinGPT's parameters (vocab 64, 2 blocks of width 32), fp32
STEPS, BATCH = 6, 8
LINE = re.compile(r"^user rank (\d+) step (\d+) loss (\S+) bytes (\S+) ratio (\S+) averaged (\S+) share (\S+)$", re.MULTILINE)


def _run(tmp: Path, url: str, *, nproc: int, job_id: int, steps: int = STEPS, resume: dict | None = None,
         comm: dict | None = None, parallel: dict | str | None = None, train: dict | None = None, **config):
    cfg = make_launch_config(tmp, url, model=None, data=None, entrypoint={"script": str(SCRIPT)},
                             train={"steps": steps, "global_batch": BATCH, "seed": 5, **(train or {})},
                             checkpoint={"every_steps": 5}, config=config,
                             resources={"nodes": 1, "procs_per_node": nproc},
                             parallel=parallel if parallel == "auto" else {"dp": nproc, **(parallel or {})},
                             **({"comm": comm} if comm else {}))
    cfg.update(job_id=job_id, stream=f"trainyard:job:{job_id}", checkpoint_dir=str(tmp / "ckpt"), resume=resume)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           RUN_CONFIG_ENV: str(write_launch_config(tmp, cfg))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(SCRIPT)], cwd=tmp, env=env, text=True, capture_output=True, timeout=240)
    return proc, cfg


def _losses(out: str) -> dict[int, list[float]]:
    """step -> every rank's loss."""
    per: dict[int, list[float]] = {}
    for m in LINE.finditer(out):
        per.setdefault(int(m[2]), []).append(float(m[3]))
    return per


def _mean_losses(out: str) -> list[float]:
    return [sum(v) / len(v) for _, v in sorted(_losses(out).items())]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, redis_url) -> list[float]:
    """Single-process training on the whole global batch: the losses every plan must give."""
    proc, _ = _run(tmp_path_factory.mktemp("single"), redis_url, nproc=1, job_id=40)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = _mean_losses(proc.stdout)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


PLANS = {"dp": {}, "grad_accum": {"train": {"grad_accum": 2}},
         "zero1_recompute": {"parallel": {"shard_optimizer": True, "recompute": "full"}},
         "fsdp": {"parallel": {"fsdp": True}},
         "fsdp_recompute_accum": {"parallel": {"fsdp": True, "recompute": "full"}, "train": {"grad_accum": 2}}}


@pytest.mark.procs
@pytest.mark.parametrize("name", list(PLANS))
def test_each_plan_trains_a_user_model_as_single_process_training_does(name, reference, redis_url, tmp_path):
    case = PLANS[name]  # each plan its own job (stream): the samples read back are this run's only
    proc, cfg = _run(tmp_path, redis_url, nproc=2, job_id=50 + list(PLANS).index(name), **case)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(len(v) == 2 for v in _losses(proc.stdout).values())
    assert _mean_losses(proc.stdout) == pytest.approx(reference, rel=1e-5)
    samples, events, _ = read_stream(redis_url, cfg["stream"])
    assert sorted((s["rank"], s["step"]) for s in samples) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]
    fsdp = case.get("parallel", {}).get("fsdp", False)
    assert all(s["compute_s"] > 0 and s["optim_s"] > 0 for s in samples)
    assert fsdp or all(s["bytes_sent"] > 0 for s in samples)  # FSDP's collectives are not metered
    plans = {e["rank"]: e for e in events if e["kind"] == "rank_plan"}
    assert set(plans) == {0, 1} and plans[0]["strategy"] == ("fsdp" if fsdp else "ddp")
    assert plans[1]["coords"]["dp"] == 1 and plans[0]["mesh"]["fsdp"] is fsdp
    if fsdp:  # each rank holds its half of every parameter
        assert "shard 1 of 2" in plans[1]["role"] and plans[0]["param_bytes"] < 0.6 * FULL_PARAM_BYTES
    if case.get("parallel", {}).get("shard_optimizer"):
        assert "ZeRO-1" in plans[0]["role"] and plans[0]["shard_optimizer"] is True
    if case.get("parallel", {}).get("recompute"):
        assert plans[0]["recompute"] == "full" and "(h)" in plans[0]["role"]


@pytest.mark.procs
def test_topk_with_error_feedback_cuts_the_bytes_of_a_user_model(reference, redis_url, tmp_path):
    topk, cfg = _run(tmp_path, redis_url, nproc=2, job_id=43,
                     comm={"compression": "topk", "ratio": 0.01, "start_step": 2})
    assert topk.returncode == 0, topk.stdout + topk.stderr
    rows = {(int(m[1]), int(m[2])): m for m in LINE.finditer(topk.stdout)}
    dense = int(rows[(0, 1)][4])  # steps up to start_step: dense (ratio 1.0)
    assert float(rows[(0, 1)][5]) == 1.0 and int(rows[(1, 2)][4]) == dense
    assert all(float(rows[(r, s)][5]) > 10 for r in (0, 1) for s in range(3, STEPS + 1))
    assert all(int(rows[(r, s)][4]) * 10 < dense for r in (0, 1) for s in range(3, STEPS + 1))
    mean = _mean_losses(topk.stdout)
    assert mean[:2] == pytest.approx(reference[:2], rel=1e-5) and mean[2:] != pytest.approx(reference[2:], rel=1e-5)
    samples, _, _ = read_stream(redis_url, cfg["stream"])
    assert all(s["compression_ratio"] > 10 for s in samples if s["step"] > 2)


@pytest.mark.procs
def test_local_sgd_averages_a_user_models_replicas(redis_url, tmp_path):
    proc, _ = _run(tmp_path, redis_url, nproc=2, job_id=44, comm={"sync": "local_sgd", "period": 2, "start_step": 2})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    averaged = {int(m[2]): m[6] for m in LINE.finditer(proc.stdout) if m[1] == "0"}
    assert [s for s, a in sorted(averaged.items()) if a == "global"] == [3, 5]
    assert all(int(m[4]) == 0 for m in LINE.finditer(proc.stdout) if int(m[2]) in (4, 6))  # local steps send nothing


@pytest.mark.procs
@pytest.mark.parametrize("first_plan, then", [({}, {"fsdp": True}), ({"fsdp": True}, {})], ids=["dp-fsdp", "fsdp-dp"])
def test_a_resumed_user_run_continues_the_loader_mid_epoch_exactly(first_plan, then, reference, redis_url, tmp_path):
    """Under one plan or across plans: a DDP checkpoint resumes under FSDP and back (DCP reshards)."""
    job_id = 45 + 10 * len(first_plan) + 20 * len(then)
    first, cfg = _run(tmp_path, redis_url, nproc=2, job_id=job_id, steps=5, parallel=first_plan)  # saves step 5
    assert first.returncode == 0, first.stdout + first.stderr
    _, events, _ = read_stream(redis_url, cfg["stream"])
    ckpt = [e for e in events if e["kind"] == "checkpoint"][-1]
    resume = {"path": ckpt["path"], "step": 5, "checkpoint_id": 1}
    second, _ = _run(tmp_path, redis_url, nproc=2, job_id=job_id, steps=STEPS, resume=resume, resume_check=True,
                     parallel=then)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "user rank 0 resumed at 5 consumed 5" in second.stdout
    losses = _losses(first.stdout) | _losses(second.stdout)
    assert [sum(v) / len(v) for _, v in sorted(losses.items())] == pytest.approx(reference, rel=1e-5)


@pytest.mark.procs
def test_balance_gives_a_slow_rank_a_smaller_share_and_keeps_the_single_process_update(redis_url, tmp_path):
    """train.balance auto through run.loader: rank 1 sleeps 20 ms per sample, so after the warm-up
    (1 + 5 measured steps) it gets fewer samples of each global batch of 8; weighting each rank's
    gradient by its share keeps every step the whole batch's update: the share-weighted mean of
    the ranks' losses is single-process training's, step by step (fp32)."""
    steps = 12
    for d in ("single", "balanced", "mismatch"):
        (tmp_path / d).mkdir()
    single, _ = _run(tmp_path / "single", redis_url, nproc=1, job_id=70, steps=steps)
    assert single.returncode == 0, single.stdout + single.stderr
    proc, cfg = _run(tmp_path / "balanced", redis_url, nproc=2, job_id=71, steps=steps, train={"balance": "auto"},
                     slow_rank=1, slow_s=0.02)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {(int(m[1]), int(m[2])): (float(m[3]), float(m[7])) for m in LINE.finditer(proc.stdout)}
    weighted = [sum(loss * share for (r, s), (loss, share) in rows.items() if s == step)
                for step in range(1, steps + 1)]
    assert weighted == pytest.approx(_mean_losses(single.stdout), rel=1e-5)
    assert all(rows[(r, s)][1] == 0.5 for r in (0, 1) for s in range(1, 7))  # warm-up: equal
    assert rows[(1, steps)][1] < 0.5 < rows[(0, steps)][1], rows
    samples, events, _ = read_stream(redis_url, cfg["stream"])
    rebalanced = [e for e in events if e["kind"] == "rebalanced"]
    assert rebalanced and rebalanced[0]["step"] == 6 and rebalanced[0]["counts"][1] < 4, rebalanced
    assert all("share" in s for s in samples)
    refused, _ = _run(tmp_path / "mismatch", redis_url, nproc=2, job_id=72, steps=2, train={"balance": "auto"},
                      mode="noprepare")
    assert refused.returncode != 0 and "train.balance auto" in refused.stdout + refused.stderr


@pytest.mark.procs
def test_a_spec_that_needs_prepare_fails_fast_without_it(redis_url, tmp_path):
    proc, _ = _run(tmp_path, redis_url, nproc=2, job_id=46, comm={"compression": "topk"}, mode="noprepare")
    assert proc.returncode != 0
    assert "ConfigError: this job's spec asks for comm.compression topk, which run.prepare" in proc.stdout + proc.stderr
    assert "step 1 loss" not in proc.stdout


def test_the_loader_resumes_mid_epoch_exactly_and_splits_each_global_batch_over_the_ranks():
    data = [torch.tensor([i]) for i in range(20)]

    def loader(rank: int = 0, dp: int = 1, batch: int = 4) -> Loader:
        return Loader(data, batch_size=batch, dp_rank=rank, dp=dp, seed=3, device=torch.device("cpu"))

    whole = loader()
    seen = [next(whole).flatten().tolist() for _ in range(12)]  # 5 batches an epoch: into epoch 3
    assert sorted(sum(seen[:5], [])) == list(range(20)) and seen[:5] != seen[5:10]
    halves = [loader(r, 2, 2) for r in (0, 1)]
    assert [next(halves[0]).flatten().tolist() + next(halves[1]).flatten().tolist() for _ in range(3)] == seen[:3]
    state = whole.state_dict()
    resumed = loader()
    resumed.load_state_dict({**state, "consumed": 7})
    assert [next(resumed).flatten().tolist() for _ in range(5)] == seen[7:12]
    with pytest.raises(ValueError, match="global batch 8 and seed 3"):
        loader(batch=2).load_state_dict({**state, "global_batch": 8})
    with pytest.raises(ValueError, match="fewer than one global batch"):
        loader(batch=32)
    whole.close()


def test_describe_finds_the_shape_the_knowledge_base_records():
    import importlib.util

    found = importlib.util.spec_from_file_location("own_model_train2", REPO / "examples" / "own_model" / "train.py")
    example = importlib.util.module_from_spec(found)
    found.loader.exec_module(example)
    from trainyard.sdk.prepare import describe

    model = example.MinGPT(n_layer=3, n_head=4, n_embd=32)
    name, blocks = find_blocks(model)
    d = describe(model, name, blocks)
    assert d == {"kind": "user", "layers": 3, "hidden": 32, "heads": 4, "vocab": 64,
                 "params": sum(p.numel() for p in model.parameters()),
                 "params_per_block": sum(p.numel() for p in blocks[0].parameters()), "blocks": "h"}
    assert describe(torch.nn.Linear(4, 4), "", []) is None


def test_blocks_are_found_by_their_shape_or_their_name_and_batches_split_evenly():
    import importlib.util

    found = importlib.util.spec_from_file_location("own_model_train", REPO / "examples" / "own_model" / "train.py")
    example = importlib.util.module_from_spec(found)
    found.loader.exec_module(example)
    MinGPT = example.MinGPT
    model = MinGPT(n_layer=3)
    name, blocks = find_blocks(model)
    assert name == "h" and len(blocks) == 3
    assert find_blocks(model, "h")[0] == "h"
    from trainyard.sdk.config import ConfigError

    with pytest.raises(ConfigError, match="no submodule 'layers'"):
        find_blocks(model, "layers")
    x, y = torch.arange(8), torch.arange(8, 16)
    parts = split((x, y), 2)
    assert [p[0].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="does not split into train.grad_accum = 3"):
        split(x, 3)


def test_a_cpu_loader_reads_in_the_caller_unless_reading_takes_a_while_and_hands_out_the_same_batches():
    """loader.py: on the CPU the first 3 reads are timed; an in-memory dataset stays inline (a
    thread's hand-off costs more than the read), a slow one moves to the prefetch thread."""
    import time as _time

    class Slow(list):
        def __getitem__(self, i):
            _time.sleep(0.002)
            return list.__getitem__(self, i)

    data = [torch.tensor([i]) for i in range(24)]

    def batches(dataset, **kw) -> tuple[list, str]:
        loader = Loader(dataset, batch_size=4, dp_rank=0, dp=1, seed=3, device=torch.device("cpu"), **kw)
        out = [next(loader).flatten().tolist() for _ in range(8)]
        loader.close()
        return out, loader.mode

    fast, fast_mode = batches(data)
    slow, slow_mode = batches(Slow(data))
    never, never_mode = batches(data, prefetch=0)
    assert (fast_mode, slow_mode, never_mode) == ("inline", "thread", "inline")
    assert fast == slow == never and sorted(sum(fast[:6], [])) == list(range(24))
