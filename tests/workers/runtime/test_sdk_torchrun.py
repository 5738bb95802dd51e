"""The SDK under real torchrun (2 gloo ranks) with a real Redis: tests/workers/runtime/sdk_script.py, a
small DDP script with the SDK lines, reports every step of every rank to the job's stream,
checkpoints, resumes with every step once and the losses of an uninterrupted run, and stops
cooperatively when preempted (the ranks agree on the step, save it, exit 83)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.conftest import REPO, RedisServer
from trainyard.keys import preempt_key
from trainyard.sdk import PREEMPTED_EXIT_CODE, RUN_CONFIG_ENV

from .conftest import make_launch_config, read_stream, write_launch_config
from .test_torchrun import Output, wait_for

pytestmark = pytest.mark.procs

SCRIPT = REPO / "tests" / "workers" / "runtime" / "sdk_script.py"
STEPS, EVERY = 12, 5


def _config(tmp_path: Path, url: str, job_id: int, attempt_id: int, *, steps: int = STEPS,
            resume: dict | None = None, **config) -> dict:
    cfg = make_launch_config(tmp_path, url, model=None, data=None, entrypoint={"script": str(SCRIPT)},
                             train={"steps": steps}, checkpoint={"every_steps": EVERY}, config=config)
    cfg.update(job_id=job_id, attempt_id=attempt_id, stream=f"trainyard:job:{job_id}",
               checkpoint_dir=str(tmp_path.parent / f"ckpt-{job_id}"), resume=resume)
    return cfg


def _start(tmp_path: Path, cfg: dict, env: dict) -> tuple[subprocess.Popen, Output]:
    env = {**env, RUN_CONFIG_ENV: str(write_launch_config(tmp_path, cfg))}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", str(SCRIPT)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, Output(proc)


def _losses(text: str) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss from the script's `sdk rank r step s loss x` lines."""
    return {(int(m[1]), int(m[2])): float(m[3])
            for m in re.finditer(r"^sdk rank (\d+) step (\d+) loss (\S+)$", text, re.MULTILINE)}


def _last_step(out: Output) -> int:
    return max((s for (_, s) in _losses("\n".join(out.lines))), default=0)


@pytest.fixture(scope="module")
def redis_server_module(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def repo_env_module():
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, redis_server_module, repo_env_module):
    """An uninterrupted run of the script: (config, samples, events, losses)."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = _config(tmp, redis_server_module.url, job_id=30, attempt_id=1)
    proc, out = _start(tmp, cfg, repo_env_module)
    assert proc.wait(120) == 0, out.text()
    samples, events, _ = read_stream(redis_server_module.url, cfg["stream"])
    return cfg, samples, events, _losses(out.text())


def test_every_rank_reports_every_step_with_phases_and_metrics_and_each_checkpoint_once(reference):
    cfg, samples, events, losses = reference
    assert sorted((s["rank"], s["step"]) for s in samples) == [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]
    for s in samples:
        assert s["attempt"] == 1 and s["metrics"] == {"lr": 0.01}
        assert s["loss"] == losses[s["rank"], s["step"]]
        assert {"data_s", "compute_s", "comm_s", "optim_s", "step_s", "samples_per_s", "mem_bytes", "ts"} <= set(s)
        assert 0 < s["compute_s"] < s["step_s"] and s["samples_per_s"] == pytest.approx(8 / s["step_s"])
    kinds = [e["kind"] for e in events]
    assert kinds.count("rank_started") == 2
    ckpt = [e for e in events if e["kind"] == "checkpoint"]
    assert [e["step"] for e in ckpt] == [5, 10, 12]  # every_steps and the last step, once each
    for e in ckpt:
        manifest = json.loads(Path(e["path"], "trainyard.json").read_text())
        assert (manifest["job_id"], manifest["attempt_id"], manifest["step"], manifest["world_size"]) == \
            (30, 1, e["step"], 2)
    ranks = sorted(json.loads(p.read_text())["rank"] for p in Path(cfg["run_dir"], "ranks").glob("*.json"))
    assert ranks == [0, 1]


def test_preempted_ranks_agree_save_exit_83_and_the_next_attempt_resumes_every_step_once(
        tmp_path, reference, redis_server_module, repo_env_module):
    url = redis_server_module.url
    _, _, _, ref_losses = reference
    cfg = _config(tmp_path / "a", url, job_id=31, attempt_id=1, steps=60, sleep_s=0.1)
    proc, out = _start(tmp_path / "a", cfg, repo_env_module)
    try:
        wait_for(lambda: _last_step(out) >= 2 or proc.poll() is not None, 120, "training to start")
        redis.Redis.from_url(url).set(preempt_key(1), json.dumps({"reason": "test", "grace_s": 30}))
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.text()
    assert code != 0, text
    stopped = [line for line in text.splitlines() if " preempted after step " in line]
    assert len(stopped) == 2, text
    steps = {int(line.split("preempted after step ")[1].split(":")[0]) for line in stopped}
    assert len(steps) == 1, stopped  # both ranks agreed on the step
    stop = steps.pop()
    assert 2 <= stop < 60 and f"exiting with {PREEMPTED_EXIT_CODE}" in stopped[0]
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in text or f"exitcode       : {PREEMPTED_EXIT_CODE}" in text, text[-3000:]
    _, events, _ = read_stream(url, cfg["stream"])
    ckpt = [e for e in events if e["kind"] == "checkpoint"]
    assert ckpt[-1]["step"] == stop and [e["step"] for e in ckpt] == sorted({*range(EVERY, stop + 1, EVERY), stop})
    assert [e["step"] for e in events if e["kind"] == "preempted_exit"] == [stop]
    first = _losses(text)

    resume = {"path": ckpt[-1]["path"], "step": stop, "checkpoint_id": 1}
    cfg2 = _config(tmp_path / "b", url, job_id=31, attempt_id=2, steps=60, resume=resume)
    proc2, out2 = _start(tmp_path / "b", cfg2, repo_env_module)
    assert proc2.wait(120) == 0, out2.text()
    second = _losses(out2.text())
    # every step once: the first attempt ran 1..stop, the second stop+1..60
    assert sorted({s for _, s in first}) == list(range(1, stop + 1))
    assert sorted({s for _, s in second}) == list(range(stop + 1, 61))
    # ... and the resumed losses are an uninterrupted run's, bit for bit (the reference ran 12 steps)
    for (rank, step), loss in second.items():
        if step <= STEPS:
            assert loss == ref_losses[rank, step], (rank, step)
    for (rank, step), loss in first.items():
        if step <= STEPS:
            assert loss == ref_losses[rank, step], (rank, step)
    samples, events2, _ = read_stream(url, cfg2["stream"])
    resumed = [e for e in events2 if e["kind"] == "resumed"]
    assert [(e["step"], e["path"]) for e in resumed] == [(stop, ckpt[-1]["path"])]
    assert sorted({s["step"] for s in samples if s["attempt"] == 2}) == list(range(stop + 1, 61))
