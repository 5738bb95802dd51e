"""Standby launchers (workers/standby.py) without processes: the uid range, what a launch must match,
the in-place hand-over files, expiry, and the warm launcher's wait for its hand-over. A standby taking
a real restart runs in tests/integration/test_recovery_fast.py."""
from __future__ import annotations

import json
import os
import threading
import time

import psutil
import pytest

from workers import sandbox, standby, warmrun
from workers.launch_spec import LaunchRequest


def request(**kw) -> LaunchRequest:
    fields = dict(job_id=7, attempt_id=3, node="node-a", node_rank=0, nnodes=2, nproc=1, slots=(0,), device="cpu",
                  rdzv_host="127.0.0.1", rdzv_port=29400, local_addr="127.0.0.1", config={}, run_dir="/r")
    return LaunchRequest(**{**fields, **kw})


def test_a_standby_uid_is_from_the_top_of_the_range_never_an_attempts_and_never_one_in_use():
    cfg = sandbox.SandboxConfig(uid_base=1_000_000, id_range=100_000)
    top = cfg.uid_base + cfg.id_range - 1
    uid = standby.standby_uid(cfg, set())
    assert top - standby.STANDBY_IDS < uid <= top
    assert uid not in {cfg.ids(7, a)[0] for a in range(1, 90_000)}  # attempt ids far below the range's top
    taken = {top - k for k in range(standby.STANDBY_IDS - 1)}
    assert standby.standby_uid(cfg, taken) == top - standby.STANDBY_IDS + 1  # the only one left
    assert standby.standby_uid(cfg, taken | {top - standby.STANDBY_IDS + 1}) is None
    mine = os.getuid()  # a uid a live process holds is never handed out
    live = sandbox.SandboxConfig(uid_base=mine - 99_999, id_range=100_000)
    assert all(standby.standby_uid(live, set()) != mine for _ in range(50))
    assert standby.standby_uid(sandbox.SandboxConfig(id_range=2 * standby.STANDBY_IDS), set()) is None


def test_a_launch_takes_a_standby_only_on_the_same_slots_device_interpreter_and_cores():
    base = standby.fits(request())
    assert standby.fits(request(attempt_id=9, rdzv_port=1234, node_rank=1)) == base
    for change in ({"slots": (1,)}, {"device": "cuda"}, {"python": "/opt/env/bin/python"}, {"cores_per_slot": 2}):
        assert standby.fits(request(**change)) != base, change


def test_the_hand_over_rewrites_the_bound_files_in_place(tmp_path):
    path = tmp_path / "go.json"
    path.write_text("")
    inode = os.stat(path).st_ino
    standby.write_in_place(str(path), json.dumps({"argv": ["x"], "env": {}, "cwd": "/"}))
    assert os.stat(path).st_ino == inode  # the sandbox's bind still shows it
    assert json.loads(path.read_text())["argv"] == ["x"]


def test_the_standby_waits_for_a_whole_hand_over(tmp_path):
    path = tmp_path / "go.json"
    path.write_text("")
    got = {}
    t = threading.Thread(target=lambda: got.update(warmrun.wait_for_go(str(path), poll_s=0.01)))
    t.start()
    time.sleep(0.05)
    path.write_text('{"argv": ["--nnodes"')  # half written: read again
    time.sleep(0.05)
    path.write_text(json.dumps({"argv": []}))  # not a hand-over
    time.sleep(0.05)
    assert t.is_alive()
    path.write_text(json.dumps({"argv": ["--nnodes", "1"], "env": {"A": "1"}, "cwd": "/"}))
    t.join(5)
    assert got == {"argv": ["--nnodes", "1"], "env": {"A": "1"}, "cwd": "/"}


class FakeWrap:
    """A standby's wrapper process, alive or not (no process)."""

    def __init__(self, alive: bool = True):
        self.alive, self.pid, self.create_time = alive, 0, None

    def process(self):
        return psutil.Process() if self.alive else None

    def descendants(self):
        return []


@pytest.fixture
def stopped(monkeypatch):
    out: list[str] = []
    monkeypatch.setattr(standby, "stop", lambda wrap, run_dir: out.append(run_dir))
    return out


def test_a_standby_of_a_job_gone_from_the_node_is_stopped_after_the_ttl(tmp_path, stopped):
    pool = standby.Standbys(tmp_path, sandbox.SandboxConfig())
    pool._by_job = {7: standby.Standby(7, (), "/sb-7", None, FakeWrap()),
                    8: standby.Standby(8, (), "/sb-8", None, FakeWrap()),
                    9: standby.Standby(9, (), "/sb-9", None, FakeWrap(alive=False))}
    assert pool.expire({7}, ttl_s=0.05) == [9]  # its launcher died
    assert pool.expire({7}, ttl_s=0.05) == []  # job 8 is idle from now on
    time.sleep(0.1)
    assert pool.expire({7, 8}, ttl_s=0.05) == []  # it came back: no longer idle
    assert pool.expire({7}, ttl_s=0.05) == []
    time.sleep(0.1)
    assert pool.expire({7}, ttl_s=0.05) == [8] and set(pool._by_job) == {7}
    assert stopped == ["/sb-9", "/sb-8"]


def test_a_launch_that_does_not_fit_stops_the_standby(tmp_path, stopped, monkeypatch):
    monkeypatch.setattr(standby.Standbys, "discard", lambda self, sb: stopped.append(sb.run_dir))
    pool = standby.Standbys(tmp_path, sandbox.SandboxConfig())
    pool._by_job = {7: standby.Standby(7, standby.fits(request()), str(tmp_path / "a"), None, FakeWrap())}
    assert pool.take(request(slots=(1,)), None) is None and stopped == [str(tmp_path / "a")]
    pool._by_job = {7: standby.Standby(7, standby.fits(request()), str(tmp_path / "b"), None, FakeWrap())}
    assert pool.take(request(attempt_id=4), None).run_dir == str(tmp_path / "b")
    assert pool.take(request(attempt_id=5), None) is None  # one standby, one attempt
