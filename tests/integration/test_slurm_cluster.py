"""The real Slurm cluster fixture (tests/integration/slurm_cluster.py) on two network-namespace hosts:
a 2-node batch job's `srun` runs a task on each host; preemption by the `urgent` partition, a node set
DOWN and `scancel --signal=TERM` reach the step processes as the fixture's docstring says; and
nothing the fixture started outlives it. Jobs run a small Python task that writes every signal it
gets (and a heartbeat, whose last value is when it was SIGKILLed) into a file on the shared file system.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from . import hosts, slurm_cluster
from .slurm_cluster import cluster_pids

ok_net, why_net = hosts.available()
ok_slurm, why_slurm = slurm_cluster.available()
pytestmark = [pytest.mark.procs, pytest.mark.timeout(240),
              pytest.mark.skipif(not ok_slurm, reason=f"Slurm unavailable: {why_slurm}"),
              pytest.mark.skipif(not ok_net, reason=f"network namespaces unavailable: {why_net}")]

GRACE_S = 5
TASK = r'''
import os, signal, sys, time
log = sys.argv[1]
tag = os.environ.get("SLURMD_NODENAME", "?") + "/" + os.environ.get("SLURM_PROCID", "?")
f = open(log, "a", buffering=1)
def on(sig, frame):
    f.write(f"{time.time():.3f} {tag} {signal.Signals(sig).name}\n")
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGCONT, signal.SIGHUP):
    signal.signal(s, on)
f.write(f"{time.time():.3f} {tag} START job={os.environ.get('SLURM_JOB_ID')} node={os.environ.get('SLURM_NODEID')}"
        f" restarts={os.environ.get('SLURM_RESTART_COUNT', '0')} cwd={os.getcwd()}\n")
hb = open(f"{log}.hb.{tag.replace('/', '_')}", "w")
while True:
    hb.seek(0); hb.write(f"{time.time():.3f}\n"); hb.flush()
    time.sleep(0.05)
'''


class Task:
    """One job's signal log: `events()` [(t, node/rank, what)], `last_beat()` {node/rank: t}."""

    def __init__(self, path: Path):
        self.path = path

    def events(self) -> list[tuple[float, str, str]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            t, tag, what = line.split(" ", 2)
            out.append((float(t), tag, what))
        return out

    def signals(self, tag: str | None = None) -> list[tuple[float, str]]:
        return [(t, w) for t, g, w in self.events() if w.startswith("SIG") and tag in (None, g)]

    def started(self) -> dict[str, str]:
        return {g: w for _, g, w in self.events() if w.startswith("START")}

    def last_beat(self) -> dict[str, float]:
        return {p.name.rsplit(".", 1)[1].replace("_", "/"): float(p.read_text() or 0)
                for p in self.path.parent.glob(f"{self.path.name}.hb.*")}


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    work = tmp_path_factory.mktemp("slurm")
    with hosts.bridged_hosts(["h1", "h2"]) as net, slurm_cluster.slurm_cluster(
            work / "cluster", [("n1", net.namespace("h1")), ("n2", net.namespace("h2"))],
            controller_addr=net.gateway, cpus=2, grace_s=GRACE_S) as c:
        c.task_py = work / "task.py"
        c.task_py.write_text(TASK)
        yield c


@pytest.fixture
def cl(sc):
    yield sc
    sc.cancel_all()
    for n in sc.nodes:
        sc.resume_node(n)
    deadline = time.monotonic() + 30
    while sc.run(["squeue", "-h"]).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.2)
    sc.wait_idle(30)


def submit(sc, name: str, *args: str, tasks: int = 2) -> tuple[str, Task]:
    log = sc.workdir.parent / f"{name}.log"
    jid = sc.run(["sbatch", "--parsable", f"--job-name={name}", f"--output={sc.workdir.parent}/{name}-%j.out",
                  *args, "--wrap", f"srun {sys.executable} {sc.task_py} {log}"]).stdout.strip().split(";")[0]
    task = Task(log)
    sc.wait_job_state(jid, "RUNNING", 20)
    deadline = time.monotonic() + 15
    while len(task.started()) < tasks:
        assert time.monotonic() < deadline, f"{name}: tasks started {task.started()}\n{sc.logs()}"
        time.sleep(0.05)
    return jid, task


