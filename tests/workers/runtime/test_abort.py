"""A rank that raises while its peers wait in a collective: real torchrun, 2 gloo ranks.

The failing rank must write its error file (@record), abort its process group rather than
destroy it and exit non-zero at once; torchrun then stops the peer and the run ends instead of
hanging. On NCCL destroy_process_group blocks while a peer sits in a collective; gloo's does
not, so the ranks run under tests/workers/runtime/nccl_destroy_main.py, whose destroy blocks as NCCL's.
"""
import json
import time

import pytest

from workers.runtime import chaos as chaos_mod

from .conftest import SMALL_MODEL, make_launch_config, start_torchrun, write_launch_config
from .test_torchrun import Output, wait_for

pytestmark = pytest.mark.procs

RAISE_AT = 3
PROMPT_S = 20  # from the raise to the whole torchrun's end; a hang lasts the gloo timeout (30 min)


@pytest.mark.timeout(150)
def test_a_rank_that_raises_mid_training_writes_its_error_and_the_run_ends(
        tmp_path, redis_server, repo_env):
    chaos_dir = tmp_path / "chaos"
    chaos_dir.mkdir()
    (chaos_dir / "job-7.json").write_text(json.dumps({"raise_at_step": RAISE_AT, "raise_rank": 1}))
    cfg = make_launch_config(tmp_path, redis_server.url, model=SMALL_MODEL,
                             train={"steps": 10_000, "global_batch": 16})
    logs = tmp_path / "logs"
    proc = start_torchrun(write_launch_config(tmp_path, cfg), {**repo_env, chaos_mod.ENV: str(chaos_dir)},
                          log_dir=logs, module="tests.workers.runtime.nccl_destroy_main")
    out = Output(proc)
    try:
        wait_for(lambda: proc.poll() is not None or any("chaos: raising" in line for line in out.lines),
                 90, "rank 1's raise")
        raised = time.monotonic()
        wait_for(lambda: proc.poll() is not None, PROMPT_S, "torchrun to end after rank 1 raised")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = out.text()
    assert f"rank 1 chaos: raising after step {RAISE_AT}" in text, text
    assert proc.returncode != 0, text
    assert time.monotonic() - raised < PROMPT_S
    # torchrun gives each worker TORCHELASTIC_ERROR_FILE=<log-dir>/<run>/attempt_0/<local rank>/error.json
    [error_file] = logs.glob("*/attempt_0/1/error.json")
    message = json.loads(error_file.read_text())["message"]["message"]
    assert "ChaosError" in message and f"rank 1 raised after step {RAISE_AT}" in message, message
    assert "destroy_process_group: blocking" not in text, text
