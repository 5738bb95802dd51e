"""Issue 14 finding 5: the ranks' interface binding, flight recorder, collective timeout and
stack dumps on a hang (workers/launch_spec.py, workers/launcher.py, trainyard/sdk)."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import namedtuple

import psutil
import pytest

from tests.test_launcher import Recorder, exited, request
from workers import launch_spec, launcher
from workers.launcher import Supervisor, pick_free_port

HANG = "tests.launcher_fixtures.hang_worker"
Snic = namedtuple("Snic", "family address netmask broadcast ptp")
COMM_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE",
             "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in COMM_VARS:
        monkeypatch.delenv(name, raising=False)


def lo_name() -> str:
    return next(name for name, addrs in psutil.net_if_addrs().items()
                if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs))


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.2"])
def test_both_transports_bind_to_the_interface_holding_the_nodes_address(tmp_path, clean_env, addr):
    req = request(tmp_path, "n", local_addr=addr)
    env = launcher.build_env(req)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == lo_name()
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(os.path.abspath(req.run_dir), "logs", "nccl_trace_rank_")


def test_a_lan_address_binds_to_its_own_interface_not_only_loopback(tmp_path, clean_env, monkeypatch):
    fake = {"lo": [Snic(socket.AF_INET, "127.0.0.1", "255.0.0.0", None, None)],
            "eth0": [Snic(socket.AF_INET, "192.168.7.10", "255.255.255.0", None, None)],
            "ib0": [Snic(socket.AF_INET, "10.1.2.3", "255.255.0.0", None, None),
                    Snic(socket.AF_INET6, "fe80::1%ib0", "ffff:ffff:ffff:ffff::", None, None)]}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: fake)
    env = launcher.build_env(request(tmp_path, "n", local_addr="10.1.2.3"))
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ib0"
    with pytest.raises(launch_spec.InterfaceError):  # same subnet is not the address itself
        launch_spec.interface_for("10.1.2.4")


def test_an_address_no_interface_has_fails_the_launch_with_a_clear_error(tmp_path, clean_env):
    addr = "192.0.2.77"  # TEST-NET-1: on no interface of a test machine
    assert not any(a.address == addr for v in psutil.net_if_addrs().values() for a in v)
    with pytest.raises(launch_spec.InterfaceError, match="no network interface of this node has the address "
                                                         "'192.0.2.77'.*NCCL_SOCKET_IFNAME"):
        launcher.build_env(request(tmp_path, "n", local_addr=addr))
    sup = launcher.Supervisor(request(tmp_path, "n", local_addr=addr), **Recorder().callbacks())
    with pytest.raises(launch_spec.InterfaceError):
        sup.start()
    assert not os.path.exists(os.path.join(sup.run_dir, "launched"))  # a retry may start it


def test_the_operators_or_the_jobs_settings_win(tmp_path, clean_env, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    env = launcher.build_env(request(tmp_path, "n", local_addr="192.0.2.77"))  # no lookup needed
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("ib0", "eth1")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    env = launcher.build_env(request(tmp_path, "n", env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}))
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == (lo_name(), "eth1")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in env


def test_catches_signal_reads_the_handler_table():
    code = ("import faulthandler, signal, sys, time\n"
            "if sys.argv[1] == '1': faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
            "print('ready', flush=True); time.sleep(30)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, flag], stdout=subprocess.PIPE, text=True)
             for flag in ("1", "0")]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        assert launcher.catches_signal(procs[0].pid, signal.SIGUSR1)
        assert not launcher.catches_signal(procs[1].pid, signal.SIGUSR1)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _agent(tmp_path, address, monkeypatch, rec):
    from workers import agent as agent_mod

    agent = agent_mod.Agent("n", address, 2, {}, "cpu", tmp_path / "runs",  # Redis: never used here
                            sandbox_cfg=agent_mod.sandbox.SandboxConfig(enabled=False))
    monkeypatch.setattr(agent, "_rdzv_port", lambda attempt_id, node_rank, token: 29555)
    monkeypatch.setattr(agent, "_callbacks", lambda job_id, attempt_id, stream, url: rec.callbacks())
    return agent, agent_mod


def _launch(**kw):
    from trainyard.launch import Launch

    return Launch(job_id=7, attempt_id=3, node="n", node_rank=0, nnodes=1, nproc=1, slots=[0], device="cpu",
                  rdzv_host="127.0.0.1", local_addr="127.0.0.1", stream="s", spec={}, redis_user="u",
                  redis_password="p", proof_key="ab" * 32, rdzv_token="cd" * 16, **kw)


def test_the_agent_passes_the_timeout_and_asks_for_stacks_only_when_stopping_a_hung_attempt(
        tmp_path, monkeypatch):
    made = []

    class FakeSup:
        def __init__(self, req, sandbox=None, **cbs):
            self.req, self.stops = req, []
            made.append(self)

        def start(self):
            return True

        def stop(self, **kw):
            self.stops.append(kw)

    agent, agent_mod = _agent(tmp_path, "127.0.0.1", monkeypatch, Recorder())
    monkeypatch.setattr(agent_mod, "Supervisor", FakeSup)
    assert agent.launch(_launch(collective_timeout_s=48.0))
    assert made[0].req.config["collective_timeout_s"] == 48.0  # what the ranks' init reads
    agent.stop(3, "hang")
    agent.stop(3, "cancel")
    assert made[0].stops == [{"dump_stacks": True}, {"dump_stacks": False}]


def test_an_agent_advertising_an_address_it_does_not_have_reports_a_failed_start(tmp_path, clean_env,
                                                                                monkeypatch):
    rec = Recorder()
    agent, _ = _agent(tmp_path, "192.0.2.77", monkeypatch, rec)
    assert not agent.launch(_launch())
    [result] = rec.exits()
    assert "InterfaceError: no network interface of this node has the address '192.0.2.77'" in \
        result["failures"][0]["message"]
    assert not (tmp_path / "runs" / "attempt-3" / "launched").exists()


# ---- real torchrun: a 2-rank gloo job, one rank asleep outside the collective ------------------

def _sleeping_run(tmp_path, timeout_s=None):
    recs = [Recorder(), Recorder()]
    config = {"sleep_rank": 1, **({"collective_timeout_s": timeout_s} if timeout_s else {})}
    port = pick_free_port("127.0.0.1")
    sups = [Supervisor(dataclasses.replace(
        request(tmp_path, node, node_rank=i, nnodes=2, port=port, local_addr=addr, config=config),
        module=HANG), **rec.callbacks())
        for i, (node, addr, rec) in enumerate([("node-a", "127.0.0.1", recs[0]),
                                               ("node-b", "127.0.0.2", recs[1])])]
    assert all(s.start() for s in sups)
    return recs, sups


def _rank_lines(recs, rank: int) -> list[str]:
    return [line for rec in recs for r, _, line in rec.lines() if r == rank]


@pytest.mark.procs
def test_stopping_a_hung_attempt_writes_every_ranks_stack_to_its_log(tmp_path):
    recs, sups = _sleeping_run(tmp_path)
    try:
        deadline = time.monotonic() + 45
        while not all(any(text in line for line in _rank_lines(recs, rank))
                      for rank, text in ((0, "entering all_reduce"), (1, "sleeping"))):
            assert time.monotonic() < deadline, [rec.events for rec in recs]
            time.sleep(0.1)
        stops = [threading.Thread(target=s.stop, kwargs={"dump_stacks": True}) for s in sups]
        for t in stops:  # each node's agent gets the control plane's stop at the same time
            t.start()
        for t in stops:
            t.join(30)
        for rec in recs:
            rec.wait(exited)
        sleeper, waiter = _rank_lines(recs, 1), _rank_lines(recs, 0)
        assert any("Current thread" in line or "Thread 0x" in line for line in sleeper), sleeper
        assert any("sleeping_rank_frame" in line for line in sleeper), sleeper
        assert any("hang_worker.py" in line and "main" in line for line in waiter), waiter
        assert all(rec.exits()[0]["stopped"] for rec in recs)
    finally:
        for s in sups:
            s.stop()


@pytest.mark.procs
def test_a_collective_a_peer_never_joins_fails_within_the_collective_timeout(tmp_path):
    recs, sups = _sleeping_run(tmp_path, timeout_s=3)
    t0 = time.monotonic()
    try:
        for rec in recs:
            rec.wait(exited, timeout=60)
        elapsed = time.monotonic() - t0
        failures = [f for rec in recs for f in rec.exits()[0]["failures"]]
        waiter = _rank_lines(recs, 0)
        assert any("all_reduce returned after" in line for line in waiter), waiter
        text = "\n".join(waiter + [str(f.get("message")) for f in failures])
        assert "Timed out" in text or "timed out" in text.lower(), text
        assert elapsed < 40, elapsed  # torch's gloo default would wait 30 minutes
    finally:
        for s in sups:
            s.stop()


def test_every_group_of_the_run_gets_the_collective_timeout_from_its_first_step(tmp_path, monkeypatch):
    """torch gives dist.new_group (and a device mesh's sub-groups) its own default timeout, never
    the run's: the SDK tracks its groups and tightens them all once the first step is logged
    (start-up keeps torch's defaults, as the hang detector gives start-up longer too)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainyard.sdk import groups, run

    def timeout_of(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_initialized()
    assert run.init_process_group(run.DistEnv.standalone(), torch.device("cpu"), 7)
    try:
        early = groups.new_group(backend="gloo")
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        groups.track_group(mesh.get_group("tp"))
        assert timeout_of(early) == timeout_of(mesh.get_group("tp")) == timedelta(minutes=30)  # start-up
        r = run.Run(env=run.DistEnv.standalone(), device=torch.device("cpu"), launch=None, spec=None,
                    reporter=None)
        r.log(1, loss=1.0)
        late = groups.new_group(backend="gloo")
        for group in (dist.group.WORLD, early, mesh.get_group("tp"), late):
            assert timeout_of(group) == timedelta(seconds=7)
        assert timeout_of(dist.new_group(backend="gloo")) == timedelta(minutes=30)  # untracked: torch's own
    finally:
        dist.destroy_process_group()
        groups.configure(None)


def test_the_gpu_check_reads_which_interface_nccls_bootstrap_and_socket_transport_use():
    from bench.gpu.nccl_setup import CHECKS, parse_nccl_interfaces

    log = ("h:1:1 [0] NCCL INFO Bootstrap : Using lo:127.0.0.1<0>\n"
           "h:1:1 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0> [1]eth0:10.0.0.2<0>\n"
           "h:1:1 [0] NCCL INFO Bootstrap: Using ib0:fe80::1%ib0<0>\n"
           "h:1:1 [0] NCCL INFO cudaDriverVersion 12080\n")
    assert parse_nccl_interfaces(log) == {"Bootstrap": ["lo", "ib0"], "NET/Socket": ["lo", "eth0"]}
    assert [(name, gpus) for name, gpus, _ in CHECKS] == [("nccl_bootstrap_interface", 1),
                                                          ("nccl_timeout_flight_recorder", 2)]
