"""The measurements of bench/telemetry.py, on the processes of bench/telemetry_stack.py: the
latency phases and the memory run (`Bench.emit`), the relay's drain throughput against the
XADD ceiling (`Bench.throughput`), CPU per process, the RSS summary, and the drain again on
PostgreSQL (`postgres_drain`).
"""
from __future__ import annotations

import json
import os
import signal
import time

from telemetry_roles import sample  # bench/ is sys.path[0] (bench/telemetry.py makes sure)
from telemetry_stack import Stack, say
from trainyard import keys


class Bench(Stack):
    """The run's processes (Stack) and the figures measured on them."""

    def backlog(self) -> int:
        return sum(self.r.xlen(keys.attempt_stream(j['job'], j['attempt'])) for j in self.jobs)

    def cpu(self) -> dict:
        """CPU seconds so far: relay, daphne, redis, the simulated ranks and clients together, and
        the whole machine (busy time over all cores): `other` = work that is not this bench's."""
        import psutil

        def used(pid):
            try:
                t = psutil.Process(pid).cpu_times()
                return t.user + t.system
            except psutil.Error:
                return 0.0

        out = {name: used(self.procs[name].pid) for name in ("relay", "daphne", "redis")}
        out["relay"] += sum(used(pid) for pid in self.relay_children())  # --relay-workers
        if self.db_pid:  # the PostgreSQL server and its backends (the relay's among them)
            try:
                server = psutil.Process(self.db_pid)
                out["postgres"] = used(self.db_pid) + sum(used(c.pid) for c in server.children(recursive=True))
            except psutil.Error:
                out["postgres"] = 0.0
        out["ranks"] = sum(used(c.proc.pid) for c in self.emitters)
        out["clients"] = sum(used(c.proc.pid) for c in self.clients)
        me = os.times()
        out["bench"] = me.user + me.system
        m = psutil.cpu_times()
        out["machine"] = m.user + m.nice + m.system + m.irq + m.softirq + m.steal
        return out

    @staticmethod
    def cpu_percent(cpu0: dict, cpu1: dict, wall: float) -> dict:
        """Percent of one core over `wall` s; `other` is what the rest of the machine used."""
        out = {k: round(100 * (cpu1[k] - cpu0[k]) / wall, 1) for k in cpu1}
        ours = sum(v for k, v in out.items() if k != "machine")
        out["other"] = round(max(0.0, out["machine"] - ours), 1)
        return out

    def clients_phase(self, min_step: int) -> None:
        for c in self.clients:
            c.ask({"cmd": "phase", "min_step": min_step})

    def wait_clients(self, expected_per_job: dict[int, int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = True
            for c, job in zip(self.clients, [j for j in self.jobs for _ in range(self.args.clients)]):
                got = c.ask({"cmd": "peek"})
                if got["count"] + got["window_samples"] < expected_per_job[job["job"]]:
                    done = False
            if done:
                return
            time.sleep(0.2)

    def client_reports(self) -> dict:
        reps = [c.ask({"cmd": "report"}) for c in self.clients]
        lat = {}
        # Percentiles over all clients: each client's own percentiles, and the worst of them.
        for key in ("p50_ms", "p90_ms", "p99_ms", "max_ms"):
            vals = [r[key] for r in reps if r[key] is not None]
            lat[key] = max(vals) if vals else None
        return {"worst_client": lat, "clients": reps,
                "received": sum(r["count"] for r in reps),
                "window_messages": sum(r["windows"] for r in reps)}

    def emit(self, rate: float, duration: float, rss_every: float | None = None) -> dict:
        """All ranks emit `rate` samples/s in total for `duration` s, then every client gets
        everything (or 15 s pass). Returns the phase's figures."""
        per_rank = rate / len(self.emitters)
        start_step = self.step
        self.clients_phase(start_step)
        cpu0, t0 = self.cpu(), time.monotonic()
        start_at = time.time() + 0.2
        for e in self.emitters:
            e.send({"cmd": "run", "rate": per_rank, "duration": duration, "start_step": start_step,
                    "start_at": start_at})
        rss: list[tuple[float, float, float]] = []
        backlog_max = 0
        if rss_every:
            rss, backlog_max = self.sample_rss(duration + 0.2, rss_every)
        else:
            end = time.monotonic() + duration + 0.2
            while time.monotonic() < end:
                backlog_max = max(backlog_max, self.backlog())
                time.sleep(0.25)
        results = [e.recv() for e in self.emitters]
        t_emitted = time.monotonic()
        backlog_end = self.backlog()
        self.wait(lambda: self.backlog() == 0, 120, "relay to drain")
        t_drained = time.monotonic()
        self.step = max(r["last_step"] for r in results) + 1
        sent_per_job = {}
        for e, r in zip(self.emitters, results):
            job = int(e.name.split("-")[1])
            sent_per_job[job] = sent_per_job.get(job, 0) + r["sent"]
        self.wait_clients(sent_per_job, 15)
        cpu1 = self.cpu()
        wall = time.monotonic() - t0
        sent = sum(r["sent"] for r in results)
        out = {
            "target_samples_per_s": rate, "duration_s": duration,
            "emitted_samples_per_s": round(sent / max(r["emit_s"] for r in results), 1),
            "sent": sent, "dropped_at_reporter": sum(r["dropped"] for r in results),
            "backlog_entries_max": backlog_max, "backlog_entries_at_end": backlog_end,
            "drain_after_emit_s": round(t_drained - t_emitted, 2),
            "cpu_percent": self.cpu_percent(cpu0, cpu1, wall),
        }
        out.update(self.client_reports())
        out["received_fraction"] = round(out["received"] / (sent * self.args.clients), 4) if sent else None
        if rss:
            out["rss"] = rss
        return out

    def sample_rss(self, duration: float, every: float) -> list:
        import psutil

        procs = {n: [psutil.Process(self.procs[n].pid)] for n in ("relay", "daphne")}
        procs["relay"] += [psutil.Process(pid) for pid in self.relay_children()]  # --relay-workers: all of them
        t0 = time.monotonic()
        out, backlog_max, next_rss = [], 0, 0.0
        while True:  # RSS every `every` s, the relay's backlog every 0.5 s
            now = time.monotonic() - t0
            backlog_max = max(backlog_max, self.backlog())
            if now >= next_rss or now >= duration:
                out.append((round(now, 1), *(round(sum(p.memory_info().rss for p in ps) / 2**20, 2)
                                             for ps in procs.values())))
                next_rss += every
            if now >= duration:
                return out, backlog_max
            time.sleep(min(0.5, max(0.05, duration - now)))

    def throughput(self, n_samples: int, entry_samples: int) -> dict:
        """Pause the relay, XADD a backlog as fast as possible (the ceiling), resume, time the drain."""
        per_stream = n_samples // len(self.jobs)
        start_step = self.step
        self.clients_phase(start_step)
        self.signal_relay(signal.SIGSTOP)
        try:
            # Payloads are serialised up front: this measures Redis taking entries, not json.dumps.
            payloads = []
            for job in self.jobs:
                entries = []
                ranks = self.args.drain_ranks or self.args.ranks  # simulated in the backlog: no process each
                steps_per_rank = per_stream // ranks
                for base in range(0, steps_per_rank, entry_samples):
                    for rank in range(ranks):
                        batch = [sample(rank, start_step + base + k, job["attempt"], time.time())
                                 for k in range(min(entry_samples, steps_per_rank - base))]
                        entries.append(json.dumps(batch, separators=(",", ":")))
                payloads.append((keys.attempt_stream(job['job'], job['attempt']), entries))
            total = sum(len(e) for _, e in payloads) * entry_samples
            t0 = time.perf_counter()
            pipe = self.r.pipeline(transaction=False)
            queued = 0
            for stream, entries in payloads:
                for data in entries:
                    pipe.xadd(stream, {"type": "metrics", "data": data})
                    queued += 1
                    if queued % 200 == 0:
                        pipe.execute()
            pipe.execute()
            xadd_s = time.perf_counter() - t0
        finally:
            cpu0 = self.cpu()
            t1 = time.monotonic()
            self.signal_relay(signal.SIGCONT)
        entries_total = self.backlog()
        self.wait(lambda: self.backlog() == 0, 600, "relay to drain the backlog")
        drain_s = time.monotonic() - t1
        cpu1 = self.cpu()
        self.step = start_step + per_stream // (self.args.drain_ranks or self.args.ranks) + 1
        expected = {j["job"]: total // len(self.jobs) for j in self.jobs}
        self.wait_clients(expected, 30)
        ws_s = time.monotonic() - t1
        out = {
            "backlog_samples": total, "backlog_entries": entries_total, "samples_per_entry": entry_samples,
            "ranks_per_job": self.args.drain_ranks or self.args.ranks,
            "raw_xadd_samples_per_s": round(total / xadd_s), "raw_xadd_entries_per_s": round(entries_total / xadd_s),
            "relay_drain_s": round(drain_s, 2), "relay_samples_per_s": round(total / drain_s),
            "all_clients_done_s": round(ws_s, 2),
            "cpu_percent": self.cpu_percent(cpu0, cpu1, drain_s),
        }
        reps = self.client_reports()
        out["client_received_live"] = reps["received"]
        out["client_received_in_windows"] = sum(c["window_samples"] for c in reps["clients"])
        out["client_window_messages"] = reps["window_messages"]
        out["relay_vs_ceiling"] = round(out["relay_samples_per_s"] / out["raw_xadd_samples_per_s"], 3)
        return out


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points) or 1.0
    return round(60 * sum((p[0] - mx) * (p[1] - my) for p in points) / sxx, 3)


def memory_summary(rss: list) -> dict:
    out = {}
    for i, name in ((1, "relay"), (2, "daphne")):
        pts = [(p[0], p[i]) for p in rss]
        half = [q for q in pts if q[0] >= pts[-1][0] / 2]
        out[name] = {"start_rss_mib": pts[0][1], "end_rss_mib": pts[-1][1], "max_rss_mib": max(q[1] for q in pts),
                     "slope_mib_per_min": slope_mib_per_min(pts),
                     "slope_second_half_mib_per_min": slope_mib_per_min(half)}
    step = max(1, len(rss) // 20)
    out["series_s_relay_daphne_mib"] = rss[::step] + ([rss[-1]] if (len(rss) - 1) % step else [])
    return out


def postgres_drain(args, sqlite: dict | None) -> dict:
    """The throughput (drain) phase again, on a real PostgreSQL server (tests/postgres.py: Debian's
    server in a temporary directory, fsync off as in the tests, so the figure is the relay's and
    the database's CPU, not the disk's), next to SQLite's figure and the ratio."""
    from tests.postgres import PostgresServer, postgres_bin_dir

    server = PostgresServer().start()
    try:
        url = server.create_database("bench")
        bench = Bench(args, db_env={"DATABASE_URL": url}, db_pid=server.proc.pid)
        try:
            bench.start()
            bench.emit(1000, args.warmup_s)
            say(f"throughput on PostgreSQL: backlog of {args.drain_samples} samples")
            pg = bench.throughput(args.drain_samples, args.entry_samples)
            say(f"  {pg}")
        finally:
            bench.stop()
    finally:
        server.stop()
    out = {"server": str(postgres_bin_dir()), "settings": "fsync=off synchronous_commit=off", "throughput": pg}
    if sqlite:
        out["relay_samples_per_s"] = {"sqlite": sqlite["relay_samples_per_s"], "postgres": pg["relay_samples_per_s"]}
        out["postgres_vs_sqlite"] = round(pg["relay_samples_per_s"] / sqlite["relay_samples_per_s"], 3)
    return out
