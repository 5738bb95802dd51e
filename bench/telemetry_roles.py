"""The load of bench/telemetry.py: the processes it starts as `bench/telemetry.py --role ...`,
one per simulated rank (`emitter`: the runtime's own `trainyard.sdk.reporter.Reporter`, emitting
open loop on schedule, sample `ts` = emit time) and one per websocket client (`client`: the
`websockets` package, token auth, no Origin, acking every message, measuring receive time - `ts`).
Each reads one JSON command per line on stdin and answers one JSON line on stdout.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
from array import array


def pct(sorted_vals, q: float):
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, int(round(q / 100 * (len(sorted_vals) - 1)))))
    return round(sorted_vals[i], 2)


def sample(rank: int, step: int, attempt: int, ts: float) -> dict:
    """The runtime's per-step sample (workers/runtime/trainer.py), plausible values."""
    step_s = 0.04 + random.random() * 0.002
    return {"rank": rank, "step": step, "ts": ts, "loss": 5.5 / (1 + step * 1e-3),
            "samples_per_s": 16 / step_s, "tokens_per_s": 16 * 128 / step_s, "step_s": step_s,
            "data_s": 0.001, "compute_s": step_s - 0.008, "comm_s": 0.006, "optim_s": 0.001,
            "bytes_sent": 1_048_576, "mem_bytes": 512_000_000 + step, "attempt": attempt}


# ------------------------------------------------------------------ role: emitter (one rank)
def run_emitter(args) -> None:
    """One simulated rank. Commands on stdin (one JSON per line), one JSON reply per command."""
    from trainyard.sdk.reporter import Reporter

    rep = Reporter(args.redis, args.stream, rank=args.rank, attempt=args.attempt)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        rate, total, step = cmd["rate"], int(cmd["rate"] * cmd["duration"]), cmd["start_step"]
        sent0 = rep.sent_samples
        t0 = time.time() + max(0.0, cmd.get("start_at", 0) - time.time())
        time.sleep(max(0.0, t0 - time.time()))
        n = 0
        while n < total:  # open loop: emit on schedule whatever the rest of the system does
            due = min(total, int((time.time() - t0) * rate) + 1)
            while n < due:
                rep.metric(sample(args.rank, step + n, args.attempt, time.time()))
                n += 1
            wait = t0 + n / rate - time.time()
            if wait > 0:  # at least 1 ms: a 5k steps/s rank emits ~5 samples a wake (ts still = emit time)
                time.sleep(max(wait, 0.001))
        emit_s = time.time() - t0
        deadline = time.monotonic() + 30
        while (rep.buffered or not rep._inbox.empty()) and time.monotonic() < deadline:
            time.sleep(0.005)
        print(json.dumps({"emitted": n, "sent": rep.sent_samples - sent0, "emit_s": emit_s,
                          "dropped": rep.dropped_samples, "last_step": step + n - 1}), flush=True)
    rep.close()


# ------------------------------------------------------------------ role: websocket client
def run_client(args) -> None:
    asyncio.run(_client(args))


async def _client(args) -> None:
    from websockets.asyncio.client import connect

    loop = asyncio.get_running_loop()
    cmds: asyncio.Queue = asyncio.Queue()

    def read_stdin():
        for line in sys.stdin:
            loop.call_soon_threadsafe(cmds.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(cmds.put_nowait, {"cmd": "quit"})

    threading.Thread(target=read_stdin, daemon=True).start()
    st = {"min_step": 1 << 62, "lat": array("f"), "count": 0, "messages": 0, "windows": 0,
          "window_samples": 0, "errors": 0, "bytes": 0}
    url = f"ws://127.0.0.1:{args.port}/ws/jobs/{args.job}/"
    async with connect(url, additional_headers={"Authorization": f"Token {args.token}"},
                       max_size=None, max_queue=None, compression=None, open_timeout=30) as ws:
        async def receiver():
            async for raw in ws:
                now = time.time()
                msg = json.loads(raw)
                seq = msg.get("seq")
                if seq is not None:
                    await ws.send(json.dumps({"type": "ack", "seq": seq}))
                kind = msg.get("type")
                if kind == "snapshot":
                    print(json.dumps({"ready": True}), flush=True)
                    continue
                st["messages"] += 1
                st["bytes"] += len(raw)
                if kind == "telemetry":
                    lo, lat = st["min_step"], st["lat"]
                    for s in msg["samples"]:
                        if s["step"] >= lo:
                            lat.append((now - s["ts"]) * 1000.0)
                    st["count"] = len(st["lat"])
                elif kind == "window":
                    st["windows"] += 1
                    st["window_samples"] += sum(1 for s in msg["samples"] if s["step"] >= st["min_step"])
                elif kind == "error":
                    st["errors"] += 1

        task = asyncio.create_task(receiver())
        while True:
            cmd = await cmds.get()
            if cmd["cmd"] == "phase":
                st.update(min_step=cmd["min_step"], lat=array("f"), count=0, messages=0, windows=0,
                          window_samples=0, errors=0, bytes=0)
                print(json.dumps({"ok": True}), flush=True)
            elif cmd["cmd"] == "peek":
                print(json.dumps({"count": st["count"], "window_samples": st["window_samples"]}), flush=True)
            elif cmd["cmd"] == "report":
                lat = sorted(st["lat"])
                print(json.dumps({"count": len(lat), "messages": st["messages"], "windows": st["windows"],
                                  "window_samples": st["window_samples"], "errors": st["errors"],
                                  "bytes": st["bytes"], "p50_ms": pct(lat, 50), "p90_ms": pct(lat, 90),
                                  "p99_ms": pct(lat, 99), "max_ms": pct(lat, 100),
                                  "alive": not task.done()}), flush=True)
            elif cmd["cmd"] == "quit":
                task.cancel()
                return

