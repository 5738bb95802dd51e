"""trainyard/sdk/procexit.py: a user's SDK script that ends normally gives torch's gloo worker threads
time to drop their last references before interpreter finalization (the at-exit SIGABRT it prevents
is a race, ~1 run in 17 of a 2-rank FSDP/TP script: measured in the module's docstring, not here)."""
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.procs

SCRIPT = r"""
import atexit, json
registered = []
real = atexit.register
def spy(fn, *args, **kwargs):
    registered.append([getattr(fn, "__module__", None), getattr(fn, "__name__", None), list(args)])
    return real(fn, *args, **kwargs)
atexit.register = spy
import torch
import torch.distributed as dist
from trainyard.sdk.run import DistEnv, init_process_group
assert init_process_group(DistEnv.standalone(), torch.device("cpu")) is True
t = torch.ones(4)
dist.all_reduce(t)
dist.destroy_process_group()
assert init_process_group(DistEnv.standalone(), torch.device("cpu")) is True  # a second run in one process
dist.destroy_process_group()
print(json.dumps([r for r in registered if r[1] == "sleep"]))
"""


def test_the_sdks_gloo_group_has_the_script_wait_briefly_before_finalization_once():
    from trainyard.sdk.procexit import SETTLE_S

    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [["time", "sleep", [SETTLE_S]]]  # once, however many groups it made
    assert SETTLE_S >= 0.1
