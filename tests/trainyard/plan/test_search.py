"""The plan search: every feasible plan best first, the rest rejected with their reason, `fix`
restricting it, tp kept inside a node unless nothing else fits, and its speed at 1T x 3,072."""
import time

import pytest

from trainyard.plan import DEFAULT_GPU, parse_plan_request, plan, plan_dict, plan_for_job
from trainyard.plan.job import spec_parallel

A100 = {"name": "A100-80GB", "memory_gb": 80, "peak_tflops": 312}
TRILLION = {"model": {"layers": 128, "hidden": 25600, "heads": 160, "seq_len": 2048, "vocab": 51200},
            "cluster": {"nodes": 384, "devices_per_node": 8, "device": A100, "intra_node_gbs": 300,
                        "inter_node_gbs": 200},
            "global_batch": 3072}
GPT_13B = {"model": {"layers": 40, "hidden": 5120, "heads": 40, "seq_len": 2048, "vocab": 51200},
           "cluster": {"nodes": 2, "devices_per_node": 8, "device": A100, "intra_node_gbs": 300, "inter_node_gbs": 25},
           "global_batch": 64}
FIELDS = {"dp", "tp", "pp", "micro_batch", "fsdp", "shard_optimizer", "recompute", "schedule", "step_time_s",
          "tflops_per_device", "memory_gb_per_device", "bubble_fraction", "comm_bytes", "explain",
          "memory_breakdown_gb", "time_breakdown_s"}


def test_plans_best_first_with_every_field_and_rejections_with_reasons():
    out = plan_dict(GPT_13B)
    plans, rejected = out["plans"], out["rejected"]
    assert plans and rejected and set(out) == {"plans", "rejected"}
    assert all(set(p) == FIELDS for p in plans)
    times = [p["step_time_s"] for p in plans]
    assert times == sorted(times)
    assert all(p["dp"] * p["tp"] * p["pp"] == 16 and p["memory_gb_per_device"] <= 80 for p in plans)
    assert all(r["memory_gb_per_device"] > 80 and r["reason"] == f"memory {r['memory_gb_per_device']:.1f} GB > 80 GB"
               for r in rejected)
    overs = [r["memory_gb_per_device"] for r in rejected]
    assert overs == sorted(overs)                                   # the nearest miss first
    slower = next(p for p in plans if p["step_time_s"] > plans[0]["step_time_s"] * 1.01)
    assert "slower than the best, mostly from" in slower["explain"] and "slower" not in plans[0]["explain"]
    assert set(plans[0]["comm_bytes"]) == {"tp", "pp", "dp"}
    # tflops_per_device counts what the hardware executes: recompute included.
    s, h, n, v = 2048, 5120, 40, 51200
    for p in (next(p for p in plans if p["recompute"] == "none"), next(p for p in plans if p["recompute"] == "full")):
        passes = 4 if p["recompute"] == "full" else 3
        flops = 64 * (passes * n * (24 * s * h * h + 4 * s * s * h) + 6 * s * h * v)
        assert p["tflops_per_device"] * 1e12 * 16 * p["step_time_s"] == pytest.approx(flops, rel=1e-3)


def test_fix_restricts_to_the_best_plan_with_those_values():
    free = plan_dict(GPT_13B)["plans"]
    fixed = plan_dict(GPT_13B | {"fix": {"tp": 8, "recompute": "full"}})["plans"]
    assert fixed and all(p["tp"] == 8 and p["recompute"] == "full" for p in fixed)
    same = [p for p in free if p["tp"] == 8 and p["recompute"] == "full"]
    drop = lambda p: {k: v for k, v in p.items() if k != "explain"}  # noqa: E731 (explain compares with the best)
    assert drop(fixed[0]) == drop(same[0])                           # the best of the restricted set
    one = plan_dict(GPT_13B | {"fix": {"dp": 2, "tp": 8, "pp": 1, "micro_batch": 4, "fsdp": False,
                                       "shard_optimizer": True, "recompute": "none"}})["plans"]
    assert [(p["dp"], p["tp"], p["pp"], p["micro_batch"], p["shard_optimizer"]) for p in one] == [(2, 8, 1, 4, True)]


def test_tp_stays_inside_a_node_unless_nothing_else_fits():
    # One layer (no pp), 2 sequences on 2 nodes x 2 devices: (dp 2, tp 2) stays inside a node but
    # its activations and logits miss 4.5 GB; only (dp 1, tp 4) across the nodes fits.
    one_layer = {"model": {"layers": 1, "hidden": 4096, "heads": 32, "seq_len": 8192, "vocab": 32000},
                 "cluster": {"nodes": 2, "devices_per_node": 2, "device": {"name": "g", "memory_gb": 4.5,
                                                                            "peak_tflops": 100},
                             "intra_node_gbs": 100, "inter_node_gbs": 10},
                 "global_batch": 2}
    plans = plan_dict(one_layer)["plans"]
    assert plans and all(p["tp"] > 1 for p in plans) and "across nodes" in plans[0]["explain"]
    roomy = plan_dict(one_layer | {"cluster": {**one_layer["cluster"], "device": {"name": "g", "memory_gb": 80,
                                                                                  "peak_tflops": 100}}})["plans"]
    assert roomy and all(p["tp"] <= 2 for p in roomy)


def test_nothing_fits_gives_no_plans_and_the_smallest_shortfall_first():
    tiny = TRILLION | {"cluster": {**TRILLION["cluster"], "nodes": 1}, "global_batch": 8}
    out = plan_dict(tiny)
    assert out["plans"] == [] and out["rejected"][0]["reason"].startswith("memory ")


