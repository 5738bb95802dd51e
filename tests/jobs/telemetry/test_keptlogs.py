"""Kept logs on disk (jobs/telemetry/keptlogs.py): one write per file per batch, paging by stable line offsets,
the per-job byte cap cutting the oldest lines first (and counting them), disk errors that never raise."""
from __future__ import annotations

import os

from jobs.telemetry import keptlogs
from jobs.telemetry.keptlogs import LogKeeper, read_page
from trainyard.keys import rank_log_path


def lines(prefix: str, n: int, width: int = 0) -> list[str]:
    return [f"{prefix} {i:05d}" + "x" * width for i in range(n)]


def test_batches_append_in_order_per_attempt_and_rank(tmp_path):
    k = LogKeeper(tmp_path, thread=False)
    k.write({(7, 70, 0): ["a0", "a1"], (7, 70, 1): ["b0"], (7, 71, 0): ["c0"]})
    k.write({(7, 70, 0): ["a2", "ünïcödé ✓"]})
    assert rank_log_path(tmp_path, 7, 70, 0).read_text() == "a0\na1\na2\nünïcödé ✓\n"
    assert rank_log_path(tmp_path, 7, 70, 1).read_text() == "b0\n"
    assert keptlogs.kept_index(tmp_path, 7) == {70: [0, 1], 71: [0]}
    assert k.stats["lines_written"] == 6


def test_one_open_per_file_per_batch(tmp_path, monkeypatch):
    opened = []
    real_open = keptlogs.safefs.open_beneath

    def counting(root, rel, flags=os.O_RDONLY, *args, **kwargs):
        if flags & os.O_APPEND:
            opened.append(str(rel))
        return real_open(root, rel, flags, *args, **kwargs)

    monkeypatch.setattr(keptlogs.safefs, "open_beneath", counting)
    k = LogKeeper(tmp_path, thread=True)
    for i in range(50):  # queued faster than one write each: the writer merges what is queued
        k.submit({(1, 10, 0): [f"line {i}"], (1, 10, 1): [f"other {i}"]})
    assert k.flush()
    k.close()
    assert rank_log_path(tmp_path, 1, 10, 0).read_text().splitlines() == [f"line {i}" for i in range(50)]
    assert 0 < opened.count("rank-0.log") < 50  # batches were merged, never one open per line
    assert opened.count("rank-0.log") == opened.count("rank-1.log")


def test_paging_by_line_offset_reports_total_and_next(tmp_path):
    k = LogKeeper(tmp_path, thread=False)
    k.write({(1, 10, 0): lines("l", 2500)})
    where = (tmp_path, 1, 10, 0)
    first = read_page(*where, offset=0, limit=1000)
    assert first["total"] == 2500 and first["next_offset"] == 1000 and len(first["lines"]) == 1000
    assert first["lines"][0] == "l 00000" and first["lines"][-1] == "l 00999"
    last = read_page(*where, offset=2000, limit=1000)
    assert last["lines"][0] == "l 02000" and last["lines"][-1] == "l 02499" and last["next_offset"] is None
    assert read_page(*where, offset=9999, limit=10)["lines"] == []
    assert read_page(tmp_path, 1, 10, 5, offset=0, limit=10) == {
        "offset": 0, "limit": 10, "total": 0, "next_offset": None, "dropped_lines": 0, "dropped_bytes": 0, "lines": []}


def test_paging_across_chunk_boundaries_and_long_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(keptlogs, "CHUNK", 64)  # many chunk boundaries inside lines
    k = LogKeeper(tmp_path, thread=False)
    want = lines("w", 300, width=37) + ["y" * 500] + lines("z", 5)
    k.write({(1, 10, 0): want})
    got, offset = [], 0
    while offset is not None:
        page = read_page(tmp_path, 1, 10, 0, offset=offset, limit=7)
        got += page["lines"]
        offset = page["next_offset"]
    assert got == want


def test_a_line_being_written_is_not_counted(tmp_path):
    path = rank_log_path(tmp_path, 1, 10, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"one\ntwo\nthr")
    page = read_page(tmp_path, 1, 10, 0, offset=0, limit=10)
    assert page["lines"] == ["one", "two"] and page["total"] == 2


