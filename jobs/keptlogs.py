"""Logs kept after the job: every rank's full output, per attempt, in a plain text file under the
artifact root (`keys.rank_log_path`: <root>/logs/job-<id>/attempt-<a>/rank-<r>.log).

Writing: the relay hands each round's log lines to a `LogKeeper`, whose one background thread
appends them (all lines of a file in one write, one open per file per batch). The relay never waits
on the disk for more than `SUBMIT_WAIT_S`: with the queue full it drops that round's lines for the
disk (counted, logged; the live view and the Redis list still get them). Disk errors are logged and
counted, never raised into the relay.

The cap: a job's kept files together hold at most `max_bytes` (TRAINYARD_LOG_MAX_BYTES_PER_JOB).
When an append would pass it, the oldest half of the job's largest file is cut off (repeatedly, until
the append fits), and the file's sidecar `rank-<r>.log.dropped` ({"lines", "bytes"}) counts what was
cut, so line offsets stay stable: offset N is the N-th line the rank ever printed in that attempt,
and the first `lines` of them are gone. The API says so (`dropped_lines`, `note`).

Reading: `read_page` pages one file by line offset through a line index kept in memory per file
(marks every ~1 MiB: one pass over a file the first time, then only what it grew by; a page is a
seek and at most ~1 MiB of reading), `kept_index` lists the attempts and ranks a job has files for.
A line still being written (no newline yet) is not counted.

Delivery is at least once: a relay killed after its commit but before its XACK re-reads those
entries and appends their lines again (as it pushes them again to the Redis list).
"""
from __future__ import annotations

import bisect
import logging
import os
import queue
import re
import shutil
import threading
from collections import OrderedDict
from pathlib import Path

import orjson

from trainyard import keys

log = logging.getLogger("trainyard.relay")

DEFAULT_MAX_BYTES_PER_JOB = 200 * 1024 * 1024
SUBMIT_WAIT_S = 0.5  # the longest the relay waits for room in the writer's queue
CHUNK = 1 << 20
PAGE_MAX_BYTES = 4 << 20  # a page stops early rather than answer more than this
DROPPED_SUFFIX = ".dropped"
_RANK_FILE = re.compile(r"rank-(\d+)\.log")
_ATTEMPT_DIR = re.compile(r"attempt-(\d+)")

Lines = dict[tuple[int, int, int], list[str]]  # (job, attempt, rank) -> lines, in order


def dropped_path(path: Path) -> Path:
    return path.with_name(path.name + DROPPED_SUFFIX)


def read_dropped(path: Path) -> dict:
    """What the cap cut from the front of one kept file: {"lines": n, "bytes": n}."""
    try:
        data = orjson.loads(dropped_path(path).read_bytes())
        return {"lines": int(data["lines"]), "bytes": int(data["bytes"])}
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return {"lines": 0, "bytes": 0}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def job_files(root: Path, job_id: int) -> list[Path]:
    """Every kept log file of a job (all attempts, all ranks)."""
    base = keys.job_log_dir(root, job_id)
    return sorted(p for p in base.glob("attempt-*/rank-*.log") if _RANK_FILE.fullmatch(p.name))