def test_a_model_given_by_size_plans_data_parallel_only():
    out = plan_dict({"model": {"params": 7_000_000_000, "seq_len": 2048}, "cluster": GPT_13B["cluster"],
                     "global_batch": 64})
    assert out["plans"] and {(p["tp"], p["pp"]) for p in out["plans"]} == {(1, 1)}
    assert any(p["fsdp"] for p in out["plans"]) and {p["recompute"] for p in out["plans"]} == {"none"}
    assert "activations not counted" in out["plans"][0]["explain"]


def test_a_trillion_parameter_gpt_on_3072_devices_plans_in_under_100_ms():
    req = parse_plan_request(TRILLION)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        out = plan(req, DEFAULT_GPU)
        times.append(time.perf_counter() - t0)
    print(f"\n1T GPT on 3,072 devices: best of 5 {min(times) * 1000:.1f} ms, plans {len(out['plans'])}")
    assert min(times) < 0.1           # the bound; the best of 5 absorbs a loaded CI machine
    best = out["plans"][0]
    assert best["tp"] == 8 and best["recompute"] == "full" and best["memory_gb_per_device"] <= 80


def test_plan_for_job_plans_what_our_runtime_runs():
    from trainyard.spec import parse_job_spec

    spec = parse_job_spec({"name": "t", "model": {"kind": "gpt", "layers": 4, "hidden": 128, "heads": 4,
                                                  "seq_len": 128, "vocab": 256},
                           "resources": {"nodes": 2, "procs_per_node": 2, "device": "cpu"},
                           "train": {"global_batch": 32}})
    out = plan_for_job(spec, None)
    assert out["plans"]
    for p in out["plans"]:
        assert not (p["tp"] > 1 and p["pp"] > 1) and not (p["fsdp"] and (p["tp"] > 1 or p["pp"] > 1))
        par, accum = spec_parallel(p, 32)
        if p["pp"] > 1:
            assert accum == 1 and par["microbatches"] * p["micro_batch"] * p["dp"] == 32
            assert p["schedule"] == "gpipe" or par["microbatches"] >= p["pp"]
        else:
            assert accum * p["micro_batch"] * p["dp"] == 32


def test_no_candidate_at_all_is_a_field_error_not_an_empty_answer():
    import pytest as _pytest

    from trainyard.plan import PlanInputError

    small = {"model": {"layers": 2, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 256},
             "cluster": {"nodes": 2, "devices_per_node": 8, "device": A100, "intra_node_gbs": 300, "inter_node_gbs": 25},
             "global_batch": 1}
    with _pytest.raises(PlanInputError) as exc:   # tp*pp <= 8 < 16 devices, so dp >= 2 > batch 1
        plan_dict(small)
    assert "global_batch" in exc.value.errors
    with _pytest.raises(PlanInputError) as exc:   # tp 4 x pp 2 x dp 2 exists, micro-batch 3 divides 8/2 = 4 nowhere
        plan_dict(small | {"global_batch": 8, "fix": {"micro_batch": 3}})
    assert "fix.micro_batch" in exc.value.errors
    with _pytest.raises(PlanInputError) as exc:   # one layer: no stages to schedule
        plan_dict(small | {"model": {**small["model"], "layers": 1}, "global_batch": 8, "fix": {"schedule": "gpipe"}})
    assert "fix.schedule" in exc.value.errors


def test_plan_for_job_from_a_real_spec_an_mlp_and_a_script():
    import pytest as _pytest

    from trainyard.plan import PlanInputError
    from trainyard.spec import parse_job_spec

    spec = parse_job_spec({"name": "x", "parallel": "auto", "resources": {"nodes": 2, "procs_per_node": 2},
                           "train": {"global_batch": 16}})
    assert plan_for_job(spec, None)["plans"]
    mlp = parse_job_spec({"name": "m", "model": {"kind": "mlp", "hidden": 96, "heads": 5},
                          "resources": {"nodes": 1, "procs_per_node": 2}})
    assert {(p["tp"], p["pp"]) for p in plan_for_job(mlp, None)["plans"]} == {(1, 1)}
    script = parse_job_spec({"name": "s", "entrypoint": {"script": "/opt/train.py"},
                             "resources": {"nodes": 1, "procs_per_node": 2}, "train": {"global_batch": 8}})
    assert script.model is None
    with _pytest.raises(PlanInputError) as exc:
        plan_for_job(script, None)
    assert "model" in exc.value.errors


def test_plan_for_job_never_splits_a_tp_group_across_nodes():
    """2 nodes x 2 processes, 4 heads: tp 4 divides the heads and tiles the nodes, and with memory
    so tight that tp 1 and 2 do not fit the search falls back to cross-node tp; trainyard.spec's
    rule (tp must divide procs_per_node on several nodes) keeps it out of the answer."""
    from trainyard.spec import parse_job_spec

    spec = parse_job_spec({"name": "t", "model": {"kind": "gpt", "layers": 1, "hidden": 1024, "heads": 4,
                                                  "seq_len": 512, "vocab": 256},
                           "resources": {"nodes": 2, "procs_per_node": 2, "device": "cpu"},
                           "train": {"global_batch": 4}})
    roomy = plan_for_job(spec, None, device={"memory_gb": 4.0})["plans"]
    assert {p["tp"] for p in roomy} == {1, 2}
    tight = plan_for_job(spec, None, device={"memory_gb": 0.1})["plans"]
    assert all(2 % p["tp"] == 0 for p in roomy + tight), tight
