"""The warm launcher (workers/warmrun.py): which launches use it, that torchrun's own parser takes its
arguments, and that it runs nothing but the built-in runtime. The forked ranks themselves run in
tests/integration/test_recovery_fast.py (a real cluster, a SIGKILLed rank)."""
from __future__ import annotations

import dataclasses
import signal
import sys

import pytest

from workers import launch_spec, warmrun
from workers.launch_spec import LaunchRequest


def request(**kw) -> LaunchRequest:
    return LaunchRequest(job_id=7, attempt_id=3, node="node-a", node_rank=0, nnodes=2, nproc=2, slots=(0, 1),
                         device="cpu", rdzv_host="127.0.0.1", rdzv_port=29400, local_addr="127.0.0.1",
                         config={}, run_dir="/r", **kw)


def test_the_built_in_runtime_starts_under_the_warm_launcher_with_torchruns_own_arguments():
    from torch.distributed.run import get_args_parser

    argv = launch_spec.build_argv(request(), "/r/config.json", "/r/logs")
    assert argv[:3] == [sys.executable, "-m", "workers.warmrun"]
    args = get_args_parser().parse_args(argv[3:])  # what warmrun hands to torchrun's parse_args
    assert args.module and args.training_script == warmrun.MODULE
    assert args.training_script_args == ["--config", "/r/config.json"]
    assert args.rdzv_id == "attempt-3" and args.max_restarts == 0 and args.nproc_per_node == "2"


@pytest.mark.parametrize("change", [
    {"warm": False},  # TRAINYARD_WARM_RANKS=0 on the agent
    {"user_code": True, "script": "/code/train.py", "code_dir": "/code"},  # user code: its own interpreter
    {"module": "tests.launcher_fixtures.fake_worker"},  # anything but the runtime
])
def test_everything_else_starts_under_plain_torchrun(change):
    argv = launch_spec.build_argv(dataclasses.replace(request(), **change), "/r/config.json", "/r/logs")
    assert argv[1:3] == ["-m", "torch.distributed.run"]


def test_the_agent_setting():
    assert launch_spec.warm_ranks({}) is True
    assert launch_spec.warm_ranks({launch_spec.WARM_VAR: "1"}) is True
    assert launch_spec.warm_ranks({launch_spec.WARM_VAR: "0"}) is False


@pytest.mark.parametrize("entry", [["-m", "tests.launcher_fixtures.fake_worker"], ["/tmp/train.py"],
                                   ["--run-path", "/tmp/train.py"]])
def test_the_warm_launcher_runs_nothing_but_the_runtime(entry):
    with pytest.raises(SystemExit, match="runs only `-m workers.runtime`"):
        warmrun.main(["--nnodes", "1", "--nproc-per-node", "1", *entry, "--config", "/r/config.json"])


def test_a_forked_rank_dies_of_a_stop_signal_as_a_fresh_interpreter_would(monkeypatch):
    """torchrun's parent turns SIGTERM into an exception; the fork restores the defaults first."""
    import workers.runtime.__main__ as runtime_main

    seen = {}
    monkeypatch.setattr(runtime_main, "main", lambda argv: seen.update(
        argv=argv, handlers={s: signal.getsignal(s) for s in warmrun.PARENT_SIGNALS}))
    old = {s: signal.signal(s, lambda *_: None) for s in warmrun.PARENT_SIGNALS}
    try:
        warmrun.rank_main("--config", "/r/config.json")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert seen["argv"] == ["--config", "/r/config.json"]
    assert set(seen["handlers"].values()) == {signal.SIG_DFL}
