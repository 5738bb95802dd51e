"""The planner's cost model (trainyard/plan/cost.py) against hand-computed memory and the
step-time properties any sane model has."""
import dataclasses

import pytest

from trainyard.plan import DEFAULT_GPU, Candidate, memory, parse_plan_request, step_time

# The demo-sized GPT: layers 4, hidden 128, heads 4, seq 64, vocab 256; fp32 on 2 devices.
H, S, V, L = 128, 64, 256, 4
LAYER = 12 * H * H + 13 * H                      # 198,272: q/k/v, proj, 4h MLP, biases, 2 LayerNorms
ENDS = V * H + S * H                              # token + position embeddings (first stage)
HEAD = V * H + 2 * H                              # the untied LM head and the final LayerNorm (last stage)


def req(devices=2, nodes=1, **over):
    body = {"model": {"layers": L, "hidden": H, "heads": 4, "seq_len": S, "vocab": V},
            "cluster": {"nodes": nodes, "devices_per_node": devices, "device": {"name": "cpu", "memory_gb": 16,
                                                                                  "peak_tflops": 0.1},
                        "intra_node_gbs": 5, "inter_node_gbs": 1},
            "global_batch": 8}
    body.update(over)
    return parse_plan_request(body)


def test_ddp_memory_by_hand():
    m = memory(req(), Candidate(dp=2, tp=1, pp=1, micro_batch=4), DEFAULT_GPU)
    p = L * LAYER + ENDS + HEAD                   # 867,072 parameters on every rank
    assert (m.params, m.grads, m.optimizer) == (4 * p, 4 * p, 8 * p)   # fp32 weights, grads, Adam m+v
    # Korthikanti at t=1, fused attention: s*b*h*34 bytes (16-bit) per layer, x2 for fp32, 1 in flight.
    assert m.activations == L * S * 4 * H * 34 * 2 == 8_912_896
    assert m.logits == 8 * 4 * S * V              # fp32 logits and their gradient, micro-batch 4
    assert m.total == 16 * p + 8_912_896 + 524_288 == 23_310_336


def test_tensor_parallel_recompute_zero1_and_fsdp_memory_by_hand():
    r = req()
    tp = memory(r, Candidate(dp=1, tp=2, pp=1, micro_batch=4), DEFAULT_GPU)
    assert tp.activations == L * S * 4 * H * (10 + 24 / 2) * 2          # s*b*h*(10 + 24/t)
    # tp 2: each block's LayerNorms and row-parallel biases (6h) and the position embedding stay
    # whole; everything else (vocab 256 splits evenly) is halved
    held = L * ((LAYER - 6 * H) / 2 + 6 * H) + V * H / 2 + S * H + V * H / 2 + 2 * H
    assert tp.params == 4 * held
    # ... and the vocab-split token embedding's gradient is materialized whole (measured)
    assert tp.grads == 4 * (held + V * H / 2)
    full = memory(r, Candidate(dp=2, tp=1, pp=1, micro_batch=4, recompute="full"), DEFAULT_GPU)
    assert full.activations == L * 2 * S * 4 * H * 2 + S * 4 * H * 34 * 2  # 2sbh per layer + one working set
    p = L * LAYER + ENDS + HEAD
    zero1 = memory(r, Candidate(dp=2, tp=1, pp=1, micro_batch=4, shard_optimizer=True), DEFAULT_GPU)
    assert (zero1.params, zero1.grads, zero1.optimizer) == (4 * p, 4 * p, 8 * p / 2)
    fsdp = memory(r, Candidate(dp=2, tp=1, pp=1, micro_batch=4, fsdp=True), DEFAULT_GPU)
    # the shards a rank keeps, and beside them two layers gathered at a time (in the total)
    assert fsdp.params == 4 * p / 2 and fsdp.gathered == 2 * LAYER * 4 and fsdp.optimizer == 8 * p / 2
    assert fsdp.total == pytest.approx(fsdp.params + fsdp.grads + fsdp.optimizer + fsdp.gathered + fsdp.activations
                                       + fsdp.logits)
    scores = memory(req(model={"layers": L, "hidden": H, "heads": 4, "seq_len": S, "vocab": V,
                               "attention": "materialized"}), Candidate(dp=2, tp=1, pp=1, micro_batch=4), DEFAULT_GPU)
    assert scores.activations == L * S * 4 * H * (34 + 5 * 4 * S / H) * 2   # + 5*a*s/h


