"""Issue 14 finding 5: every launch carries a collective timeout under the hang detector's, so a
collective stuck on a missing peer fails its rank with a real error before the attempt is
stopped as hung."""
import pytest
from django.conf import settings

from jobs.attempts.policy import diagnosis
from tests.jobs.runs.test_services import start, submit
from trainyard.launch import Launch
from trainyard.sdk.config import parse_launch_config

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("hang", [120.0, "auto", 6.0])
def test_each_launch_carries_a_collective_timeout_under_the_hang_timeout(user, nodes, sent, hang,
                                                                         django_capture_on_commit_callbacks):
    job = submit(user, hang_timeout_s=hang)
    with django_capture_on_commit_callbacks(execute=True):
        start(job)
    launches = [Launch.model_validate(c[2]) for c in sent if c[0] == "launch"]
    assert len(launches) == 2
    floor = settings.TRAINYARD_HANG_FLOOR_S
    expected = {120.0: 96.0, "auto": min(0.8 * floor, floor - 15)}.get(hang)
    for launch in launches:
        if expected is None:  # 6 s leaves no room to report a timeout first: the detector handles it
            assert launch.collective_timeout_s is None
            continue
        assert launch.collective_timeout_s == pytest.approx(expected)
        for recent in ([], [0.1] * 5, [30.0] * 5):  # whatever the steps, the detector waits longer
            check = diagnosis.hang_check(now=0, started=0, last_progress=0, spec_timeout=hang,
                                         recent_step_s=recent, floor_s=floor)
            assert launch.collective_timeout_s + diagnosis.COLLECTIVE_REPORT_MARGIN_S <= check.timeout_s


GLOO_TIMEOUT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                "45000ms for recv operation to complete")
NCCL_WATCHDOG = ("[rank0]:[E1201 10:00:00.000000000 ProcessGroupNCCL.cpp:685] [Rank 0] Watchdog caught collective "
                 "operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1024, NumelOut=1024, "
                 "Timeout(ms)=45000) ran for 45012 milliseconds before timing out.")


@pytest.mark.parametrize("report", [
    {"node": "node-a", "failures": [{"rank": 0, "timestamp": 1.0, "message": GLOO_TIMEOUT, "traceback": "tb"}]},
    {"node": "node-a", "failures": [{"rank": 0, "timestamp": 1.0, "signal": "SIGABRT", "message": "Signal 6"}],
     "log_tail": {"0": ["step 30", NCCL_WATCHDOG, "Aborted"]}},
])
def test_a_timed_out_collective_is_the_hang_and_not_the_waiting_nodes_fault(report):
    d = diagnosis.diagnose([report, {"node": "node-b", "failures": []}])
    assert (d.failure_class, d.retry, d.node) == ("hang", True, None), d
    assert d.failure_class not in diagnosis.NODE_FAULT_CLASSES and "timed out waiting in a collective" in d.message
    assert d.message.startswith("rank 0")
    oom = {**report, "log_tail": {"0": [NCCL_WATCHDOG + " Cuda failure 'out of memory'"]}} if "log_tail" in report \
        else {"node": "node-a", "failures": [{"rank": 0, "timestamp": 1.0,
                                              "message": GLOO_TIMEOUT + " CUDA out of memory"}]}
    assert diagnosis.diagnose([oom]).failure_class == "oom"  # what a timeout wraps still decides first


def test_the_ranks_launch_config_reads_it_and_an_older_agents_config_has_none(tmp_path):
    raw = {"job_id": 1, "attempt_id": 2, "node": "n", "run_dir": str(tmp_path), "redis_url": "redis://x",
           "stream": "s", "data_root": str(tmp_path), "checkpoint_dir": str(tmp_path), "spec": {}}
    assert parse_launch_config(raw).collective_timeout_s is None
    assert parse_launch_config({**raw, "collective_timeout_s": 48.0}).collective_timeout_s == 48.0
