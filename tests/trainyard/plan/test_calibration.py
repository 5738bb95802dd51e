"""The calibration fit (trainyard/plan/calibration.py) on documents whose figures come from
known constants: the fit must recover what made them (links, activation factor, predictions),
and the evaluation must say how far other constants are from them."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from trainyard.plan import calibration as cal
from trainyard.plan.constants import DEFAULT_CPU, DeviceConstants
from trainyard.calibration import MeasurementsError, parse_measurements

PEAK = 0.2
TRUE = DeviceConstants(
    name="cpu", matmul_eff=((32.0, 0.3), (128.0, 0.8), (512.0, 0.95)), intra_alpha_s=2e-4,
    intra_gbs=2.0, comm_eff=0.5, overlap=0.3, step_overhead_s=0.004, layer_overhead_s=3e-4,
    activation_factor=0.8, optimizer_gbs=2.0, source="truth")
MODELS = [dict(layers=2, hidden=64, heads=4, seq_len=64, vocab=256),
          dict(layers=4, hidden=128, heads=4, seq_len=128, vocab=256),
          dict(layers=4, hidden=256, heads=8, seq_len=128, vocab=512)]


def _plan(dp=1, tp=1, pp=1, micro_batch=8, fsdp=False, schedule="1f1b"):
    return {"dp": dp, "tp": tp, "pp": pp, "micro_batch": micro_batch, "fsdp": fsdp,
            "shard_optimizer": False, "recompute": "none", "schedule": schedule}


def _grid():
    plans = []
    for mb in (8, 4):
        plans += [_plan(dp=2, micro_batch=mb), _plan(dp=2, micro_batch=mb, fsdp=True), _plan(tp=2, micro_batch=mb),
                  _plan(pp=2, micro_batch=mb, schedule="gpipe"), _plan(pp=2, micro_batch=mb)]
    return [(m, p) for m in MODELS for p in plans]


def synthetic(truth: DeviceConstants = TRUE) -> dict:
    """A measurement document whose every figure the cost model with `truth` predicts."""
    matmul = [{"m": n, "k": n, "n": n, "dtype": "float32", "tflops": PEAK * truth.efficiency(n)}
              for n in (32, 64, 128, 256, 512)]
    bus = truth.intra_gbs * truth.comm_eff * 1e9
    colls = []
    for nbytes in (4096, 65536, 1 << 20, 1 << 24):
        for op, factor in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
            colls.append({"op": op, "group": 2, "link": "intra", "bytes": nbytes,
                          "seconds": truth.intra_alpha_s + nbytes * factor / bus})
        colls.append({"op": "send_recv", "group": 2, "link": "intra", "bytes": nbytes,
                      "seconds": truth.intra_alpha_s + nbytes / (truth.intra_gbs * 1e9)})
    zero_mem = {"params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0, "activation_bytes": 1}
    runs = [{"model": m, "global_batch": 16, "plan": p, "procs": 2, "step_time_s": 1.0, "steps": 12,
             "memory": dict(zero_mem)} for m, p in _grid()]
    doc = {"version": 1, "device": {"name": "cpu", "kind": "cpu", "procs": 2, "threads_per_proc": 1,
                                    "host": "test", "torch": "2.13.0"},
           "matmul": matmul, "collectives": colls, "runs": runs}
    m = parse_measurements(doc)
    for run, case in zip(doc["runs"], cal._cases(m, truth, PEAK)):
        run["step_time_s"] = case.step(truth)
        states = case.states(truth)
        run["memory"] = {"params_bytes": int(states / 4), "grads_bytes": int(states / 4),
                         "optimizer_bytes": int(states / 2), "activation_bytes": int(case.activations(truth))}
    return doc


def test_the_fit_recovers_the_constants_that_made_the_measurements():
    doc = synthetic()
    fit_idx, held = cal.held_out_split(len(doc["runs"]))
    assert held == list(range(1, 30, 3)) and sorted(fit_idx + held) == list(range(30))
    k = cal.fit(doc, DEFAULT_CPU, runs=fit_idx)
    for field in ("intra_alpha_s", "intra_gbs", "comm_eff", "overlap", "step_overhead_s", "layer_overhead_s",
                  "optimizer_gbs"):
        assert getattr(k, field) == pytest.approx(getattr(TRUE, field), rel=1e-6), field
    assert k.elementwise_bytes == pytest.approx(0.0, abs=1e-9)
    assert k.activation_factor == pytest.approx(0.8, rel=1e-3)
    assert k.source.startswith("calibrated ") and "20 runs" in k.source
    after = cal.evaluate(doc, k, held)
    assert after["runs"] == 10
    assert after["spearman"] == pytest.approx(1.0)
    assert after["step_error_max"] < 1e-6
    assert after["activation_error_max"] < 0.01
    assert after["states_error_max"] < 0.01
    before = cal.evaluate(doc, DEFAULT_CPU, held)
    assert before["step_error_median"] > 0.2  # the defaults are not this device
    assert before["activation_error_median"] > 0.1


def test_the_efficiency_table_is_relative_to_the_best_gemm_and_one_point_per_size():
    doc = synthetic()
    doc["matmul"].append({"m": 128, "k": 128, "n": 128, "dtype": "float32", "tflops": PEAK * 0.7})
    doc["matmul"].append({"m": 128, "k": 128, "n": 128, "dtype": "float32", "tflops": PEAK * 0.75})
    m = parse_measurements(doc)
    table = dict(cal.fit_matmul(m, cal.peak_of(m)))
    assert cal.peak_of(m) == pytest.approx(PEAK * 0.95)
    assert table[512.0] == pytest.approx(1.0)
    assert table[128.0] == pytest.approx(0.75 / 0.95)  # median of 0.8, 0.7, 0.75
    assert list(table) == sorted(table)


def test_links_fit_alpha_bandwidth_and_collective_efficiency():
    links = cal.fit_links(parse_measurements(synthetic()))
    assert links["intra_alpha_s"] == pytest.approx(2e-4, rel=1e-6)
    assert links["intra_gbs"] == pytest.approx(2.0, rel=1e-6)
    assert links["comm_eff"] == pytest.approx(0.5, rel=1e-6)
    assert "inter_gbs" not in links  # no inter-node points: not measured, not set


def test_spearman_against_known_values():
    assert cal.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert cal.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # scipy.stats.spearmanr([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) = 0.8
    assert cal.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    # ties take average ranks: spearmanr([1, 2, 2, 3], [1, 3, 2, 4]) = 0.9486832980505138
    assert cal.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)
    assert cal.spearman([1, 2], [1, 2]) is None
    assert cal.spearman([1, 1, 1], [1, 2, 3]) is None


def test_nnls_keeps_coefficients_non_negative():
    rows = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    assert cal._nnls(rows, [2.0, 3.0, 5.0]) == pytest.approx([2.0, 3.0])
    a, b = cal._nnls(rows, [2.0, -3.0, -1.0])  # the unconstrained b is negative
    assert b == 0.0 and a == pytest.approx(0.5)


def test_a_noisy_document_still_fits_and_the_evaluation_reports_per_run():
    doc = synthetic()
    noisy = copy.deepcopy(doc)
    for i, run in enumerate(noisy["runs"]):
        run["step_time_s"] *= 1.1 if i % 2 else 0.9
    k = cal.fit(noisy, DEFAULT_CPU)
    e = cal.evaluate(noisy, k)
    assert e["runs"] == 30 and len(e["per_run"]) == 30
    assert e["step_error_median"] < 0.15
    row = e["per_run"][0]
    assert {"run", "plan", "model", "step_time_s", "predicted_step_time_s", "step_error",
            "states_error", "activation_error"} <= set(row)


def test_bad_documents_name_the_field():
    doc = synthetic()
    doc["runs"][3]["plan"]["tp"] = 0
    with pytest.raises(MeasurementsError) as e:
        cal.fit(doc, DEFAULT_CPU)
    assert "runs.3.plan.tp" in e.value.errors
    doc = synthetic()
    doc["matmul"] = []
    with pytest.raises(MeasurementsError) as e:
        cal.evaluate(doc, DEFAULT_CPU)
    assert "matmul" in e.value.errors
    with pytest.raises(MeasurementsError):
        cal.fit({**synthetic(), "extra": 1}, DEFAULT_CPU)


def test_constants_round_trip_through_json():
    k = cal.fit(synthetic(), dataclasses.replace(DEFAULT_CPU))
    assert DeviceConstants.from_dict(k.to_dict()) == k
