"""A malicious ordinary user's training script (issue 21's hostile-job suite): it trains a few
steps through the SDK like any job, then tries everything a job must not be able to do to the node,
the control plane or another user's job, and prints one line per probe:

    PROBE {"name": ..., "reached": true|false, "detail": "..."}

`reached` is true when the probe got through (it read the secret, wrote the other job's stream,
signalled the process...). The targets come from the job's `config` (the test knows them).
"""
from __future__ import annotations

import json
import os
import signal

import redis
import torch

import trainyard


def report(name: str, reached: bool, detail: object = "") -> None:
    print("PROBE " + json.dumps({"name": name, "reached": bool(reached), "detail": str(detail)[:300]}), flush=True)


def try_read(name: str, path: str) -> None:
    try:
        with open(path, "rb") as f:
            data = f.read(64)
        report(name, True, f"read {len(data)} bytes of {path}")
    except OSError as exc:
        report(name, False, f"{type(exc).__name__}: {exc}")


def try_list_and_write(name: str, path: str) -> None:
    try:
        listing = os.listdir(path)
        report(name + "_list", True, f"{path}: {listing[:5]}")
    except OSError as exc:
        report(name + "_list", False, f"{type(exc).__name__}: {exc}")
    try:
        with open(os.path.join(path, "planted-by-hostile-job"), "w") as f:
            f.write("x")
        report(name + "_write", True, path)
    except OSError as exc:
        report(name + "_write", False, f"{type(exc).__name__}: {exc}")


def try_redis(name: str, client: redis.Redis, *command) -> None:
    try:
        out = client.execute_command(*command)
        report(name, True, f"{command[0]} answered {str(out)[:100]}")
    except redis.RedisError as exc:
        report(name, False, f"{type(exc).__name__}: {exc}")


def try_signal(name: str, pid: int) -> None:
    try:
        os.kill(int(pid), 0)  # permission and existence, without harming anything
        report(name, True, f"pid {pid} can be signalled")
    except OSError as exc:
        report(name, False, f"{type(exc).__name__}: {exc}")


def probe_node_identity(launch: dict) -> None:
    leaked = [k for k in ("REDIS_URL", "TRAINYARD_VAR_DIR", "TRAINYARD_NODE_CREDENTIAL_FILE", "DJANGO_SECRET_KEY",
                          "TRAINYARD_DB", "DATABASE_URL") if k in os.environ]
    report("env_node_secrets", bool(leaked), leaked)
    user = redis.Redis.from_url(launch["redis_url"]).connection_pool.connection_kwargs.get("username") or ""
    report("config_holds_the_nodes_redis_user", not user.startswith("trainyard-attempt-"), user)


def probe_files(targets: dict) -> None:
    for name, path in targets["read"].items():
        try_read(name, path)
    for name, path in targets["dirs"].items():
        try_list_and_write(name, path)


def probe_bus(launch: dict, targets: dict) -> None:
    client = redis.Redis.from_url(launch["redis_url"], socket_timeout=5)
    victim = targets["victim"]
    for stream in victim["streams"]:
        try_redis(f"xadd_victim_stream:{stream}", client, "XADD", stream, "*", "type", "metrics", "data", json.dumps(
            [{"attempt": victim["attempt"], "rank": 0, "step": 10**9, "ts": 1.0, "loss": 0.0}]))
        try_redis(f"read_victim_stream:{stream}", client, "XRANGE", stream, "-", "+", "COUNT", "1")
    # A planted checkpoint for the victim: a complete-looking directory in its checkpoint
    # directory, and the report that would register it.
    planted = os.path.join(victim["checkpoint_dir"], f"step-99999999-a{victim['attempt']}")
    try:
        os.makedirs(planted)
        with open(os.path.join(planted, "trainyard.json"), "w") as f:
            json.dump({"format": 1, "job_id": victim["job"], "attempt_id": victim["attempt"], "step": 99999999,
                       "world_size": 2, "files": {"x.distcp": 1}}, f)
        with open(os.path.join(planted, "x.distcp"), "w") as f:
            f.write("x")
        report("plant_victim_checkpoint_files", True, planted)
    except OSError as exc:
        report("plant_victim_checkpoint_files", False, f"{type(exc).__name__}: {exc}")
    for stream in victim["streams"]:
        try_redis(f"register_planted_checkpoint:{stream}", client, "XADD", stream, "*", "type", "event", "data",
                  json.dumps({"kind": "checkpoint", "attempt": victim["attempt"], "rank": 0, "step": 99999999,
                              "path": planted}))
    fence = json.dumps({"reason": "hostile", "grace_s": 0.0, "fenced": True})
    try_redis("set_victim_preempt_key", client, "SET", f"trainyard:preempt:{victim['attempt']}", fence, "EX", "5")
    try_redis("client_pause", client, "CLIENT", "PAUSE", "1")
    try_redis("client_list", client, "CLIENT", "LIST")
    try_redis("client_kill", client, "CLIENT", "KILL", "ID", "999999")
    try_redis("read_control_queue", client, "LRANGE", "control", "0", "0")
    try_redis("push_control_queue", client, "LPUSH", "control.hostile-probe", "x")
    try_redis("keys", client, "KEYS", "trainyard:*")
    try_redis("scan", client, "SCAN", "0")
    try_redis("acl_list", client, "ACL", "LIST")


def probe_processes(targets: dict) -> None:
    for name, pid in targets["pids"].items():
        try_signal(name, pid)
    try:  # what this job can see of the node's processes at all
        visible = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        report("sees_host_processes", len(visible) > 50 or any(p in visible for p in targets["pids"].values()),
                f"{len(visible)} pids")
    except OSError as exc:
        report("sees_host_processes", False, exc)


def main() -> None:
    run = trainyard.init()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = run.restore({"model": model, "optim": opt})
    for step in range(start + 1, 6):  # its own telemetry and checkpoints still work
        loss = model(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        run.log(step, loss=float(loss), samples=2)
        if run.should_checkpoint(step):
            run.checkpoint(step, {"model": model, "optim": opt})
    if run.rank == 0:
        with open(os.environ["TRAINYARD_RUN_CONFIG"]) as f:
            launch = json.load(f)
        targets = run.config["targets"]
        for probe in (lambda: probe_node_identity(launch), lambda: probe_files(targets),
                      lambda: probe_bus(launch, targets), lambda: probe_processes(targets)):
            try:
                probe()
            except Exception as exc:  # one broken probe must not hide the others' results
                report("probe_crashed", True, repr(exc))
        print("PROBES DONE", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run.finish()


if __name__ == "__main__":
    main()
