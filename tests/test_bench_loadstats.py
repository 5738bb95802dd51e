"""bench/loadstats.py: the load bench's open-loop timetable, request mix and latency percentiles."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from loadstats import MIX, percentile, ratio, request_mix, socket_targets, summary, timetable  # noqa: E402


def test_timetable_is_open_loop_at_the_rate():
    due = timetable(50, 60)
    assert len(due) == 3000
    assert due[0] == 0.0 and due[1] == pytest.approx(0.02) and due[-1] == pytest.approx(59.98)
    assert timetable(3, 1.0) == pytest.approx([0.0, 1 / 3, 2 / 3])
    with pytest.raises(ValueError):
        timetable(0, 10)


def test_request_mix_has_the_exact_shares_and_is_reproducible():
    kinds = request_mix(3000)
    assert len(kinds) == 3000
    assert {k: kinds.count(k) for k in MIX} == {k: round(3000 * w) for k, w in MIX.items()}
    assert kinds == request_mix(3000)  # the baseline and the full run send the same sequence
    assert kinds[:20] != sorted(kinds[:20])  # shuffled, not kind after kind
    small = request_mix(7)
    assert len(small) == 7 and set(small) <= set(MIX)  # largest remainders fill the rounding gap


def test_percentile_interpolates_like_numpy():
    xs = [float(x) for x in range(1, 101)]  # 1..100
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input


def test_summary_in_ms_and_a_stall_reaches_p99():
    # 99 fast requests and one that waited 2 s: measured from its due time, the stall is the max
    lat = [0.010] * 98 + [0.5, 2.0]
    s = summary(lat)
    assert s == {"n": 100, "p50_ms": 10.0, "p99_ms": pytest.approx(515.0), "max_ms": 2000.0}
    assert summary([]) == {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}


def test_ratio():
    assert ratio(30.0, 10.0) == 3.0
    assert ratio(None, 10.0) is None and ratio(5.0, None) is None and ratio(5.0, 0.0) is None


def test_socket_targets_spread_over_both_jobs_and_the_cluster_page():
    t = socket_targets(200, [2, 3])
    assert t.count("cluster") == 50 and t.count("2") == 75 and t.count("3") == 75
    assert t[:8] == ["2", "3", "2", "cluster", "3", "2", "3", "cluster"]
    assert socket_targets(4, [2, 3], cluster_every=0) == ["2", "3", "2", "3"]