def wait_for(pred, timeout: float, what: str, sc):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{sc.logs()}"
        time.sleep(0.1)
    return v


def test_srun_runs_a_task_on_each_host(cl):
    jid = cl.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={cl.workdir}/a-%j.out",
                  "--wrap", "srun bash -c 'echo $SLURMD_NODENAME $SLURM_NODEID $SLURM_PROCID $SLURM_JOB_ID'"]
                 ).stdout.strip()
    assert cl.wait_job_state(jid, {"COMPLETED", "FAILED"}, 30) == "COMPLETED", cl.logs()
    lines = sorted((cl.workdir / f"a-{jid}.out").read_text().split("\n"))
    assert [ln for ln in lines if ln] == [f"n1 0 0 {jid}", f"n2 1 1 {jid}"]
    # each slurmd is in its own namespace at its own address: slurmctld reached both over the bridge
    assert len(set(cl.addresses.values())) == 2 and set(cl.namespaces) == {"n1", "n2"}
    # an ended job stays in squeue --states=all (until MinJobAge), not in plain squeue
    assert cl.run(["squeue", "-h", f"--jobs={jid}"]).stdout.strip() == ""
    assert " CD " in cl.run(["squeue", "-h", "--states=all", f"--jobs={jid}"]).stdout
    unknown = cl.run(["squeue", "-h", "--jobs=999999"], check=False)
    assert (unknown.returncode, unknown.stderr.strip()) == (1, "slurm_load_jobs error: Invalid job id specified")
    sacct = cl.run(["sacct", "-j", jid], check=False)
    assert (sacct.returncode, sacct.stderr.strip()) == (1, "Slurm accounting storage is disabled")


def test_scancel_signal_term_reaches_the_steps_and_scancel_ends_the_job(cl):
    jid, task = submit(cl, "sig", "--nodes=2", "--ntasks-per-node=1")
    assert all(f"job={jid}" in w and f"cwd={cl.workdir}" in w for w in task.started().values())
    t0 = time.time()
    cl.run(["scancel", "--signal=TERM", jid])
    wait_for(lambda: len(task.signals()) >= 2, 10, "SIGTERM on both ranks", cl)
    assert sorted((g, w) for _, g, w in task.events() if w.startswith("SIG")) == [
        ("n1/0", "SIGTERM"), ("n2/1", "SIGTERM")]
    time.sleep(1)
    assert cl.job_state(jid) == "RUNNING"  # a signal only: the tasks trap it and the job goes on
    t1 = time.time()
    cl.run(["scancel", jid])
    cl.wait_job_state(jid, "CANCELLED", 20)
    after = [(t, w) for t, w in task.signals() if t >= t1]
    assert {w for _, w in after} == {"SIGCONT", "SIGTERM"} and max(t for t, _ in after) - t1 < 2, task.events()
    killed = max(task.last_beat().values()) - t1
    assert 1.5 < killed < 10, f"SIGKILL {killed:.1f}s after scancel (KillWait=2)"
    assert t0 < t1