def test_pipeline_in_flight_micro_batches_and_the_last_stages_logits():
    r = req()  # dp 1, pp 2: per-replica batch 8, micro-batch 2 -> m = 4, 2 layers per stage
    one = S * 2 * H * 34 * 2
    f1b = memory(r, Candidate(dp=1, tp=1, pp=2, micro_batch=2, schedule="1f1b"), DEFAULT_GPU)
    gpipe = memory(r, Candidate(dp=1, tp=1, pp=2, micro_batch=2, schedule="gpipe"), DEFAULT_GPU)
    states_first = 16 * (2 * LAYER + ENDS)
    assert f1b.total == pytest.approx(states_first + 2 * one * 2)        # min(p, m) = 2 in flight
    assert f1b.logits == 8 * 2 * S * V
    # GPipe keeps all m = 4 in flight on every stage: the last (+ logits) is now the fuller one; the
    # model charges every stage the states of the larger end stage (the first: embeddings + positions).
    assert gpipe.total == pytest.approx(states_first + 2 * one * 4 + f1b.logits)


def test_step_time_moves_the_right_way():
    r = req()
    base = Candidate(dp=2, tp=1, pp=1, micro_batch=4)
    t = step_time(r, base, DEFAULT_GPU)
    assert t.total_s == pytest.approx(t.compute_s + t.tp_s + t.pp_s + t.dp_exposed_s + t.optimizer_s + t.overhead_s)
    faster = step_time(r, base, dataclasses.replace(DEFAULT_GPU, comm_eff=1.0))
    assert faster.total_s <= t.total_s
    slow_link = parse_plan_request({**r.model_dump(), "cluster": {**r.cluster.model_dump(), "intra_node_gbs": 0.01}})
    assert step_time(slow_link, base, DEFAULT_GPU).total_s > t.total_s           # dp over a slower link
    quick = parse_plan_request({**r.model_dump(), "cluster": {**r.cluster.model_dump(),
                                                               "device": {"name": "cpu", "memory_gb": 16, "peak_tflops": 1}}})
    assert step_time(quick, base, DEFAULT_GPU).compute_s < t.compute_s           # a faster device
    rc = step_time(r, dataclasses.replace(base, recompute="full"), DEFAULT_GPU)
    assert rc.compute_s > t.compute_s and rc.flops_per_step > t.flops_per_step   # recompute costs and counts
    tp = step_time(r, Candidate(dp=1, tp=2, pp=1, micro_batch=4), DEFAULT_GPU)
    assert tp.tp_s > 0 and tp.comm_bytes[0] == 8 * 4 * S * H * (2 - 1) / 2 * 4 * L * 2   # 8bsh(t-1)/t, 2 micro-batches
    rc_tp = step_time(r, Candidate(dp=1, tp=2, pp=1, micro_batch=4, recompute="full"), DEFAULT_GPU)
    assert rc_tp.comm_bytes[0] == 12 / 8 * tp.comm_bytes[0]
    pp = step_time(r, Candidate(dp=1, tp=1, pp=2, micro_batch=2), DEFAULT_GPU)
    assert pp.bubble_fraction == pytest.approx(1 / 5)                            # (p-1)/(m+p-1), m = 4
    assert pp.comm_bytes[1] == 4 * 2 * 2 * S * H * 4                             # b*s*h each way per micro-batch
    assert step_time(r, base, DEFAULT_GPU).comm_bytes[2] == pytest.approx(2 * (2 - 1) / 2 * 4 * (L * LAYER + ENDS + HEAD))


def test_more_micro_batches_cut_the_bubble():
    r = req(global_batch=64)
    few = step_time(r, Candidate(dp=1, tp=1, pp=2, micro_batch=32), DEFAULT_GPU)
    many = step_time(r, Candidate(dp=1, tp=1, pp=2, micro_batch=4), DEFAULT_GPU)
    assert many.bubble_fraction < few.bubble_fraction


def test_constants_round_trip_through_json_and_interpolate_log_linearly():
    import json

    from trainyard.plan import DEFAULT_CPU, DeviceConstants

    for k in (DEFAULT_GPU, DEFAULT_CPU):
        assert DeviceConstants.from_dict(json.loads(json.dumps(k.to_dict()))) == k
    newer = {**DEFAULT_CPU.to_dict(), "a_field_from_the_future": 1}
    assert DeviceConstants.from_dict(newer) == DEFAULT_CPU
    k = DeviceConstants(name="x", matmul_eff=((100.0, 0.1), (10000.0, 0.5)))
    assert k.efficiency(10.0) == 0.1 and k.efficiency(1e6) == 0.5          # clamped at the ends
    assert k.efficiency(1000.0) == pytest.approx(0.3)                       # halfway in log n
