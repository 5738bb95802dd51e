"""Logs kept after the job: every rank's full output, per attempt, in a plain text file under the
kept log root (`keys.rank_log_path`: <root>/logs/job-<id>/attempt-<a>/rank-<r>.log; the root is
settings.TRAINYARD_KEPT_LOG_ROOT, the control plane's own 0700 directory, not the artifact root the
nodes share, so no job can plant anything there).

Every open goes through trainyard.safefs, one component at a time from a descriptor of the root with
O_NOFOLLOW: a symlink, FIFO or other non-regular file where a kept file, its sidecar or a directory
should be is refused (logged, counted in `refusals`) and never followed, by the writer and by the
readers alike. Temporary files (the cap's cut, the sidecar's rewrite) get unique O_EXCL names in the
file's own directory and are renamed over the file through that directory's descriptor.

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
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import orjson

from trainyard import keys, safefs
from trainyard.private import private_dir
from trainyard.safefs import UnsafePath

log = logging.getLogger("trainyard.relay")

DEFAULT_MAX_BYTES_PER_JOB = 200 * 1024 * 1024
SUBMIT_WAIT_S = 0.5  # the longest the relay waits for room in the writer's queue
CHUNK = 1 << 20
PAGE_MAX_BYTES = 4 << 20  # a page stops early rather than answer more than this
DROPPED_SUFFIX = ".dropped"
DROPPED_MAX_BYTES = 4096  # a sidecar is {"lines": n, "bytes": n}
_RANK_FILE = re.compile(r"rank-(\d+)\.log")
_ATTEMPT_DIR = re.compile(r"attempt-(\d+)")
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND

Lines = dict[tuple[int, int, int], list[str]]  # (job, attempt, rank) -> lines, in order

refusals = {"count": 0}
"""Unsafe paths refused in this process (a symlink or non-regular file where a kept file, sidecar
or directory should be), readers and writer together; the writer also counts its own in stats."""


def _refused(where: str, exc: OSError) -> None:
    refusals["count"] += 1
    log.warning("kept logs: refused %s (not followed): %s", where, exc)


def _zero() -> dict:
    return {"lines": 0, "bytes": 0}


def _parse_dropped(raw: bytes) -> dict:
    try:
        data = orjson.loads(raw)
        return {"lines": int(data["lines"]), "bytes": int(data["bytes"])}
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return _zero()


def _read_dropped_at(dir_fd: int, name: str) -> dict:
    """The sidecar of kept file `name` in the directory `dir_fd`; UnsafePath when it is not a regular file."""
    try:
        return _parse_dropped(safefs.read_small(dir_fd, name + DROPPED_SUFFIX, max_bytes=DROPPED_MAX_BYTES))
    except FileNotFoundError:
        return _zero()


def read_dropped(root: Path, job_id: int, attempt_id: int, rank: int) -> dict:
    """What the cap cut from the front of one kept file: {"lines": n, "bytes": n}. UnsafePath
    (refused, counted) when the sidecar or a directory on its way is a symlink or not a regular file."""
    rel = keys.rank_log_relpath(job_id, attempt_id, rank) + DROPPED_SUFFIX
    try:
        return _parse_dropped(safefs.read_small(root, rel, max_bytes=DROPPED_MAX_BYTES))
    except FileNotFoundError:
        return _zero()
    except UnsafePath as exc:
        _refused(rel, exc)
        raise


@dataclass(frozen=True)
class KeptFile:
    attempt: int
    rank: int
    size: int

    @property
    def name(self) -> str:
        return f"rank-{self.rank}.log"

    def attempt_rel(self, job_id: int) -> str:
        return f"{keys.job_log_relpath(job_id)}/attempt-{self.attempt}"


def kept_files(root: Path | int, job_id: int) -> list[KeptFile]:
    """Every kept file of a job (all attempts, all ranks): regular files only, listed without
    following anything; a symlink or other non-regular entry where one should be is refused."""
    job_rel = keys.job_log_relpath(job_id)
    out: list[KeptFile] = []
    try:
        attempts = safefs.scan_beneath(root, job_rel)
    except UnsafePath as exc:
        _refused(job_rel, exc)
        return []
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name, st in attempts:
        a = _ATTEMPT_DIR.fullmatch(name)
        if not a:
            continue
        if not stat.S_ISDIR(st.st_mode):
            _refused(f"{job_rel}/{name}", UnsafePath(0, "not a directory"))
            continue
        try:
            entries = safefs.scan_beneath(root, f"{job_rel}/{name}")
        except UnsafePath as exc:  # replaced by a link since the listing
            _refused(f"{job_rel}/{name}", exc)
            continue
        for fname, fst in entries:
            r = _RANK_FILE.fullmatch(fname)
            if not r:
                continue
            if not stat.S_ISREG(fst.st_mode):
                _refused(f"{job_rel}/{name}/{fname}", UnsafePath(0, "not a regular file"))
                continue
            out.append(KeptFile(int(a.group(1)), int(r.group(1)), fst.st_size))
    return sorted(out, key=lambda f: (f.attempt, f.rank))


def job_files(root: Path, job_id: int) -> list[Path]:
    """Every kept log file of a job (all attempts, all ranks), as paths (for reports and tests)."""
    return [keys.rank_log_path(root, job_id, f.attempt, f.rank) for f in kept_files(root, job_id)]


def default_keeper() -> LogKeeper:
    """The relay's keeper: settings.TRAINYARD_KEPT_LOG_ROOT, capped at TRAINYARD_LOG_MAX_BYTES_PER_JOB."""
    from django.conf import settings

    return LogKeeper(settings.TRAINYARD_KEPT_LOG_ROOT, settings.TRAINYARD_LOG_MAX_BYTES_PER_JOB)