class LogKeeper:
    """Appends log lines to the kept files from one thread; the caller only enqueues."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES_PER_JOB, *, max_queued: int = 256,
                 thread: bool = True):
        self.root, self.max_bytes = Path(root), int(max_bytes)
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._job_bytes: dict[int, int] = {}
        self.stats = {"lines_written": 0, "lines_dropped_queue": 0, "lines_cut_by_cap": 0, "lines_write_errors": 0}
        self._thread = None
        if thread:
            self._thread = threading.Thread(target=self._run, name="relay-logkeeper", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ the relay's side
    def submit(self, lines: Lines) -> bool:
        """Queue one round's lines; False (and counted) when the writer is too far behind."""
        if not lines:
            return True
        if self._thread is None:
            self.write(lines)
            return True
        try:
            self._queue.put(lines, timeout=SUBMIT_WAIT_S)
            return True
        except queue.Full:
            n = sum(map(len, lines.values()))
            self.stats["lines_dropped_queue"] += n
            log.warning("kept logs: the disk writer is behind; %d lines not kept on disk (%d so far)", n,
                        self.stats["lines_dropped_queue"])
            return False

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued is written (tests, shutdown)."""
        if self._thread is None:
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None and self.flush(timeout_s):
            self._queue.put(None)
            self._thread.join(timeout_s)

    # ------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch: Lines = {}
            waiters, stop = [], False
            while True:  # everything queued by now goes out in one pass: one open per file
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    waiters.append(item)
                else:
                    for key, lines in item.items():
                        batch.setdefault(key, []).extend(lines)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self.write(batch)
            for w in waiters:
                w.set()
            if stop:
                return

    def write(self, batch: Lines) -> None:
        """Append each file's lines with one open and one write; never raises."""
        for (job_id, attempt_id, rank), lines in batch.items():
            try:
                self._append(job_id, attempt_id, rank, lines)
            except Exception as exc:  # a full or read-only disk: the relay goes on
                self.stats["lines_write_errors"] += len(lines)
                self._job_bytes.pop(job_id, None)  # re-count from disk next time
                log.warning("kept logs: cannot write job %s attempt %s rank %s: %s", job_id, attempt_id, rank, exc)

    def _used(self, job_id: int) -> int:
        if job_id not in self._job_bytes:
            self._job_bytes[job_id] = sum(p.stat().st_size for p in job_files(self.root, job_id))
        return self._job_bytes[job_id]

    def _append(self, job_id: int, attempt_id: int, rank: int, lines: list[str]) -> None:
        path = keys.rank_log_path(self.root, job_id, attempt_id, rank)
        data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
        if len(data) > self.max_bytes // 2:  # one batch bigger than half the cap: keep its newest lines
            cut = data.find(b"\n", len(data) - self.max_bytes // 2) + 1
            skipped = data[:cut].count(b"\n")
            self._cut_whole(job_id, path, extra_lines=skipped, extra_bytes=cut)
            data = data[cut:]
        while self._used(job_id) + len(data) > self.max_bytes and self._cut_largest(job_id):
            pass
        used = self._used(job_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
        self._job_bytes[job_id] = used + len(data)
        self.stats["lines_written"] += len(lines)

    def _cut_largest(self, job_id: int) -> bool:
        """Cut the oldest half of the job's largest kept file; False when there is nothing to cut."""
        used = self._used(job_id)
        sized = [(p.stat().st_size, p) for p in job_files(self.root, job_id)]
        sized = [(s, p) for s, p in sized if s > 0]
        if not sized:
            return False
        size, path = max(sized)
        with open(path, "rb") as f:
            f.seek(size // 2)
            f.readline()  # to the end of the line the middle falls in
            keep_from = f.tell()
            f.seek(0)
            lines = 0
            left = keep_from
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    break
                lines += chunk.count(b"\n")
                left -= len(chunk)
            tmp = path.with_name(path.name + ".cut")
            with open(tmp, "wb") as out:
                f.seek(keep_from)
                shutil.copyfileobj(f, out, CHUNK)
        self._record_drop(path, lines, keep_from)
        os.replace(tmp, path)
        self._job_bytes[job_id] = used - keep_from
        log.info("kept logs: job %s over its %d-byte cap; cut the oldest %d lines (%d bytes) of %s", job_id,
                 self.max_bytes, lines, keep_from, path)
        return True

    def _cut_whole(self, job_id: int, path: Path, *, extra_lines: int, extra_bytes: int) -> None:
        """Drop all of a file (and the head of the batch about to be appended to it)."""
        used = self._used(job_id)
        size = path.stat().st_size if path.exists() else 0
        lines = 0
        if size:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    lines += chunk.count(b"\n")
        self._record_drop(path, lines + extra_lines, size + extra_bytes)
        if size:
            _write_atomic(path, b"")  # a new file: readers holding the old one keep reading it
            self._job_bytes[job_id] = used - size

    def _record_drop(self, path: Path, lines: int, nbytes: int) -> None:
        before = read_dropped(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(dropped_path(path), orjson.dumps({"lines": before["lines"] + lines,
                                                        "bytes": before["bytes"] + nbytes}))
        self.stats["lines_cut_by_cap"] += lines


# ---------------------------------------------------------------- reading (the logs API)

def kept_index(root: Path, job_id: int) -> dict[int, list[int]]:
    """attempt id -> ranks with a kept file, both ascending."""
    out: dict[int, list[int]] = {}
    for p in job_files(root, job_id):
        a, r = _ATTEMPT_DIR.fullmatch(p.parent.name), _RANK_FILE.fullmatch(p.name)
        if a and r:
            out.setdefault(int(a.group(1)), []).append(int(r.group(1)))
    return {a: sorted(rs) for a, rs in sorted(out.items())}


class _LineIndex:
    """Where a file's lines start, every ~CHUNK bytes: (byte offset, line number) marks up to `end`,
    the byte after its last complete line. Built once per file (inode) and extended as it grows, so
    paging a finished job's 200 MB file costs one pass, then a seek and at most ~1 MiB per page."""

    def __init__(self, ino: int, dropped: int):
        self.ino, self.dropped, self.end, self.lines = ino, dropped, 0, 0
        self.marks: list[tuple[int, int]] = [(0, 0)]

    def extend(self, f) -> None:
        f.seek(self.end)
        pos = self.end
        while chunk := f.read(CHUNK):
            n = chunk.count(b"\n")
            if n:
                self.lines += n
                self.end = pos + chunk.rfind(b"\n") + 1
                if self.end - self.marks[-1][0] >= CHUNK:
                    self.marks.append((self.end, self.lines))
            pos += len(chunk)

    def read(self, f, first: int, count: int) -> list[bytes]:
        """Lines first..first+count-1 (complete lines only, at most PAGE_MAX_BYTES of them)."""
        if first >= self.lines or count <= 0:
            return []
        offset, line_no = self.marks[bisect.bisect_right(self.marks, first, key=lambda m: m[1]) - 1]
        f.seek(offset)
        out, size = [], 0
        for raw in f:
            if offset >= self.end or len(out) >= count or size >= PAGE_MAX_BYTES:
                break
            offset += len(raw)
            if line_no >= first:
                out.append(raw.rstrip(b"\n"))
                size += len(raw)
            line_no += 1
        return out


_INDEXES: OrderedDict[str, _LineIndex] = OrderedDict()  # path -> index, the most recently used last
_INDEXES_MAX = 256
_INDEXES_LOCK = threading.Lock()


def _index(path: Path, f, dropped: int) -> _LineIndex:
    """The file's line index, rebuilt when the file is not the one indexed: another inode, or the cap
    cut it since (every cut raises the dropped count), or it shrank."""
    st = os.fstat(f.fileno())
    with _INDEXES_LOCK:
        idx = _INDEXES.pop(str(path), None)
        if idx is None or (idx.ino, idx.dropped) != (st.st_ino, dropped) or idx.end > st.st_size:
            idx = _LineIndex(st.st_ino, dropped)
        _INDEXES[str(path)] = idx
        while len(_INDEXES) > _INDEXES_MAX:
            _INDEXES.popitem(last=False)
    idx.extend(f)
    return idx


def read_page(path: Path | None, *, offset: int, limit: int) -> dict:
    """Lines offset..offset+limit-1 of one kept file, offsets counted from the rank's first line
    (lines cut by the cap included: asking for one of those starts at the first kept line).
    No path (a job without attempts) or no file yet: an empty page."""
    dropped = read_dropped(path) if path is not None else {"lines": 0, "bytes": 0}
    try:
        if path is None:
            raise FileNotFoundError
        with open(path, "rb") as f:
            idx = _index(path, f, dropped["lines"])
            kept, raw = idx.lines, idx.read(f, max(0, offset - dropped["lines"]), limit)
    except FileNotFoundError:
        kept, raw = 0, []
    start = max(offset, dropped["lines"])
    total = dropped["lines"] + kept
    lines = [b.decode("utf-8", "replace") for b in raw]
    end = start + len(lines)
    return {"offset": start, "limit": limit, "total": total, "next_offset": end if end < total else None,
            "dropped_lines": dropped["lines"], "dropped_bytes": dropped["bytes"], "lines": lines}


def remove_job(root: Path, job_id: int) -> None:
    """Delete a job's kept logs (the job row is gone)."""
    shutil.rmtree(keys.job_log_dir(root, job_id), ignore_errors=True)
