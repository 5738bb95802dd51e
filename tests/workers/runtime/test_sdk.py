"""The SDK (trainyard.sdk) in this process, without torchrun: standalone mode, the sample a
`log` makes, phase timing, when to checkpoint, a checkpoint and restore round trip."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trainyard
from tests.conftest import REPO
from trainyard.sdk import PHASES, STANDARD_FIELDS, ConfigError
from trainyard.sdk.config import RUN_CONFIG_ENV, load_launch_config, parse_launch_config
from trainyard.sdk.run import DistEnv, Run

from .conftest import make_launch_config


@pytest.fixture
def standalone(tmp_path, monkeypatch):
    """trainyard.init() as in a plain `python train.py` run in tmp_path."""
    for name in (RUN_CONFIG_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert not dist.is_initialized()
    run = trainyard.init()
    yield run
    run.finish()
    assert not dist.is_initialized()


def test_importing_every_trainyard_module_but_the_sdks_torch_modules_loads_no_torch():
    code = ("import importlib, json, pkgutil, sys, trainyard\n"
            "names = [m.name for m in pkgutil.walk_packages(trainyard.__path__, 'trainyard.')\n"
            "         if m.name not in ('trainyard.sdk.run', 'trainyard.sdk.checkpoint',\n"
            "                      'trainyard.sdk.staging', 'trainyard.sdk.safeload', 'trainyard.sdk.comm',\n"
            "                      'trainyard.sdk.sync', 'trainyard.sdk.autoratio', 'trainyard.sdk.optim',\n"
            "                      'trainyard.sdk.prepare', 'trainyard.sdk.loader', 'trainyard.sdk.stopvote',\n"
            "                      'trainyard.sdk.tensorpar', 'trainyard.sdk.metainit', 'trainyard.sdk.heal')]\n"
            "for name in names: importlib.import_module(name)\n"
            "print(json.dumps(names))\n"
            "sys.exit(1 if {'torch', 'numpy'} & set(sys.modules) else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert {"trainyard.spec", "trainyard.sdk", "trainyard.sdk.config", "trainyard.sdk.reporter"} <= set(json.loads(r.stdout))


def test_standalone_init_is_rank_0_of_1_with_local_checkpoints(standalone, tmp_path):
    run = standalone
    assert (run.rank, run.local_rank, run.world_size) == (0, 0, 1)
    assert run.device == torch.device("cpu") and run.config == {}
    assert (run.job_id, run.attempt_id, run.steps) == (None, None, None)
    assert dist.is_initialized() and dist.get_world_size() == 1
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert run.restore({"model": model, "optim": opt}) == 0  # nothing saved yet
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    run.checkpoint(3, {"model": model, "optim": opt, "epoch": 1})
    opt.step()  # waits for the save's copy of the state (the optimizer's pre-hook), then changes it
    run.finish()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003-a0"]
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000003-a0" / "trainyard.json").read_text())
    assert (manifest["step"], manifest["job_id"], manifest["world_size"]) == (3, None, 1)

    again = trainyard.init()  # a second run in the same directory resumes from the newest one
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = {"model": fresh, "optim": fresh_opt, "epoch": 0}
    assert again.restore(state) == 3
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    assert state["epoch"] == 1 and len(fresh_opt.state) == 2  # exp_avg etc. of weight and bias
    again.finish()


def test_log_makes_one_sample_with_standard_fields_from_phases_and_user_metrics_apart(standalone):
    run = standalone
    with run.phase("data"):
        time.sleep(0.02)
    with run.phase("compute"):
        time.sleep(0.05)
    with run.phase("compute"):  # a phase may be entered several times a step: the times add up
        time.sleep(0.01)
    sample = run.log(1, loss=2.5, samples=32, acc=0.75, tokens_per_s=99.0)
    assert set(sample) == {"rank", "step", "ts", "attempt", "loss", "step_s", "samples_per_s",
                           "mem_bytes", "tokens_per_s", "metrics", "data_s", "compute_s", "comm_s", "optim_s"}
    assert (sample["rank"], sample["step"], sample["attempt"], sample["loss"]) == (0, 1, None, 2.5)
    assert sample["metrics"] == {"acc": 0.75} and sample["tokens_per_s"] == 99.0
    assert 0.02 <= sample["data_s"] < 0.2 and 0.06 <= sample["compute_s"] < 0.3
    assert sample["comm_s"] == 0.0 and sample["optim_s"] == 0.0
    # the first step is timed from its first phase; samples_per_s = samples / step_s
    assert sample["data_s"] + sample["compute_s"] <= sample["step_s"] < 0.5
    assert sample["samples_per_s"] == pytest.approx(32 / sample["step_s"])
    assert sample["mem_bytes"] > 10_000_000 and abs(sample["ts"] - time.time()) < 5
    time.sleep(0.03)
    second = run.log(2, loss=2.0)  # no phases this step: no phase fields; step_s since the last log
    assert "data_s" not in second and "metrics" not in second and "samples_per_s" not in second
    assert 0.03 <= second["step_s"] < 0.3
    assert set(STANDARD_FIELDS) >= {"loss", "step_s", "data_s", "compute_s", "comm_s", "optim_s"}
    with pytest.raises(ValueError, match="'forward' is not one of data, compute, comm, optim"):
        run.phase("forward")
    with pytest.raises(TypeError, match="metric 'name' must be a number"):
        run.log(3, name="x")
    assert PHASES == ("data", "compute", "comm", "optim")


def _launched_run(tmp_path, **sections) -> Run:
    """A Run built from a launch config, rank 0 of 1, without Redis (telemetry goes nowhere)."""
    launch = parse_launch_config(make_launch_config(tmp_path, "redis://127.0.0.1:1/0", **sections))
    return Run(env=DistEnv.standalone(), device=torch.device("cpu"), launch=launch, spec=launch.job_spec())


def test_should_checkpoint_every_steps_the_last_step_and_never_twice(tmp_path, monkeypatch):
    for name in ("MASTER_ADDR",):
        monkeypatch.delenv(name, raising=False)
    from trainyard.sdk.run import init_process_group

    assert init_process_group(DistEnv.standalone(), torch.device("cpu"))
    try:
        run = _launched_run(tmp_path, train={"steps": 12}, checkpoint={"every_steps": 5})
        assert (run.job_id, run.attempt_id, run.steps, run.every_steps) == (7, 9, 12, 5)
        assert [s for s in range(1, 13) if run.should_checkpoint(s)] == [5, 10, 12]
        model = torch.nn.Linear(2, 2)
        run.checkpoint(5, {"model": model})
        assert not run.should_checkpoint(5)  # saved already
        assert not run.should_stop()
        run._reporter.preempt_requested.set()  # what the reporter thread sets on a request
        assert run.should_checkpoint(7) and run.should_stop() and run.stop_step == 7
        assert run.should_stop()  # stays agreed
        with pytest.raises(trainyard.sdk.Preempted) as exc:
            run.finish()
        assert exc.value.code == 83 and exc.value.step == 7
    finally:
        dist.destroy_process_group()


def test_the_launch_config_names_a_bad_key_and_the_variable_names_the_file(tmp_path, monkeypatch):
    raw = make_launch_config(tmp_path, "redis://x:1/0", config={"lr": 0.1})
    assert parse_launch_config(raw).spec["config"] == {"lr": 0.1}
    with pytest.raises(ConfigError, match="launch config is missing key 'stream'"):
        parse_launch_config({k: v for k, v in raw.items() if k != "stream"})
    with pytest.raises(ConfigError, match="launch config job_id: Input should be a valid integer"):
        parse_launch_config({**raw, "job_id": "seven"})
    monkeypatch.delenv(RUN_CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match="TRAINYARD_RUN_CONFIG is not set"):
        load_launch_config()
    monkeypatch.setenv(RUN_CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read the launch config .*missing.json"):
        load_launch_config()


class Counter:
    """A Stateful object (state_dict / load_state_dict), as a data loader's position would be."""

    def __init__(self, n: int = 0):
        self.n = n

    def state_dict(self) -> dict:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


