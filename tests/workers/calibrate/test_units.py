"""The harness's in-process parts: the grid, the saved-tensor count, the matmul measure and the
document's validation (trainyard.calibration)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from trainyard.calibration import MeasurementsError, parse_measurements
from trainyard.spec import ModelSpec
from workers.calibrate import collectives, matmul, runs
from workers.calibrate.memory import SavedTensors, grad_bytes
from workers.runtime.model import build_model, lm_loss


def test_the_grid_covers_every_strategy_size_and_micro_batch():
    pts = runs.grid(2, cuda=False, quick=False)
    assert len(pts) == 30
    kinds = {(p["plan"]["dp"], p["plan"]["tp"], p["plan"]["pp"], p["plan"]["fsdp"], p["plan"]["schedule"])
             for p in pts}
    assert kinds == {(2, 1, 1, False, "1f1b"), (2, 1, 1, True, "1f1b"), (1, 2, 1, False, "1f1b"),
                     (1, 1, 2, False, "gpipe"), (1, 1, 2, False, "1f1b")}
    assert {p["plan"]["micro_batch"] for p in pts} == {4, 8}
    assert len({p["model"]["hidden"] for p in pts}) == 3
    for p in pts:  # every point is one the runtime runs: micro-batches divide the replica's batch
        per_replica = p["global_batch"] // p["plan"]["dp"]
        assert per_replica % p["plan"]["micro_batch"] == 0
        assert p["model"]["hidden"] % p["model"]["heads"] == 0
    quick = runs.grid(2, cuda=False, quick=True)
    assert len(quick) == 10 and {p["plan"]["micro_batch"] for p in quick} == {8}
    assert [p["plan"]["dp"] for p in runs.grid(1, cuda=True, quick=True)] == [1, 1]  # one GPU: DDP only


def test_saved_tensors_count_activations_once_and_leave_out_parameters():
    lin = nn.Linear(16, 32)
    x = torch.randn(4, 16)
    with SavedTensors() as s:
        y = lin(x)  # saves x (and the weight, a parameter: left out)
    assert s.bytes == x.numel() * 4
    with SavedTensors() as s:
        a = torch.randn(8, 8, requires_grad=True)
        b = a.exp()  # saves its output
        c = (b[:4] * 2).sum() + b.sum()  # a view of b: the same storage
    assert s.bytes == 8 * 8 * 4
    del y, c


def test_saved_tensors_of_the_gpt_grow_with_the_micro_batch_and_exclude_weights():
    torch.manual_seed(0)
    spec = ModelSpec(kind="gpt", layers=2, hidden=128, heads=4, seq_len=8, vocab=64)
    model = build_model(spec)
    sizes = []
    for b in (2, 4):
        x = torch.randint(0, 64, (b, 8))
        with SavedTensors() as s:
            loss = lm_loss(model(x), x)
        sizes.append(s.bytes)
    assert sizes[1] == pytest.approx(2 * sizes[0], rel=0.05)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert sizes[0] < params  # the weights (far larger here) are not counted
    loss.backward()
    assert grad_bytes(model) == params


def test_matmul_measures_a_positive_rate_and_shapes_grow():
    rate = matmul.measure(64, 64, 64, torch.device("cpu"), torch.float32, repeats=2)
    assert 0 < rate < 10  # TFLOP/s of one CPU thread
    ns = [m for m, k, n in matmul.shapes(quick=False, cuda=False) if m == k == n]
    assert ns == sorted(ns) and len(ns) >= 5
    assert collectives.sizes(True) == [4096, 65536, 1 << 20, 1 << 24]


def test_the_document_is_validated_field_by_field():
    doc = {"version": 1, "device": {"name": "cpu", "kind": "cpu", "procs": 2, "threads_per_proc": 1,
                                    "host": "h", "torch": "2.13.0"},
           "matmul": [{"m": 8, "k": 8, "n": 8, "dtype": "float32", "tflops": 0.01}]}
    assert parse_measurements(doc).runs == []
    for path, change in (("device.kind", {"device": {**doc["device"], "kind": "tpu"}}),
                         ("matmul.0.tflops", {"matmul": [{**doc["matmul"][0], "tflops": 0}]}),
                         ("version", {"version": 2}), ("surprise", {"surprise": 1})):
        with pytest.raises(MeasurementsError) as e:
            parse_measurements({**doc, **change})
        assert path in e.value.errors
    with pytest.raises(MeasurementsError):
        parse_measurements([doc])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_grid_point_is_runnable_at_any_world_size(world):
    """`--procs 4` on a 2-core machine (the oversubscribed report): every point keeps at least one
    micro-batch per replica and 1F1B at least as many micro-batches as stages."""
    from workers.calibrate.runs import GLOBAL_BATCH, grid

    points = grid(world, False, False)
    assert points and len({json.dumps(p, sort_keys=True) for p in points}) == len(points)
    for p in points:
        plan = p["plan"]
        per_replica = GLOBAL_BATCH // plan["dp"]
        assert plan["dp"] * plan["tp"] * plan["pp"] == world and per_replica // plan["micro_batch"] >= 1
        if plan["pp"] > 1 and plan["schedule"] == "1f1b":
            assert per_replica // plan["micro_batch"] >= plan["pp"]


def test_procs_out_of_range_is_a_usage_error(capsys):
    from workers.calibrate.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", "/tmp/x.json", "--procs", "0"])
    assert exc.value.code == 2 and "--procs must be between 1 and 64" in capsys.readouterr().err