def test_cap_cuts_the_oldest_lines_and_offsets_stay_stable(tmp_path):
    cap = 20_000
    k = LogKeeper(tmp_path, max_bytes=cap, thread=False)
    for b in range(40):  # 40 batches x 50 lines x 17 bytes = 34 kB through a 20 kB cap
        k.write({(3, 30, 0): [f"b{b:02d} line {i:03d} ..." for i in range(50)]})
    files = keptlogs.job_files(tmp_path, 3)
    assert sum(p.stat().st_size for p in files) <= cap
    path = rank_log_path(tmp_path, 3, 30, 0)
    page = read_page(tmp_path, 3, 30, 0, offset=0, limit=5000)
    assert page["total"] == 2000 and page["dropped_lines"] > 0
    assert page["offset"] == page["dropped_lines"]  # an offset that was cut starts at the first kept line
    assert page["lines"][-1] == "b39 line 049 ..."
    # offset N is still the N-th line ever printed
    n = page["dropped_lines"] + 10
    assert read_page(tmp_path, 3, 30, 0, offset=n, limit=1)["lines"] == [f"b{n // 50:02d} line {n % 50:03d} ..."]
    assert k.stats["lines_cut_by_cap"] == page["dropped_lines"]
    assert page["dropped_bytes"] == 40 * 50 * 17 - path.stat().st_size


def test_cap_cuts_the_largest_file_of_the_job_first(tmp_path):
    k = LogKeeper(tmp_path, max_bytes=10_000, thread=False)
    k.write({(4, 40, 0): lines("quiet", 10)})
    for _ in range(20):
        k.write({(4, 41, 1): lines("chatty", 40)})
    assert read_page(tmp_path, 4, 40, 0, offset=0, limit=100)["dropped_lines"] == 0
    chatty = read_page(tmp_path, 4, 41, 1, offset=0, limit=10_000)
    assert chatty["dropped_lines"] > 0 and chatty["total"] == 800
    assert sum(p.stat().st_size for p in keptlogs.job_files(tmp_path, 4)) <= 10_000


def test_a_batch_larger_than_half_the_cap_keeps_its_newest_lines(tmp_path):
    k = LogKeeper(tmp_path, max_bytes=1000, thread=False)
    k.write({(5, 50, 0): lines("old", 5)})
    k.write({(5, 50, 0): lines("big", 200)})
    page = read_page(tmp_path, 5, 50, 0, offset=0, limit=1000)
    assert page["total"] == 205 and page["lines"][-1] == "big 00199" and page["lines"][0].startswith("big")
    assert page["dropped_lines"] == 205 - len(page["lines"])


def test_disk_errors_are_counted_never_raised(tmp_path, caplog):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "job-6").write_text("a file where the job's directory should be")
    k = LogKeeper(tmp_path, thread=False)
    k.write({(6, 60, 0): ["lost", "too"], (7, 70, 0): ["kept"]})
    assert k.stats["lines_write_errors"] == 2 and k.stats["lines_written"] == 1
    assert "cannot write job 6" in caplog.text
    assert rank_log_path(tmp_path, 7, 70, 0).read_text() == "kept\n"


def test_writer_behind_drops_for_the_disk_and_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(keptlogs, "SUBMIT_WAIT_S", 0.05)
    k = LogKeeper(tmp_path, max_queued=1, thread=True)
    gate = __import__("threading").Event()
    real_write = k.write
    k.write = lambda batch: (gate.wait(5), real_write(batch))  # a disk that hangs
    k.submit({(1, 10, 0): ["a"]})
    results = [k.submit({(1, 10, 0): ["b", "c"]}) for _ in range(3)]
    assert results.count(False) >= 1 and k.stats["lines_dropped_queue"] >= 2
    gate.set()
    k.close()


def test_remove_job(tmp_path):
    k = LogKeeper(tmp_path, thread=False)
    k.write({(8, 80, 0): ["x"], (9, 90, 0): ["y"]})
    keptlogs.remove_job(tmp_path, 8)
    assert keptlogs.kept_index(tmp_path, 8) == {} and keptlogs.kept_index(tmp_path, 9) == {90: [0]}


def test_line_index_follows_growth_and_cuts(tmp_path, monkeypatch):
    import random

    monkeypatch.setattr(keptlogs, "CHUNK", 256)  # an index mark every ~256 bytes
    k = LogKeeper(tmp_path, max_bytes=60_000, thread=False)
    written: list[str] = []
    rnd = random.Random(7)
    for batch in range(60):
        new = [f"batch {batch} line {i} " + "y" * rnd.randrange(0, 90) for i in range(rnd.randrange(1, 40))]
        k.write({(2, 20, 0): new})
        written += new
        dropped = read_page(tmp_path, 2, 20, 0, offset=0, limit=0)["dropped_lines"]
        for _ in range(3):  # random pages, served from the index as the file grows and is cut
            offset, limit = rnd.randrange(0, len(written) + 5), rnd.randrange(1, 50)
            page = read_page(tmp_path, 2, 20, 0, offset=offset, limit=limit)
            start = max(offset, dropped)
            assert page["total"] == len(written) and page["offset"] == start
            assert page["lines"] == written[start:start + limit], (batch, offset, limit)
    assert read_page(tmp_path, 2, 20, 0, offset=0, limit=1)["dropped_lines"] > 0  # the cap did cut meanwhile