class LogKeeper:
    """Appends log lines to the kept files from one thread; the caller only enqueues."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES_PER_JOB, *, max_queued: int = 256,
                 thread: bool = True):
        self.root, self.max_bytes = Path(root), int(max_bytes)
        self._queue: queue.Queue = queue.Queue(max_queued)
        self._job_bytes: dict[int, int] = {}
        self.stats = {"lines_written": 0, "lines_dropped_queue": 0, "lines_cut_by_cap": 0, "lines_write_errors": 0,
                      "unsafe_paths_refused": 0}
        self._root_ready = False
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
            except Exception as exc:  # a full or read-only disk, a planted link: the relay goes on
                self.stats["lines_write_errors"] += len(lines)
                self._job_bytes.pop(job_id, None)  # re-count from disk next time
                unsafe = isinstance(exc, UnsafePath)
                if unsafe:
                    self.stats["unsafe_paths_refused"] += 1
                    refusals["count"] += 1
                log.warning("kept logs: cannot write job %s attempt %s rank %s: %s%s", job_id, attempt_id, rank,
                            "refused, not followed: " if unsafe else "", exc)

    def _root_fd(self) -> int:
        """A descriptor of the kept log root, created 0700 (or tightened to it) on first use."""
        if not self._root_ready:
            private_dir(self.root)
            self._root_ready = True
        return safefs.open_root(self.root)

    def _used(self, root_fd: int, job_id: int) -> int:
        if job_id not in self._job_bytes:
            self._job_bytes[job_id] = sum(f.size for f in kept_files(root_fd, job_id))
        return self._job_bytes[job_id]

    def _append(self, job_id: int, attempt_id: int, rank: int, lines: list[str]) -> None:
        root_fd = self._root_fd()
        try:
            attempt_rel = f"{keys.job_log_relpath(job_id)}/attempt-{int(attempt_id)}"
            name = f"rank-{int(rank)}.log"
            data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
            dir_fd = safefs.open_dir(root_fd, attempt_rel, make_dirs=True)
            try:
                if len(data) > self.max_bytes // 2:  # one batch bigger than half the cap: keep its newest lines
                    cut = data.find(b"\n", len(data) - self.max_bytes // 2) + 1
                    skipped = data[:cut].count(b"\n")
                    self._cut_whole(root_fd, job_id, dir_fd, name, extra_lines=skipped, extra_bytes=cut)
                    data = data[cut:]
                while self._used(root_fd, job_id) + len(data) > self.max_bytes and self._cut_largest(root_fd, job_id):
                    pass
                used = self._used(root_fd, job_id)
                fd = safefs.open_beneath(dir_fd, name, _WRITE_FLAGS, 0o600)
                try:
                    safefs.write_all(fd, data)
                finally:
                    os.close(fd)
            finally:
                os.close(dir_fd)
        finally:
            os.close(root_fd)
        self._job_bytes[job_id] = used + len(data)
        self.stats["lines_written"] += len(lines)

    def _cut_largest(self, root_fd: int, job_id: int) -> bool:
        """Cut the oldest half of the job's largest kept file; False when there is nothing to cut."""
        used = self._used(root_fd, job_id)
        sized = [f for f in kept_files(root_fd, job_id) if f.size > 0]
        if not sized:
            return False
        largest = max(sized, key=lambda f: (f.size, f.attempt, f.rank))
        dir_fd = safefs.open_dir(root_fd, largest.attempt_rel(job_id))
        try:
            lines, keep_from = self._cut_half(dir_fd, largest.name)
        finally:
            os.close(dir_fd)
        self._job_bytes[job_id] = used - keep_from
        log.info("kept logs: job %s over its %d-byte cap; cut the oldest %d lines (%d bytes) of attempt %s rank %s",
                 job_id, self.max_bytes, lines, keep_from, largest.attempt, largest.rank)
        return True

    def _cut_half(self, dir_fd: int, name: str) -> tuple[int, int]:
        """Copy the newer half of kept file `name` to a new O_EXCL temporary file and rename it over
        the file (all within the directory `dir_fd`); (lines cut, bytes cut)."""
        with os.fdopen(safefs.open_beneath(dir_fd, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(size // 2)
            f.readline()  # to the end of the line the middle falls in
            keep_from = f.tell()
            f.seek(0)
            lines, left = 0, keep_from
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    break
                lines += chunk.count(b"\n")
                left -= len(chunk)
            tmp_fd, tmp = safefs.create_temp(dir_fd, f".{name}.cut.")
            try:
                with os.fdopen(tmp_fd, "wb") as out:
                    f.seek(keep_from)
                    shutil.copyfileobj(f, out, CHUNK)
                self._record_drop(dir_fd, name, lines, keep_from)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                safefs.unlink_quietly(dir_fd, tmp)
                raise
        return lines, keep_from

    def _cut_whole(self, root_fd: int, job_id: int, dir_fd: int, name: str, *, extra_lines: int,
                   extra_bytes: int) -> None:
        """Drop all of a file (and the head of the batch about to be appended to it)."""
        used = self._used(root_fd, job_id)
        size = lines = 0
        try:
            with os.fdopen(safefs.open_beneath(dir_fd, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                while chunk := f.read(CHUNK):
                    lines += chunk.count(b"\n")
        except FileNotFoundError:
            pass
        self._record_drop(dir_fd, name, lines + extra_lines, size + extra_bytes)
        if size:
            safefs.replace_file(dir_fd, name, b"")  # a new file: readers holding the old one keep reading it
            self._job_bytes[job_id] = used - size

    def _record_drop(self, dir_fd: int, name: str, lines: int, nbytes: int) -> None:
        try:
            before = _read_dropped_at(dir_fd, name)
        except UnsafePath as exc:  # a planted sidecar: not read, and replaced below (never followed)
            self.stats["unsafe_paths_refused"] += 1
            _refused(name + DROPPED_SUFFIX, exc)
            before = _zero()
        safefs.replace_file(dir_fd, name + DROPPED_SUFFIX, orjson.dumps({"lines": before["lines"] + lines,
                                                                         "bytes": before["bytes"] + nbytes}))
        self.stats["lines_cut_by_cap"] += lines


# ---------------------------------------------------------------- reading (the logs API)

def kept_index(root: Path, job_id: int) -> dict[int, list[int]]:
    """attempt id -> ranks with a kept file, both ascending (regular files only)."""
    out: dict[int, list[int]] = {}
    for f in kept_files(root, job_id):
        out.setdefault(f.attempt, []).append(f.rank)
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


def _index(key: str, f, dropped: int) -> _LineIndex:
    """The file's line index, rebuilt when the file is not the one indexed: another inode, or the cap
    cut it since (every cut raises the dropped count), or it shrank."""
    st = os.fstat(f.fileno())
    with _INDEXES_LOCK:
        idx = _INDEXES.pop(key, None)
        if idx is None or (idx.ino, idx.dropped) != (st.st_ino, dropped) or idx.end > st.st_size:
            idx = _LineIndex(st.st_ino, dropped)
        _INDEXES[key] = idx
        while len(_INDEXES) > _INDEXES_MAX:
            _INDEXES.popitem(last=False)
    idx.extend(f)
    return idx


def open_kept(root: Path, job_id: int, attempt_id: int, rank: int):
    """The kept file of one rank, open for reading (a binary file object), and its sidecar's counts.
    FileNotFoundError when none is kept; UnsafePath (refused, logged, counted; nothing read) when
    the file, its sidecar or a directory on the way is a symlink or not a regular file/directory."""
    rel = keys.rank_log_relpath(job_id, attempt_id, rank)
    dropped = read_dropped(root, job_id, attempt_id, rank)
    try:
        fd = safefs.open_beneath(root, rel)
    except UnsafePath as exc:
        _refused(rel, exc)
        raise
    return os.fdopen(fd, "rb"), dropped


def read_page(root: Path, job_id: int, attempt_id: int | None, rank: int, *, offset: int, limit: int) -> dict:
    """Lines offset..offset+limit-1 of one kept file, offsets counted from the rank's first line
    (lines cut by the cap included: asking for one of those starts at the first kept line).
    No attempt (a job without attempts) or no file yet: an empty page. UnsafePath as `open_kept`."""
    dropped = _zero()
    try:
        if attempt_id is None:
            raise FileNotFoundError
        f, dropped = open_kept(root, job_id, attempt_id, rank)
        with f:
            idx = _index(f"{root}//{keys.rank_log_relpath(job_id, attempt_id, rank)}", f, dropped["lines"])
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
    """Delete a job's kept logs (the job row is gone); nothing outside them is followed or deleted
    (a symlink in their place is removed itself)."""
    try:
        safefs.remove_beneath(root, keys.job_log_relpath(job_id))
    except OSError as exc:
        log.warning("kept logs: cannot remove job %s's kept logs: %s", job_id, exc)
