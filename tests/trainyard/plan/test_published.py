"""The planner against published large-scale runs (trainyard/plan/published.py, each row with
its source): DEFAULT_GPU was fit on the TRAIN rows only (re-run here), and the throughput the
cost model predicts for each held-out row's published layout is compared with the one measured.

Targets (issue 13): held-out mean |error| <= 12%, every held-out row within 25%, the published
(tp, pp) among the planner's three best distinct layouts for >= 80% of rows. Rows the model does
not cover (`out_of_scope`: techniques it does not model) are reported, not hidden, and checked
for the direction their missing techniques explain. A source's baselines (Megatron-LM's ZeRO-3
rows, chosen to lose) count in the errors and the regret, not in the top-3 rate (printed apart).
Run with -s to print the figures.
"""
import json
import math

import pytest

from trainyard.plan import DEFAULT_GPU
from trainyard.plan.fit import FIT_START, evaluate, fit, regret, split
from trainyard.plan.published import ROWS, TRAIN, measured_tokens_per_s


def test_every_row_has_a_source_and_train_and_held_out_are_disjoint():
    train, held, out = split()
    assert {r["id"] for r in train} == set(TRAIN) and len(train) == len(TRAIN)
    assert not {r["id"] for r in train} & {r["id"] for r in held + out}
    assert len(held) >= 8
    for r in ROWS:
        assert r["source"] and r["year"] >= 2021 and r["measured"]["tflops_per_gpu"] > 0
    # The conversion from the source's TFLOP/s: MT-NLG's stated 60.1 s per iteration on 2240 GPUs.
    mtnlg = next(r for r in ROWS if r["id"] == "mtnlg-530B-2240")
    assert 1920 * 2048 / measured_tokens_per_s(mtnlg) == pytest.approx(60.1, rel=0.01)


def test_the_shapes_written_reproduce_the_parameter_counts_the_sources_state():
    # A typo in a layer count or width would show here: Megatron-LM's Table 1 names each model by
    # its parameters (its formula: 12*l*h^2*(1 + 13/(12h) + (V + s)/(12*l*h)); "1.7B" is 1.65B
    # rounded), BLOOM states 176B, Llama 3 405B.
    stated = {r["id"]: float(r["id"].split("-")[1].rstrip("B")) for r in ROWS if r["id"].startswith("megatron21-")
              and not r["id"].startswith("megatron21-t2")}
    stated.update({"bloom-176B": 176.2, "llama3-405B-8192": 405.0, "mtnlg-530B-2240": 530.0})
    for r in ROWS:
        if r["id"] in stated:
            m = r["request"]["model"]
            n, h = m["layers"], m["hidden"]
            params = 12 * n * h * h * (1 + 13 / (12 * h) + (m["vocab"] + m["seq_len"]) / (12 * n * h))
            assert params / 1e9 == pytest.approx(stated[r["id"]], rel=0.03), r["id"]


def test_default_gpu_is_the_fit_on_the_training_rows_alone():
    train, _, _ = split()
    refit = fit(train, FIT_START)
    assert [e for p in refit.matmul_eff for e in p] == pytest.approx([e for p in DEFAULT_GPU.matmul_eff for e in p])
    for name in ("comm_eff", "layer_overhead_s", "elementwise_bytes", "attention_bytes"):
        assert getattr(refit, name) == pytest.approx(getattr(DEFAULT_GPU, name)), name
    assert all(r["id"] in DEFAULT_GPU.source for r in train)


def test_held_out_rows_meet_the_targets():
    _, held, out = split()
    result = evaluate(held, DEFAULT_GPU)
    beyond = evaluate(out, DEFAULT_GPU)
    print("\nheld-out published runs:", json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for row in result["rows"] + beyond["rows"]:
        print(f"  {row['id']:<22} error {row['error']:+.1%}  published (tp, pp) {row['published_layout']} "
              f"top 3 {row['top3_layouts']}")
    print("out of scope:", json.dumps({k: v for k, v in beyond.items() if k != "rows"}))
    assert result["mean_abs_error"] <= 0.12
    assert result["max_abs_error"] <= 0.25
    assert result["top3_rate"] >= 0.8 and result["top3_rows"] >= 10
    # What the out-of-scope rows lack (sequence parallelism, interleaving, partial recompute) would
    # make the run faster than the model says: the model must err on that side, not the other.
    assert all(r["error"] < 0 and r["published_in_top3"] for r in beyond["rows"])


def test_regret_of_the_planners_pick_among_layouts_a_source_measured():
    # Megatron-LM 2021's Table 2 measured PTD-P and ZeRO-3 on the same GPUs and batch: five pairs.
    _, held, _ = split()
    groups = regret(held, DEFAULT_GPU)
    assert len(groups) == 5 and all(len(g["rows"]) == 2 for g in groups)
    by_id = {r["id"]: r for r in ROWS}
    for g in groups:
        best = max(measured_tokens_per_s(by_id[i]) for i in g["rows"])
        assert g["regret"] == round(1 - measured_tokens_per_s(by_id[g["pick"]]) / best, 4)
    values = [g["regret"] for g in groups]
    print(f"\nregret of the planner's pick over {len(groups)} groups: mean {sum(values) / len(values):.1%}, "
          f"max {max(values):.1%}: " + json.dumps(groups))
    # A pair the planner gets wrong is visible: it costs what the measured numbers say, no more.
    base = by_id["megatron21-145.6B"]
    other = {**base, "id": "x-slow-layout", "published": {"tp": 4, "pp": 16, "dp": 24},
             "measured": {**base["measured"], "tflops_per_gpu": 100}}
    (group,) = regret([base, other], DEFAULT_GPU)
    expected = 0.0 if group["pick"] == base["id"] else 1 - 100 / 148
    assert math.isclose(group["regret"], round(expected, 4))
