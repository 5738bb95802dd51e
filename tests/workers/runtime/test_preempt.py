"""Cooperative preemption with real torchrun (2 gloo ranks) and a real Redis: the control plane's
request key makes every rank stop after the same step, publish a checkpoint of that step and exit
with PREEMPTED_EXIT_CODE."""
import json
import time
from pathlib import Path

import pytest
import redis

from trainyard.keys import preempt_key
from trainyard.sdk.preempt import PREEMPTED_EXIT_CODE

from .conftest import SMALL_MODEL, make_launch_config, read_stream, start_torchrun, write_launch_config
from .test_torchrun import Output, wait_for

pytestmark = pytest.mark.procs


def test_preemption_request_checkpoints_the_same_step_on_every_rank_and_exits_83(tmp_path, redis_server, repo_env):
    cfg = make_launch_config(tmp_path, redis_server.url, model=SMALL_MODEL,
                             train={"steps": 100000, "global_batch": 8}, checkpoint={"every_steps": 1000})
    proc = start_torchrun(write_launch_config(tmp_path, cfg), repo_env)
    out = Output(proc)
    try:
        wait_for(lambda: out.last_step(0) >= 1 and out.last_step(1) >= 1, 120, "training to start")
        time.sleep(1.0)
        redis.Redis.from_url(redis_server.url).set(preempt_key(cfg["attempt_id"]), json.dumps({"reason": "test"}))
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.text()
    assert code != 0, text  # torchrun reports its workers' failure
    stopped = [line for line in text.splitlines() if " preempted after step " in line]
    assert len(stopped) == 2, text
    steps = {int(line.split("preempted after step ")[1].split(":")[0]) for line in stopped}
    assert len(steps) == 1, stopped  # both ranks agreed on the step
    step = steps.pop()
    assert f"exiting with {PREEMPTED_EXIT_CODE}" in stopped[0]
    _, events, _ = read_stream(redis_server.url, cfg["stream"])
    ckpt = [e for e in events if e["kind"] == "checkpoint"]
    assert [e["step"] for e in ckpt] == [step], events
    assert Path(ckpt[0]["path"], "trainyard.json").is_file()
    assert [e["step"] for e in events if e["kind"] == "preempted_exit"] == [step]
    # the ranks' own exit codes, as torchrun saw them
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in text or f"exit code {PREEMPTED_EXIT_CODE}" in text or \
        f"exitcode       : {PREEMPTED_EXIT_CODE}" in text, text[-3000:]
