"""Table-driven tests of failure classification."""
import pytest

from jobs.attempts.policy.diagnosis import diagnose


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


def test_sigkill_with_memory_near_the_limit_is_oom_and_not_retried():
    reports = [rep("a", f(0, 1.0, "Signal 9 (SIGKILL) received", tb="", signal="SIGKILL"))]
    d = diagnose(reports, node_mem_percent={"a": 97.0})
    assert (d.failure_class, d.retry) == ("oom", False) and "micro-batch" in d.suggestion
    assert diagnose(reports, node_mem_percent={"a": 40.0}).failure_class == "signal"


def test_rendezvous_timeout_excludes_the_node_that_never_joined():
    reports = [rep("a", f(0, 1.0, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: timed out")),
               rep("b")]
    d = diagnose(reports, not_joined=("b",))
    assert (d.failure_class, d.retry, d.exclude, d.node) == ("comm", True, ("b",), "b")


# ---------------------------------------------------------------- hangs

from jobs.attempts.policy.diagnosis import STARTUP_GRACE_S, hang_check, hang_timeout, stragglers  # noqa: E402

HANG_CASES = [
    # desc, spec, recent step_s, floor, expected (timeout, source)
    ("explicit seconds win", 30, [0.1] * 5, 60, (30.0, "spec")),
    ("auto: floor for fast steps", "auto", [0.1] * 5, 60, (60.0, "auto")),
    ("auto: 10x a slow median step", "auto", [9.0, 10.0, 11.0], 60, (100.0, "auto")),
    ("auto with no samples yet", "auto", [], 60, (60.0, "auto")),
]


@pytest.mark.parametrize("desc,spec,recent,floor,expected", HANG_CASES, ids=[c[0] for c in HANG_CASES])
def test_hang_timeout(desc, spec, recent, floor, expected):
    assert hang_timeout(spec, recent, floor) == expected


def test_hang_check_idle_since_last_progress_and_startup_grace():
    assert hang_check(now=100, started=0, last_progress=80, spec_timeout=10, recent_step_s=[], floor_s=60).hung
    assert not hang_check(now=100, started=0, last_progress=95, spec_timeout=10, recent_step_s=[], floor_s=60).hung
    # before the first step, loading a checkpoint and the rendezvous get STARTUP_GRACE_S
    c = hang_check(now=100, started=0, last_progress=None, spec_timeout=10, recent_step_s=[], floor_s=60)
    assert not c.hung and c.timeout_s == STARTUP_GRACE_S
    assert hang_check(now=STARTUP_GRACE_S + 1, started=0, last_progress=None, spec_timeout=10,
                      recent_step_s=[], floor_s=60).hung


# ---------------------------------------------------------------- stragglers

STRAGGLER_CASES = [
    ("even ranks: none", {0: [0.10] * 12, 1: [0.10] * 12}, frozenset(), []),
    ("rank 1 50% slower", {0: [0.10] * 12, 1: [0.15] * 12}, frozenset(), [1]),
    ("19% slower is not flagged", {0: [0.10] * 12, 1: [0.119] * 12}, frozenset(), []),
    ("flagged stays flagged above the clear threshold", {0: [0.10] * 12, 1: [0.115] * 12}, frozenset({1}), [1]),
    ("flagged clears below it", {0: [0.10] * 12, 1: [0.105] * 12}, frozenset({1}), []),
    ("too few steps to say", {0: [0.10] * 5, 1: [0.5] * 5}, frozenset(), []),
    ("one slow spike is not persistent", {0: [0.10] * 12, 1: [0.10] * 11 + [5.0]}, frozenset(), []),
    ("four ranks, one slow", {r: [0.10] * 12 for r in range(3)} | {3: [0.2] * 12}, frozenset(), [3]),
    ("single rank: no peers", {0: [0.10] * 12}, frozenset(), []),
    ("30% of a 20 ms step is scheduler noise", {0: [0.020] * 12, 1: [0.026] * 12}, frozenset(), []),
]


@pytest.mark.parametrize("desc,work,flagged,expected", STRAGGLER_CASES, ids=[c[0] for c in STRAGGLER_CASES])
def test_stragglers(desc, work, flagged, expected):
    assert [s.rank for s in stragglers(work, flagged)] == expected
