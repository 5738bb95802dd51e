"""Node agent: a Celery worker on queue `node.<name>` that launches and supervises this node's
share of attempts, heartbeats to the control queue and forwards rank logs to the job's stream.

It needs only Redis (broker, streams, the rendezvous-port handoff) -- never the database.
Run: python -m workers.agent --name node-a --address 127.0.0.1 --slots 2 --credential-file var/credentials/node-a
Every report is signed with the node's credential (`manage.py node_add node-a` issues it; trainyard.nodeauth).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path

import psutil
import redis

from trainyard import keys, nodeauth, redis_acl
from trainyard.private import private_dir, tighten
from trainyard.keys import CONTROL_QUEUE, node_queue
from trainyard.launch import (COMMAND_MAX_AGE_S, HEARTBEAT_TASK, NODE_EXIT_TASK, RANKS_TASK, ExitReport, Heartbeat,
                              Launch, NodeExit, RankFailure, RankInfo, RanksReport)

from .celery_app import REDIS_URL, app, configure_node
from .launch_spec import InterfaceError, warm_ranks
from .launcher import LaunchRequest, Supervisor, launched_attempts, pick_free_port
from .entrypoint import UserCodeError, check_python_runs, prepare
from .gpus import GpuMonitor, NvmlUnavailable
from . import agent_once, sandbox, standby
from .launch_spec import CHAOS_VAR

log = logging.getLogger("trainyard.agent")
HEARTBEAT_S = 2.0
RDZV_WAIT_S = 60.0


def discover_devices(device: str, slots: int, gpus: GpuMonitor | None = None) -> list[dict]:
    """The heartbeat's devices. A cuda agent reads its GPUs through NVML (`gpus`), never through
    torch.cuda (workers/gpus.py says why); without NVML it reports no GPUs."""
    if device == "cuda":
        return gpus.devices() if gpus is not None else []
    cores = os.cpu_count() or 1
    return [{"kind": "cpu", "index": i, "cores": max(1, cores // slots)} for i in range(slots)]


def start_gpu_monitor(device: str, slots: int) -> GpuMonitor | None:
    """A cuda agent's NVML monitor; refuses more slots than visible GPUs. None without NVML
    (said clearly: this node then reports no GPUs)."""
    if device != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        gpus = GpuMonitor(visible).start()
    except NvmlUnavailable as exc:
        log.error("--device cuda but %s: this agent reports no GPUs and cannot check --slots %s", exc, slots)
        return None
    if slots > gpus.count:
        raise SystemExit(f"--slots {slots} but this agent sees {gpus.count} GPU(s) (CUDA_VISIBLE_DEVICES="
                         f"{visible if visible is not None else 'unset'}): use --slots {gpus.count} or fewer")
    log.info("NVML: %s visible GPU(s), NVML indices %s", gpus.count, [i for i, _ in gpus.handles])
    return gpus


class Agent:
    def __init__(self, name: str, address: str, slots: int, labels: dict, device: str, run_base: Path,
                 gpus: GpuMonitor | None = None, credential: str | None = None,
                 sandbox_cfg: sandbox.SandboxConfig | None = None):
        self.name, self.address, self.slots, self.labels, self.device = name, address, slots, labels, device
        self.sandbox_cfg = sandbox_cfg if sandbox_cfg is not None else sandbox.SandboxConfig.from_env()
        self.credential = credential  # None: unregistered, its heartbeats are a join request
        self.refused_commands = 0
        self.gpus = gpus
        self.run_base = run_base
        # 0700, tightened if older: run dirs hold config.json with the Redis URL and its password.
        private_dir(run_base)
        tighten(run_base.parent)  # the run root (TRAINYARD_RUN_DIR) every node's directory is under
        self.agent_id = uuid.uuid4().hex[:12]
        # driver_info=None: no CLIENT SETINFO, which the node's Redis user may not run (trainyard/redis_acl.py).
        self.redis = redis.Redis.from_url(REDIS_URL, socket_timeout=5, socket_connect_timeout=5, driver_info=None)
        self.supervisors: dict[int, Supervisor] = {}
        self._locks: dict[int, threading.Lock] = {}
        self._registry_lock = threading.Lock()
        self._stop = threading.Event()
        self.cores_per_slot = max(1, (os.cpu_count() or 1) // slots)
        self.standbys = standby.Standbys(run_base, self.sandbox_cfg)
        self.lifetime = agent_once.Lifetime.from_env(self)

    # ---------------------------------------------------------------- helpers
    def report(self, task: str, body: dict, **options) -> None:
        """Send a report to the control queue, signed with this node's credential."""
        envelope = nodeauth.seal(self.credential, self.name, task, body, time.time())
        app.send_task(task, args=[envelope], queue=CONTROL_QUEUE, **options)

    def command_open(self, envelope: object, task: str) -> dict | None:
        """The body of a command from the control plane, or None: a command runs only if it names
        this node and the task it arrived as, carries this node's signature (the control plane
        seals with the node's credential, jobs.core.dispatch.sealed) and is at most COMMAND_MAX_AGE_S
        old. Anything else that could write to this node's queue is refused, and logged."""
        why = ""
        env = envelope if isinstance(envelope, dict) else {}
        ts = env.get("ts")
        if self.credential is None:
            why = "this agent has no credential to check it with (--credential-file)"
        elif env.get("node") != self.name or env.get("task") != task:
            why = f"it is addressed to {str(env.get('node'))[:64]!r} as {str(env.get('task'))[:100]!r}"
        elif not isinstance(env.get("body"), dict) or not nodeauth.signature_ok(self.credential, env):
            why = "its signature is not this node's credential's"
        elif not isinstance(ts, (int, float)) or abs(time.time() - ts) > COMMAND_MAX_AGE_S:
            why = f"it is not recent (ts {ts!r}; at most {COMMAND_MAX_AGE_S:.0f} s)"
        if why:
            self.refused_commands += 1
            log.warning("refused a %s command: %s", task.rsplit(".", 1)[-1], why)
            return None
        return env["body"]

    def _lock(self, attempt_id: int) -> threading.Lock:
        with self._registry_lock:
            return self._locks.setdefault(attempt_id, threading.Lock())

    def run_dir(self, attempt_id: int) -> Path:
        return self.run_base / f"attempt-{int(attempt_id)}"

    def _callbacks(self, job_id: int, attempt_id: int, stream: str, redis_url: str) -> dict:
        # The attempt's logs go to its own stream with its own Redis user (the node's user cannot
        # write any job's stream: trainyard/redis_acl.py).
        client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5, driver_info=None)

        def on_ranks(ranks: list[dict]) -> None:
            infos = [RankInfo.model_validate(r).model_dump(mode="json") for r in ranks]
            self.report(RANKS_TASK, RanksReport(attempt_id=attempt_id, ranks=infos).model_dump(mode="json"))
            if not self._stop.is_set():  # its ranks are up: the next attempt's launcher can import now
                self.standbys.ranks_up(attempt_id)

        def on_log(rank: int, which: str, lines: list[str]) -> None:
            try:
                client.xadd(stream, {"type": "log", "data": json.dumps(
                    {"attempt": attempt_id, "rank": rank, "stream": which, "lines": lines, "node": self.name})})
            except redis.RedisError as exc:  # logs are best effort; the files stay on disk
                log.warning("log forward failed for attempt %s: %s", attempt_id, exc)

        def on_exit(result: dict) -> None:
            with self._registry_lock:
                self.supervisors.pop(attempt_id, None)
            self.standbys.forget(attempt_id)
            client.close()
            report = NodeExit.model_validate(dict(result, node=self.name))
            self.report(NODE_EXIT_TASK, ExitReport(attempt_id=attempt_id, result=report.wire()).model_dump(mode="json"))
            self.lifetime.attempt_ended(attempt_id)

        return {"on_ranks": on_ranks, "on_log": on_log, "on_exit": on_exit}

    # ---------------------------------------------------------------- tasks
    def _rdzv_port(self, attempt_id: int, node_rank: int, token: str) -> int:
        """The attempt's rendezvous port: picked by its node_rank-0 agent, read by the others, under
        a key named with the token of the sealed Launch (no node outside the attempt can name it)."""
        key = keys.rdzv_port_key(attempt_id, token)
        if node_rank == 0:
            # SET NX: a redelivered launch reuses the port its first delivery announced.
            self.redis.set(key, pick_free_port(self.address), nx=True, ex=86400)
        deadline = time.monotonic() + RDZV_WAIT_S
        while time.monotonic() < deadline:
            value = self.redis.get(key)
            if value is not None:
                text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
                if not text.isdigit() or not 0 < int(text) < 65536:
                    raise ValueError(f"the rendezvous key of attempt {attempt_id} holds {text[:40]!r}, not a port")
                return int(text)
            time.sleep(0.1)
        raise TimeoutError(f"rank-0 node did not publish a rendezvous port for attempt {attempt_id}")

    def launch(self, msg: Launch) -> bool:
        attempt_id, job_id = msg.attempt_id, msg.job_id
        run_dir = self.run_dir(attempt_id)
        if (run_dir / "launched").exists():
            log.info("attempt %s was already launched on %s: ignoring duplicate launch", attempt_id, self.name)
            return False
        redis_url, ca_files = attempt_redis_url(REDIS_URL, msg.redis_user, msg.redis_password)
        cbs = self._callbacks(job_id, attempt_id, msg.stream, redis_url)
        try:
            port = self._rdzv_port(attempt_id, msg.node_rank, msg.rdzv_token)
        except (TimeoutError, ValueError, redis.RedisError) as exc:
            self._report_failed_start(cbs, attempt_id, f"RendezvousError: {exc}")
            return False
        private_dir(run_dir)
        checkpoint_dir = keys.job_checkpoint_dir(keys.checkpoint_root(), job_id)
        plan = self._sandbox_plan(msg, run_dir, checkpoint_dir, ca_files=ca_files)
        try:  # user code: the job's python, its bundle verified and unpacked into run_dir/code
            gpu_ids, devices = self._gpus(msg)
            user_code = prepare(msg.spec, run_dir, node=self.name, ro_roots=plan.ro_roots())
            plan = self._sandbox_plan(msg, run_dir, checkpoint_dir, code_dir=user_code.get("code_dir", ""),
                                      devices=devices, ca_files=ca_files)
            if user_code.get("python"):
                if plan.enabled:
                    plan.prepare()
                check_python_runs(user_code["python"], node=self.name,
                                  run=self._probe_in(plan) if plan.enabled else None)
        except UserCodeError as exc:
            log.warning("attempt %s cannot start on %s: %s", attempt_id, self.name, exc)
            self._report_failed_start(cbs, attempt_id, str(exc))
            return False
        config = {
            "job_id": job_id, "attempt_id": attempt_id, "node": self.name, "run_dir": str(run_dir),
            # The attempt's own Redis user (its stream, its preemption key); nothing of the node's.
            "redis_url": redis_url, "stream": msg.stream, "proof_key": msg.proof_key,
            "data_root": str(keys.data_root()),
            # The same function and environment variable the control plane's checkpoint_register checks against.
            "checkpoint_dir": str(checkpoint_dir),
            "spec": msg.spec, "planner": msg.planner,
            "resume": msg.resume.model_dump(mode="json") if msg.resume else None,
            "collective_timeout_s": msg.collective_timeout_s, "memory_limit_gb": msg.memory_limit_gb,
        }
        req = LaunchRequest(
            job_id=job_id, attempt_id=attempt_id, node=self.name, node_rank=msg.node_rank,
            nnodes=msg.nnodes, nproc=msg.nproc, slots=tuple(msg.slots),
            device=msg.device, rdzv_host=msg.rdzv_host, rdzv_port=port, local_addr=self.address,
            config=config, run_dir=str(run_dir), cores_per_slot=self.cores_per_slot, gpu_ids=gpu_ids,
            warm=warm_ranks(), **user_code)
        if req.warm and not req.user_code:
            sb = self.standbys.take(req, plan)
            if sb is not None:
                return self._hand_over(sb, req, cbs)
        return self._start(req, cbs, plan, msg.rdzv_host, port)

    def _hand_over(self, sb: standby.Standby, req: LaunchRequest, cbs: dict) -> bool:
        """Run the attempt in the job's standby launcher: already imported, it only rendezvouses."""
        with self._lock(req.attempt_id):
            sup = standby.launch_in(sb, req, cbs, self.run_dir(req.attempt_id) / "launched")
            if sup is None:
                self.standbys.discard(sb)
                return False
            with self._registry_lock:
                self.supervisors[req.attempt_id] = sup
        log.info("launched attempt %s (job %s) on %s in its standby %s", req.attempt_id, req.job_id, self.name,
                 sb.run_dir)
        return True

    def _start(self, req: LaunchRequest, cbs: dict, plan: sandbox.SandboxPlan, rdzv_host: str, port: int) -> bool:
        attempt_id = req.attempt_id
        with self._lock(attempt_id):
            sup = Supervisor(req, **cbs, sandbox=plan)
            try:
                started = sup.start()
            except (InterfaceError, sandbox.SandboxUnavailable, OSError) as exc:  # gloo/NCCL would bind elsewhere
                log.error("attempt %s cannot start on %s: %s", attempt_id, self.name, exc)
                self._report_failed_start(cbs, attempt_id, f"{type(exc).__name__}: {exc}")
                return False
            if not started:
                log.info("attempt %s already launched on %s: not starting it again", attempt_id, self.name)
                return False
            with self._registry_lock:
                self.supervisors[attempt_id] = sup
        log.info("launched attempt %s (job %s) on %s, rdzv %s:%s%s", attempt_id, req.job_id, self.name,
                 rdzv_host, port, "" if plan.enabled else " UNSANDBOXED (TRAINYARD_INSECURE_NO_SANDBOX=1)")
        return True

    @staticmethod
    def _probe_in(plan: sandbox.SandboxPlan):
        def run(argv: list[str], timeout_s: float) -> tuple[int, str]:
            done = plan.run({"PATH": sandbox.SYSTEM_PATH}, argv, timeout_s)
            return done.returncode, done.stderr
        return run

    def _gpus(self, msg: Launch) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(UUIDs, device nodes) of a cuda attempt's GPUs in a sandbox; () () otherwise."""
        if msg.device != "cuda" or not self.sandbox_cfg.enabled or self.gpus is None:
            return (), ()
        try:
            uuids, nodes = self.gpus.slot_nodes(msg.slots)
        except NvmlUnavailable as exc:
            raise UserCodeError(f"PlacementError: the GPUs of slots {msg.slots} cannot be named on node "
                                f"{self.name}: {exc}") from None
        return tuple(uuids), tuple(nodes)

    def _sandbox_plan(self, msg: Launch, run_dir: Path, checkpoint_dir: Path, *, code_dir: str = "",
                      devices: tuple[str, ...] = (), ca_files: tuple[str, ...] = ()) -> sandbox.SandboxPlan:
        chaos = os.environ.get(CHAOS_VAR, "")
        mounts = sandbox.Mounts(
            run_dir=str(run_dir), checkpoint_dir=str(checkpoint_dir), data_root=str(keys.data_root()),
            code_dir=code_dir, python_prefixes=sandbox.agent_python_prefixes(),
            extra_rw=(chaos,) if chaos else (), extra_ro=ca_files, devices=devices, cuda=msg.device == "cuda")
        return sandbox.SandboxPlan.for_attempt(self.sandbox_cfg, mounts, job_id=msg.job_id, attempt_id=msg.attempt_id)

    @staticmethod
    def _report_failed_start(cbs: dict, attempt_id: int, message: str) -> None:
        """Nothing started here: one failure, reported like a rank's (the control plane diagnoses it)."""
        cbs["on_exit"](NodeExit(
            attempt_id=attempt_id, exit_code=None, signal=None, stopped=False,
            failures=[RankFailure(rank=None, local_rank=None, exitcode=None, timestamp=time.time(),
                                  message=message, traceback="")],
            log_tail={}, duration_s=0.0).wire())

    def stop(self, attempt_id: int, reason: str) -> None:
        with self._lock(attempt_id):
            with self._registry_lock:
                sup = self.supervisors.get(attempt_id)
            if sup is None:
                run_dir = private_dir(self.run_dir(attempt_id))
                try:
                    # Claim the launch marker so a launch message still in flight starts nothing.
                    os.close(os.open(run_dir / "launched", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    log.info("stop for attempt %s before its launch: it will not start here", attempt_id)
                except FileExistsError:
                    log.info("stop for attempt %s: nothing running here", attempt_id)
                # Either way this node holds nothing of the attempt: say so, so its slots free up.
                self._report_never_started(attempt_id, reason)
                return
        log.info("stopping attempt %s on %s (%s)", attempt_id, self.name, reason)
        sup.stop(dump_stacks=reason == "hang")  # a hang: each rank's stack first, in its log

    def _report_never_started(self, attempt_id: int, reason: str) -> None:
        report = NodeExit(attempt_id=attempt_id, node=self.name, exit_code=None, signal=None, stopped=True,
                          failures=[], log_tail={}, duration_s=0.0, reason=reason)
        self.report(NODE_EXIT_TASK, ExitReport(attempt_id=attempt_id, result=report.wire()).model_dump(mode="json"))
        self.lifetime.attempt_ended(attempt_id)

    # ---------------------------------------------------------------- lifecycle
    def adopt_running(self) -> None:
        """After an agent restart, re-attach to attempts whose processes outlived the old agent."""
        for run_dir in launched_attempts(str(self.run_base)):
            try:
                cfg = json.loads((Path(run_dir) / "config.json").read_text())
            except (OSError, ValueError):
                continue
            attempt_id = int(cfg["attempt_id"])
            sup = Supervisor.adopt(run_dir, **self._callbacks(int(cfg["job_id"]), attempt_id, cfg["stream"],
                                                              cfg["redis_url"]))
            if sup is not None:
                with self._registry_lock:
                    self.supervisors[attempt_id] = sup
                log.info("re-attached to running attempt %s", attempt_id)

    def heartbeat_payload(self) -> Heartbeat:
        with self._registry_lock:
            attempts = sorted(self.supervisors)
        return Heartbeat(
            name=self.name, address=self.address, slots=self.slots, labels=self.labels,
            devices=discover_devices(self.device, self.slots, self.gpus), cpu_percent=psutil.cpu_percent(None),
            mem_percent=psutil.virtual_memory().percent, agent_id=self.agent_id, attempts=attempts,
            allocation=self.lifetime.allocation, draining=self.lifetime.draining)

    def stop_all(self) -> None:
        """Graceful agent shutdown (Ctrl-C under `make run`): stop every attempt running here, in parallel."""
        self._stop.set()
        self.standbys.stop_all()
        with self._registry_lock:
            sups = list(self.supervisors.values())
        threads = [threading.Thread(target=s.stop, daemon=True) for s in sups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)

    def heartbeat_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.report(HEARTBEAT_TASK, self.heartbeat_payload().model_dump(mode="json"), expires=10)
            except Exception as exc:  # Redis down: keep trying, the supervisors keep running
                log.warning("heartbeat failed: %s", exc)
            with self._registry_lock:
                jobs = {sup.req.job_id for sup in self.supervisors.values()}
            self.standbys.expire(jobs)
            self.lifetime.check_idle()
            self._stop.wait(HEARTBEAT_S)


AGENT: Agent | None = None
# A rediss:// URL's TLS options that name files: the CA (which the ranks need, read-only) and the
# node's own client certificate and key (which are the node's, never handed to a job).
_CA_OPTIONS = ("ssl_ca_certs", "ssl_ca_path")
_CLIENT_CERT_OPTIONS = ("ssl_certfile", "ssl_keyfile", "ssl_password")


def attempt_redis_url(base: str, user: str, password: str) -> tuple[str, tuple[str, ...]]:
    """(the attempt's Redis URL, the CA files its sandbox must show): the node's URL with the
    attempt's user and password, without the node's client certificate and key."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(redis_acl.url_for(base, user, password))
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in _CLIENT_CERT_OPTIONS]
    ca_files = tuple(os.path.abspath(v) for k, v in query if k in _CA_OPTIONS and v)
    return urlunsplit(parts._replace(query=urlencode(query))), ca_files


def _labels(text: str) -> dict:
    out = {}
    for part in filter(None, (text or "").split(",")):
        if "=" not in part:
            raise SystemExit(f"--labels: expected key=value pairs separated by commas, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def load_credential(path: str, name: str) -> str | None:
    """The credential in `path` (refusing a file others may read), or None without a path."""
    if not path:
        log.warning("no --credential-file: node %s's heartbeats are refused until staff approve its join request "
                    "(manage.py node_add %s, or the admin's join requests)", name, name)
        return None
    try:
        return nodeauth.read_credential_file(path)
    except nodeauth.CredentialFileError as exc:
        raise SystemExit(f"--credential-file: {exc}") from None


def sandbox_config() -> sandbox.SandboxConfig:
    """The agent's sandbox settings, checked by making one sandbox: a node where it cannot be made
    refuses to start (the message names what is missing), unless the operator set
    TRAINYARD_INSECURE_NO_SANDBOX=1, which is logged loudly at start and on every launch."""
    try:
        cfg = sandbox.SandboxConfig.from_env()
        if cfg.enabled:
            sandbox.probe(cfg)
    except sandbox.SandboxUnavailable as exc:
        raise SystemExit(f"the node agent cannot start: {exc}") from None
    if not cfg.enabled:
        log.warning("%s", "!" * 100)
        log.warning("%s=1: jobs run UNSANDBOXED, as this agent's own user: any job's code can read this node's "
                    "credentials and other jobs' files and processes", sandbox.INSECURE_ENV)
        log.warning("%s", "!" * 100)
    else:
        log.info("job sandbox: bubblewrap, uids from %d, read-only extras %s, variables passed on %s",
                 cfg.uid_base, list(cfg.ro_paths), list(cfg.pass_env))
    if os.environ.get(CHAOS_VAR):
        log.warning("%s is set: test-only fault injection is on, its directory is writable by every job", CHAOS_VAR)
    return cfg


def main(argv: list[str] | None = None) -> None:
    global AGENT
    ap = argparse.ArgumentParser(prog="python -m workers.agent", description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--address", required=True, help="address other nodes reach this one at")
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--labels", default="", help="e.g. rack=r1,zone=a")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--run-dir", default=str(keys.run_root()), help="default: TRAINYARD_RUN_DIR, else <var>/agents")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--credential-file", default=os.environ.get("TRAINYARD_NODE_CREDENTIAL_FILE", ""),
                    help="this node's credential (manage.py node_add), a 0600 file; without one the node's "
                         "heartbeats are refused and shown to staff as a join request")
    args = ap.parse_args(argv)
    if args.slots < 1:
        raise SystemExit("--slots must be at least 1")
    credential = load_credential(args.credential_file, args.name)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    gpus = start_gpu_monitor(args.device, args.slots)
    configure_node(args.name)  # before anything connects: its own unacked keys, no declarations
    AGENT = Agent(args.name, args.address, args.slots, _labels(args.labels), args.device,
                  Path(args.run_dir).resolve() / args.name, gpus, credential, sandbox_cfg=sandbox_config())
    AGENT.standbys.clean_leftovers()
    AGENT.adopt_running()
    from celery.signals import worker_shutting_down

    # A crash (SIGKILL) leaves attempts running for the next agent to re-attach; a deliberate
    # stop (SIGTERM/Ctrl-C) takes them down too, so `make run` leaves no training behind.
    worker_shutting_down.connect(lambda **_: AGENT.lifetime.on_shutdown(), weak=False)
    threading.Thread(target=AGENT.heartbeat_forever, name="heartbeat", daemon=True).start()
    # No gossip, mingle or worker heartbeat events: each would need a pub/sub channel, which the
    # node's Redis user does not have (the agent's own signed heartbeat is a task on `control`).
    app.worker_main([
        "worker", "-Q", node_queue(args.name), "-n", f"{args.name}@%h", "-P", "threads",
        "-c", str(args.concurrency), "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    ])


if __name__ == "__main__":
    from workers import agent as _agent  # run the importable module's main so tasks see AGENT

    _agent.main()
