"""Real torchrun, 2 gloo ranks: gradient accumulation and gradient compression end to end.

One launch per case, all against one redis-server, each job on a stream of its own:
- base: grad_accum 1, no compression (the reference for both halves);
- accum: grad_accum 2 on the same global batch and seed: the same losses, step by step, and an
  exact resume from its step-10 checkpoint;
- fp16, bf16, powersgd (rank 2), topk (ratio 0.01, with grad_accum 2): training works and
  bytes_sent per step is what the compression promises, measured at the collectives.
"""
import math
import statistics
from pathlib import Path

import pytest

from .conftest import SMALL_MODEL
from .test_torchrun import run_job

pytestmark = pytest.mark.procs

STEPS = 20
START = 2  # comm.start_step: steps 1-2 dense, compression from step 3


def _run(tmp_path: Path, url: str, env: dict, name: str, job_id: int, *, resume=None,
         **sections) -> tuple[dict, list[dict], str]:
    """Launch one job to completion: (samples by (rank, step), events, stdout+stderr)."""
    samples, events, text = run_job(
        tmp_path, url, env, name, job_id, resume=resume, model=SMALL_MODEL,
        train={"steps": STEPS, "global_batch": 16, **sections.pop("train", {})},
        checkpoint={"every_steps": 10, "async": True, "keep": 3}, **sections)
    return {(s["rank"], s["step"]): s for s in samples}, events, text


def _val_losses(text: str) -> dict[int, str]:
    # "rank 0 finished steps 20 final_loss 2.9 val_loss 3.1 wall_s 1.2": the local model's loss on
    # fixed held-out windows; equal on both ranks only if their replicas are equal
    return {int(line.split()[1]): line.split()[8] for line in text.splitlines()
            if line.startswith("rank ") and " finished steps " in line}


def test_accumulation_matches_one_big_batch_and_compression_cuts_the_bytes(
        tmp_path, redis_server, repo_env):
    url = redis_server.url
    comm = {"start_step": START}
    runs = {
        "base": _run(tmp_path, url, repo_env, "base", 11),
        "accum": _run(tmp_path, url, repo_env, "accum", 12, train={"grad_accum": 2}),
        "fp16": _run(tmp_path, url, repo_env, "fp16", 13, comm={**comm, "compression": "fp16"}),
        "bf16": _run(tmp_path, url, repo_env, "bf16", 14, comm={**comm, "compression": "bf16"}),
        "powersgd": _run(tmp_path, url, repo_env, "powersgd", 15,
                         comm={**comm, "compression": "powersgd", "rank": 2}),
        "topk": _run(tmp_path, url, repo_env, "topk", 16, train={"grad_accum": 2},
                     comm={**comm, "compression": "topk", "ratio": 0.01}),
    }
    keys = [(r, s) for r in (0, 1) for s in range(1, STEPS + 1)]
    for name, (samples, _events, text) in runs.items():
        assert sorted(samples) == keys, name  # one sample per optimizer step, micro-steps or not
        for s in samples.values():
            assert s["comm_s"] > 0 and s["compute_s"] > 0, (name, s)
            assert s["data_s"] + s["compute_s"] + s["optim_s"] <= s["step_s"] * 1.001, (name, s)
        vals = _val_losses(text)
        assert sorted(vals) == [0, 1] and vals[0] == vals[1], (name, vals)  # replicas agree
        for rank in (0, 1):
            first = samples[(rank, 1)]["loss"]
            last = sum(samples[(rank, s)]["loss"] for s in range(STEPS - 4, STEPS + 1)) / 5
            assert first == pytest.approx(math.log(256), abs=0.2)
            assert last < first - 0.5, (name, rank, first, last)

    # ---- A: grad_accum 2 = one batch of the same 16 samples: same losses, step by step
    base, accum = runs["base"][0], runs["accum"][0]
    assert {e["grad_accum"] for e in runs["accum"][1] if e["kind"] == "rank_finished"} == {2}
    print("grad_accum 2 vs 1, largest relative loss difference:",
          max(abs(accum[k]["loss"] / base[k]["loss"] - 1) for k in keys))
    for key in keys:
        assert accum[key]["loss"] == pytest.approx(base[key]["loss"], rel=1e-5, abs=0), key
        assert accum[key]["bytes_sent"] == base[key]["bytes_sent"]  # one synchronisation a step
        assert accum[key]["samples_per_s"] == pytest.approx(8 / accum[key]["step_s"])  # the step's 8

    # ---- B: bytes per step against the uncompressed run, measured at the collectives
    dense = base[(0, 1)]["bytes_sent"]
    assert all(s["bytes_sent"] == dense for s in base.values())
    ratios = {}
    for name in ("fp16", "bf16", "powersgd", "topk"):
        samples, events, text = runs[name]
        for (_rank, step), s in samples.items():
            if step <= START:
                assert s["bytes_sent"] == dense, (name, step)
        sent = {s["bytes_sent"] for (_, step), s in samples.items() if step > START}
        assert len(sent) == 1, (name, sent)  # fixed per step: no data-dependent sizes
        ratios[name] = sent.pop() / dense
        finished = {e["rank"]: e for e in events if e["kind"] == "rank_finished"}
        for rank, e in finished.items():
            assert e["compression"] == name and e["dense_bytes"] == dense * STEPS
            assert e["bytes_sent"] == sum(s["bytes_sent"] for (r, _), s in samples.items() if r == rank)
            assert e["compression_ratio"] == round(e["dense_bytes"] / e["bytes_sent"], 3)
            assert e["compression_ratio_compressed_steps"] == pytest.approx(1 / ratios[name], rel=1e-3)
        assert f"rank 0 comm compression {name} bytes_sent " in text
    assert ratios["fp16"] == ratios["bf16"] == 0.5
    assert ratios["powersgd"] <= 0.10 and ratios["topk"] <= 0.10, ratios
    print("bytes_sent per step relative to none:", ratios)
    print("median step_s / comm_s (ms), compressed steps:", {
        name: tuple(round(1000 * statistics.median(s[k] for (_, step), s in runs[name][0].items()
                                                    if step > START), 1) for k in ("step_s", "comm_s"))
        for name in runs})

    # ---- exact resume with accumulation: a step is one loader batch, its micro-batches cut from it
    [c10] = [e for e in runs["accum"][1] if e["kind"] == "checkpoint" and e["step"] == 10]
    resumed, _, text = _run(tmp_path, url, repo_env, "accum-resumed", 12, train={"grad_accum": 2},
                            resume={"path": c10["path"], "step": 10, "checkpoint_id": 1})
    assert "rank 0 resumed from step 10" in text
    after = {k: v["loss"] for k, v in resumed.items() if v["attempt"] == 10}
    assert after == {k: accum[k]["loss"] for k in keys if k[1] > 10}
