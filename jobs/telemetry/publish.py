"""The relay's way to the browsers: each round's committed telemetry to the Channels groups `job.<id>`, in
order, from one long-lived event loop thread (jobs/telemetry/relay.py hands them over).

Since issue 26 a job's group gets, per round, the round's steps as reduced across ranks (read back from
MetricStep after the commit, one SELECT for every job of the round) and the samples of its few named
ranks only (jobs/telemetry/reduced.py), not every rank's sample: what a browser receives per step no
longer grows with the number of ranks."""
from __future__ import annotations

import asyncio
import logging
import threading

import orjson

from jobs.telemetry import reduced
from jobs.telemetry.reduced import NamedTracker  # the relay's named ranks, per job
from jobs.telemetry.rollup import Reduced

__all__ = ["ChannelsPublisher", "NamedTracker", "reduced_message", "reduced_messages"]

log = logging.getLogger("trainyard.relay")


PUBLISH_MAX_STEPS = 200  # step rows per message: at most ~160 KB of JSON
# Steps of one attempt a round publishes at most: its newest ones. Live, a round touches a few steps;
# only a relay catching up a backlog commits thousands of one attempt's steps in a round, and turning
# each into its wire row cost more than committing it (a 2-rank backlog: half the relay's time). A
# chart holds ~1,500 points, and the page's next snapshot or catch-up window reads the rest.
LIVE_STEPS_PER_ROUND = 500


def _round_steps(per_job: list[tuple[int, list[dict]]], committed: Reduced | None) -> list[dict]:
    """The step rows of the (attempt, step)s a round touched, at most the newest LIVE_STEPS_PER_ROUND of
    each attempt, sorted by (job, step), each with its "job": with `committed` (the round's reduction as
    the fast path stored it, rollup.Reduced) its steps, built from it but for the ones that merged into
    a row already stored, which are read back; without, every step any sample names, read back."""
    keys: dict[int, set[int]] = {}
    if committed is None:
        for _, samples in per_job:
            for s in samples:
                attempt, step = s.get("attempt"), s.get("step")
                if type(attempt) is int and type(step) is int:
                    keys.setdefault(attempt, set()).add(step)
        for attempt, steps in keys.items():
            if len(steps) > LIVE_STEPS_PER_ROUND:
                keys[attempt] = set(sorted(steps)[-LIVE_STEPS_PER_ROUND:])
        return reduced.steps_of(keys)
    newest, runs = [], {}  # the rows are in (attempt, step) order
    for i, row in enumerate(committed.rows):
        runs.setdefault(row[1], [i, i])[1] = i
    for first, last in runs.values():
        newest += committed.rows[max(first, last + 1 - LIVE_STEPS_PER_ROUND):last + 1]
    fresh = [row for row in newest if (row[1], row[2]) not in committed.merged]
    for attempt, step in committed.merged:
        keys.setdefault(attempt, set()).add(step)
    out = reduced.steps_from(fresh) + (reduced.steps_of(keys) if keys else [])
    out.sort(key=lambda r: (r["job"], r["step"], r["attempt"]))
    return out


def reduced_messages(per_job: list[tuple[int, list[dict]]], tracker: reduced.NamedTracker, *,
                     max_samples: int = 500, max_steps: int = PUBLISH_MAX_STEPS,
                     committed: Reduced | None = None) -> list[tuple[int, dict]]:
    """(job id, `job.telemetry` message) for a committed round's samples per job: the (attempt, step)s
    they touched as MetricStep holds them after the commit (_round_steps: `committed` is the round's
    reduction, if the fast path stored it; a step whose ranks arrive over several rounds is sent again
    with its merged reduction; browsers replace it), the job's named ranks as `tracker` counts them, and
    the samples of those ranks (every rank's in a job of at most SMALL_WORLD ranks)."""
    by_job: dict[int, list[dict]] = {}
    for row in _round_steps(per_job, committed):
        by_job.setdefault(row.pop("job"), []).append(row)
    out = []
    for job_id, samples in per_job:
        rows = by_job.get(job_id, [])
        if not rows:
            continue  # nothing of it committed (replays, unknown attempts)
        named = tracker.update(job_id, rows)
        ranks = reduced.named_rank_set(named)
        kept = samples if ranks is None else [s for s in samples if s.get("rank") in ranks]
        first_samples, rest = kept[:max_samples], kept[max_samples:]
        for i in range(0, len(rows), max_steps):
            out.append((job_id, reduced_message(rows[i:i + max_steps], first_samples if i == 0 else [], named)))
        for j in range(0, len(rest), max_samples):
            out.append((job_id, reduced_message([], rest[j:j + max_samples], named)))
    return out


def reduced_message(steps: list[dict], samples: list[dict], named: dict) -> dict:
    """The `job.telemetry` group message: step rows, samples and the named ranks already encoded as JSON
    text that every socket of the group sends as is (jobs.runs.consumers splices them into the frame), so
    neither msgpack in channels_redis nor json in daphne walks a row once per client; `first_step` is
    what a congested consumer needs to know about the batch it skips."""
    first = [r["step"] for r in steps] + [s["step"] for s in samples if type(s.get("step")) is int]
    return {"type": "job.telemetry", "steps_json": orjson.dumps(steps).decode(),
            "samples_json": orjson.dumps(samples).decode(), "named_json": orjson.dumps(named).decode(),
            "first_step": min(first) if first else 0, "count": len(steps) + len(samples)}


class ChannelsPublisher:
    """Sends to Channels groups from one long-lived event loop thread, in submission order.

    dispatch.publish (async_to_sync) builds a new event loop, thread and Redis connection for
    every message; here one loop keeps channels_redis' connection pool. The relay thread only
    enqueues; at most `max_queued` messages wait, after that it blocks, so a stalled channel
    layer slows the relay down instead of growing its memory. Delivery is best effort, as in
    dispatch.publish: a browser that misses a live message is repaired by its next snapshot."""

    def __init__(self, max_queued: int = 256):
        self._slots = threading.BoundedSemaphore(max_queued)
        self._loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue | None = None
        self._ready = threading.Event()
        self.errors = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="relay-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._queue = asyncio.Queue()
        self._task = self._loop.create_task(self._sender())
        self._ready.set()
        self._loop.run_forever()

    async def _sender(self) -> None:
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        while True:
            group, message = await self._queue.get()
            try:
                await layer.group_send(group, message)
                self.sent += 1
            except Exception as exc:  # Redis briefly away: the state is in the database
                self.errors += 1
                if self.errors == 1 or self.errors % 100 == 0:
                    log.warning("publish to %s failed (%d failures so far): %s", group, self.errors, exc)
            finally:
                self._queue.task_done()
                self._slots.release()

    def __call__(self, group: str, message: dict) -> None:
        if not self._slots.acquire(timeout=10):
            self.errors += 1
            log.warning("publisher stalled for 10 s; dropping a message to %s", group)
            return
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (group, message))

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (for at most timeout_s), then stop the loop."""
        async def drain():
            await self._queue.join()
            self._task.cancel()

        try:
            asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout_s)
        except Exception:
            log.warning("publisher closed with messages unsent")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