def test_a_state_of_two_models_their_optimizers_and_a_stateful_object_round_trips(standalone):
    run = standalone
    gen, disc = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    g_opt, d_opt = torch.optim.Adam(gen.parameters()), torch.optim.SGD(disc.parameters(), lr=0.1, momentum=0.9)
    disc(gen(torch.ones(2, 3))).sum().backward()
    g_opt.step()
    d_opt.step()
    state = {"gen": gen, "disc": disc, "g_opt": g_opt, "d_opt": d_opt, "counter": Counter(41)}
    run.checkpoint(8, state)
    want = {k: v.clone() for k, v in {**gen.state_dict(), **{"d." + n: t for n, t in disc.state_dict().items()}}.items()}
    momentum = d_opt.state[disc.weight]["momentum_buffer"].clone()
    run.finish()

    again = trainyard.init()
    gen2, disc2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    state2 = {"gen": gen2, "disc": disc2, "g_opt": torch.optim.Adam(gen2.parameters()),
              "d_opt": torch.optim.SGD(disc2.parameters(), lr=0.1, momentum=0.9), "counter": Counter()}
    assert again.restore(state2) == 8
    got = {**gen2.state_dict(), **{"d." + n: t for n, t in disc2.state_dict().items()}}
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(state2["d_opt"].state[disc2.weight]["momentum_buffer"], momentum)
    assert state2["counter"].n == 41
    with pytest.raises(ValueError, match="optimizer 'opt' needs exactly one module in the same mapping"):
        again.checkpoint(9, {"a": torch.nn.Linear(1, 1), "b": torch.nn.Linear(1, 1),
                             "opt": torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)})
    assert not again.should_checkpoint(8) and again.should_checkpoint(50)  # nothing was started for 9
    again.finish()
    assert sorted(p.name for p in (Path.cwd() / "checkpoints").iterdir()) == ["step-00000008-a0"]


def test_an_entrypoint_jobs_launch_config_gives_the_run_its_config_and_is_not_the_built_in_trainers(
        tmp_path, monkeypatch):
    from trainyard.sdk.run import init_process_group
    from workers.runtime.config import parse_run_config

    raw = make_launch_config(tmp_path, "redis://x:1/0", model=None, data=None,
                             entrypoint={"script": "/opt/code/train.py"}, config={"lr": 0.1, "layers": 6},
                             train={"steps": 40})
    launch = parse_launch_config(raw)
    assert launch.job_spec().user_code and launch.job_spec().model is None
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert init_process_group(DistEnv.standalone(), torch.device("cpu"))
    try:
        run = Run(env=DistEnv.standalone(), device=torch.device("cpu"), launch=launch, spec=launch.job_spec())
        assert (run.config, run.steps, run.job_id, run.attempt_id) == ({"lr": 0.1, "layers": 6}, 40, 7, 9)
        run.finish()
    finally:
        dist.destroy_process_group()
    with pytest.raises(ConfigError, match="the built-in trainer needs the spec's model and data"):
        parse_run_config(raw)
