"""comm.ratio auto: the pure choice (table-driven), and one real 2-rank torchrun run."""
from pathlib import Path

import pytest

from trainyard.sdk.autoratio import (RATIO_MAX, RATIO_MIN, Decision, choose_ratio, decide,
                                       dense_bandwidth, gather_bandwidth)

from .conftest import SMALL_MODEL, make_launch_config, read_stream, start_torchrun, write_launch_config
from .test_torchrun import Output

MB = 1_000_000
DENSE = 40 * MB  # 10M fp32 parameters


@pytest.mark.parametrize("world, bw, backward_s, expected", [
    # exchange_s = 2 r D (w-1) / bw must fit 0.8 x backward_s
    (2, 6.25 * MB, 0.5, 0.8 * 0.5 * 6.25 / (2 * 40)),  # 50 Mbit/s, 0.5 s backward: 0.03125
    (4, 6.25 * MB, 0.5, 0.8 * 0.5 * 6.25 / (2 * 40 * 3)),  # 3 peers' entries to receive
    (2, 12.5 * MB, 0.5, 0.8 * 0.5 * 12.5 / (2 * 40)),  # twice the bandwidth, twice the ratio
    (2, 10_000 * MB, 0.5, RATIO_MAX),  # a fast link: clamped high
    (2, 0.01 * MB, 0.5, RATIO_MIN),  # a very slow link: clamped low
    (2, 6.25 * MB, 0.0, RATIO_MIN),  # no compute to hide behind
    (1, 6.25 * MB, 0.5, RATIO_MAX),  # nobody to exchange with
    (2, float("inf"), 0.5, RATIO_MAX),  # unmeasured (no time): no reason to compress harder
])
def test_choose_ratio_fits_the_exchange_behind_backward(world, bw, backward_s, expected):
    r = choose_ratio(DENSE, world, bw, backward_s)
    assert r == pytest.approx(expected, rel=1e-3)
    assert RATIO_MIN <= r <= RATIO_MAX
    if RATIO_MIN < r < RATIO_MAX:  # the exchange at r takes 0.8 x backward_s
        assert 2 * r * DENSE * (world - 1) / bw == pytest.approx(0.8 * backward_s, rel=1e-3)


def test_bandwidth_from_collectives():
    # a ring all-reduce of B bytes puts 2(w-1)/w B on the link; an all-gather (w-1) b
    assert dense_bandwidth(8 * MB, 1.0, 2) == 8 * MB
    assert dense_bandwidth(8 * MB, 1.0, 4) == 12 * MB
    assert gather_bandwidth(1 * MB, 0.5, 3) == 4 * MB
    assert dense_bandwidth(8 * MB, 0.0, 2) == float("inf")


@pytest.mark.parametrize("bw, backward_s, reason", [
    (6.25 * MB, 0.5, None),  # unchanged
    (7.0 * MB, 0.55, None),  # +12% and +10%: within 20%
    (4.0 * MB, 0.5, "bandwidth_changed"),  # -36%
    (6.25 * MB, 0.7, "backward_changed"),  # +40%
    (3.0 * MB, 1.0, "bandwidth_changed+backward_changed"),
])
def test_decide_reevaluates_only_on_a_real_change(bw, backward_s, reason):
    prev = Decision(choose_ratio(DENSE, 2, 6.25 * MB, 0.5), 6.25 * MB, 0.5, "initial")
    new = decide(prev, DENSE, 2, bw, backward_s)
    if reason is None:
        assert new is None
    else:
        assert new.reason == reason and new.ratio == choose_ratio(DENSE, 2, bw, backward_s)
        assert (new.bandwidth_bytes_per_s, new.backward_s) == (bw, backward_s)


def test_first_decision_is_initial():
    d = decide(None, DENSE, 2, 6.25 * MB, 0.5)
    assert d == Decision(0.03125, 6.25 * MB, 0.5, "initial")


@pytest.mark.procs
def test_auto_ratio_is_chosen_after_the_dense_steps_and_cuts_the_bytes(tmp_path: Path, redis_server,
                                                                       repo_env):
    steps, start = 8, 3
    cfg = make_launch_config(tmp_path, redis_server.url, model=SMALL_MODEL,
                             train={"steps": steps, "global_batch": 16},
                             comm={"compression": "topk", "ratio": "auto", "start_step": start})
    proc = start_torchrun(write_launch_config(tmp_path, cfg), repo_env)
    out = Output(proc)
    assert proc.wait(120) == 0, out.text()
    samples, events, _ = read_stream(redis_server.url, cfg["stream"])
    by = {(s["rank"], s["step"]): s for s in samples}
    assert sorted(by) == [(r, s) for r in (0, 1) for s in range(1, steps + 1)]
    [e] = [e for e in events if e["kind"] == "ratio_changed"]  # rank 0 reports the job's ratio
    ratio = e["new"]
    assert e["rank"] == 0 and e["step"] == start and e["old"] is None and e["reason"] == "initial"
    assert RATIO_MIN <= ratio <= RATIO_MAX and e["backward_s"] > 0
    assert e["bandwidth_bytes_per_s"] is None or e["bandwidth_bytes_per_s"] > 0
    dense = by[(0, 1)]["bytes_sent"]
    for (rank, step), s in by.items():
        if step <= start:
            assert s["bytes_sent"] == dense and s["compression_ratio"] == 1.0
        else:  # int32 index + fp32 value for ~ratio of the entries: ~2 x ratio of the bytes,
            # the same on both ranks (all_gather needs equal sizes: they agreed on the ratio)
            assert s["bytes_sent"] == by[(1 - rank, step)]["bytes_sent"]
            assert s["bytes_sent"] == pytest.approx(2 * ratio * dense, rel=0.01)
            assert s["compression_ratio"] == pytest.approx(1 / (2 * ratio), rel=0.01)
    assert f"top-k ratio None -> {ratio} after step {start} (initial" in out.text()
