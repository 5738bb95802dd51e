"""Table-driven tests of failure classification."""
import pytest

from jobs.policy.diagnosis import diagnose


def rep(node, *failures, exit_code=1, signal=None):
    return {"node": node, "exit_code": exit_code, "signal": signal, "failures": list(failures)}


def f(rank, ts, message, tb="Traceback (most recent call last): ...", signal=None):
    return {"rank": rank, "timestamp": ts, "message": message, "traceback": tb, "signal": signal}


CASES = [
    ("earliest rank is the cause, not the survivors' comm errors",
     [rep("a", f(0, 5.0, "RuntimeError: Connection closed by peer")), rep("b", f(1, 2.0, "ValueError: bad shape"))],
     None, "user_error", False, 1),
    ("runtime config error is a user error",
     [rep("a", f(0, 1.0, "ConfigError: token file has id 300 >= model.vocab=256"))], None, "user_error", False, 0),
    ("CUDA OOM is not blindly retried",
     [rep("a", f(1, 1.0, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"))],
     None, "oom", False, 1),
    ("rank killed by a signal is retried",
     [rep("a", f(0, 1.0, "Signal 9 (SIGKILL) received", tb="", signal="SIGKILL"))], None, "signal", True, 0),
    ("collective timeout is retried",
     [rep("a", f(0, 1.0, "torch.distributed.DistNetworkError: timed out"))], None, "comm", True, 0),
    ("a lost node beats every other evidence",
     [rep("a", f(0, 1.0, "RuntimeError: Connection closed by peer"))], "b", "lost", True, None),
    ("no error file at all", [rep("a", exit_code=1)], None, "unknown", True, None),
    ("torchrun itself killed", [rep("a", exit_code=-9, signal="SIGKILL")], None, "signal", True, None),
]


@pytest.mark.parametrize("desc,reports,lost,cls,retry,rank", CASES, ids=[c[0] for c in CASES])
def test_diagnose(desc, reports, lost, cls, retry, rank):
    d = diagnose(reports, node_lost=lost)
    assert (d.failure_class, d.retry, d.rank) == (cls, retry, rank)
