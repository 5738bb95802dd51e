"""The relay's way to the browsers: committed samples to the Channels groups `job.<id>`, in order,
from one long-lived event loop thread (jobs/telemetry/relay.py hands them over)."""
from __future__ import annotations

import asyncio
import logging
import threading

import orjson

log = logging.getLogger("trainyard.relay")


def telemetry_message(samples: list[dict]) -> dict:
    """The `job.telemetry` group message: the samples already encoded as the JSON array that every
    socket of the group sends as is (jobs.runs.consumers splices it into the frame), so neither msgpack
    in channels_redis nor json in daphne walks each sample once per client; `first_step` is what
    a congested consumer needs to know about the batch it skips."""
    steps = [s["step"] for s in samples if type(s.get("step")) is int]
    return {"type": "job.telemetry", "samples_json": orjson.dumps(samples).decode(),
            "first_step": min(steps) if steps else 0, "count": len(samples)}


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