def test_preemption_by_urgent_signals_then_kills_the_trainyard_jobs(cl):
    # one requeueable job on n1, one --no-requeue job on n2; an urgent job needs both nodes whole
    rq, rq_task = submit(cl, "rq", "--nodes=1", "--nodelist=n1", "--ntasks=1", "--cpus-per-task=2", tasks=1)
    nrq, nrq_task = submit(cl, "nrq", "--no-requeue", "--nodes=1", "--nodelist=n2", "--ntasks=1",
                           "--cpus-per-task=2", tasks=1)
    t0 = time.time()
    urgent = cl.run(["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                     "--wrap", "sleep 1"]).stdout.strip()
    for task in (rq_task, nrq_task):
        wait_for(lambda t=task: t.signals(), 10, "the preemption's first signals", cl)
    cl.wait_job_state(nrq, "PREEMPTED", 40)
    cl.wait_job_state(rq, "PENDING", 10)
    info = cl.job_info(rq)
    assert info["Restarts"] == "1" and info["Reason"] == "BeginTime", info
    for task in (rq_task, nrq_task):
        sigs = task.signals()
        first = [w for t, w in sigs if t - sigs[0][0] < 0.5]
        assert sorted(first) == ["SIGCONT", "SIGTERM"], sigs
        later = [(t, w) for t, w in sigs if t - sigs[0][0] >= 0.5]
        assert later and {w for _, w in later} == {"SIGCONT", "SIGTERM"}, sigs
        grace_end = later[0][0] - sigs[0][0]
        assert GRACE_S - 0.5 < grace_end < GRACE_S + 12, f"second SIGTERM {grace_end:.1f}s after the first"
        killed = max(task.last_beat().values()) - later[0][0]
        assert 1.5 < killed < 10, f"SIGKILL {killed:.1f}s after the grace end"
        assert sigs[0][0] - t0 < 5
    assert cl.job_info(nrq)["Requeue"] == "0"
    assert cl.wait_job_state(urgent, {"RUNNING", "COMPLETED"}, 20)


def test_node_down_kills_its_jobs_node_fail_or_requeued(cl):
    nrq, nrq_task = submit(cl, "down-nrq", "--no-requeue", "--nodes=2", "--ntasks-per-node=1")
    rq, rq_task = submit(cl, "down-rq", "--nodes=1", "--nodelist=n2", "--ntasks=1", tasks=1)
    t0 = time.time()
    cl.set_node_down("n2", "pulled")
    assert cl.node_state("n2").startswith("DOWN")
    assert cl.wait_job_state(nrq, "NODE_FAIL", 20) == "NODE_FAIL"
    cl.wait_job_state(rq, "PENDING", 10)
    assert cl.job_info(rq)["Restarts"] == "1"
    # both ranks of the 2-node job, the one on the healthy node too, get SIGCONT+SIGTERM then SIGKILL
    for task, tags in ((nrq_task, ["n1/0", "n2/1"]), (rq_task, ["n2/0"])):
        for tag in tags:
            assert sorted(w for _, w in task.signals(tag)) == ["SIGCONT", "SIGTERM"], task.events()
            assert task.signals(tag)[0][0] - t0 < 2
        assert all(1.5 < b - t0 < 10 for b in task.last_beat().values()), task.last_beat()
    assert cl.node_state("n2").startswith("DOWN")  # ReturnToService=1: an admin DOWN stays down
    cl.resume_node("n2")
    wait_for(lambda: cl.node_state("n2") == "IDLE", 10, "n2 back to IDLE", cl)


def test_nothing_outlives_the_fixture(tmp_path):
    """Two slurmd in the test's own namespace (distinct ports, -N): a job left running at exit is
    killed with its slurmstepd; no process of the cluster survives."""
    work = tmp_path / "cluster"
    log = tmp_path / "left.log"
    tmp_path.joinpath("task.py").write_text(TASK)
    with slurm_cluster.slurm_cluster(work, [("a", None), ("b", None)]) as c:
        assert len(set(c.addresses.values())) == 1
        jid = c.run(["sbatch", "--parsable", "--nodes=2", "--wrap",
                     f"srun {sys.executable} {tmp_path / 'task.py'} {log}"]).stdout.strip()
        task = Task(log)
        wait_for(lambda: len(task.started()) == 2, 20, "both tasks", c)
        pids = c.leftover_pids()
        names = {_comm(p) for p in pids}
        assert {"slurmctld", "slurmd", "slurmstepd", "munged"} <= names, names
        assert c.job_state(jid) == "RUNNING"
        marker = c.marker
    left = cluster_pids(marker, list(pids))
    assert not left, {p: _comm(p) for p in left}
    daemons = {"slurmctld", "slurmd", "slurmstepd", "munged", "nsenter"}
    alive = [p for p in pids if _comm(p) in daemons and _state(p) not in ("Z", "X", None)]
    assert not alive, {p: (_comm(p), _state(p)) for p in alive}
    beats = task.last_beat()
    time.sleep(0.3)
    assert task.last_beat() == beats  # the tasks are dead, not orphaned


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie, dead and waiting to be reaped); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[0]
