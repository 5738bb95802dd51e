"""The parallel plan of a job, described from its validated spec (pure: dicts in, dicts out).

The mesh arithmetic (the ("pp", "dp", "tp") grid, tp innermost; the stage split; what each
dimension means) is trainyard/mesh.py's, the same the runtime uses, so the page can say what
each rank will be before the runtime reports what it really holds (the `rank_plan` event). The
plan search is not here: `parallel: auto` on a built-in GPT is resolved at submit by
jobs/planning/autoplan.py (trainyard/plan/ searches the candidate meshes with its cost model) and
this module describes the concrete plan it wrote into the spec; an MLP's `auto` is plain data
parallelism over every process.

An entrypoint job (the user's own code) is planned as plain data parallelism over its processes:
torchrun starts world-size ranks and the script decides what each does (DDP: one replica each;
a script may build its own tp/pp mesh inside that world, which the spec cannot see).
"""
from __future__ import annotations

from trainyard.mesh import MESH_ORDER, Mesh, stage_layers


def strategy_name(dp: int, tp: int, pp: int, fsdp: bool) -> str:
    parts = []
    if dp > 1 or (tp == 1 and pp == 1):
        parts.append(f"fsdp {dp}" if fsdp else f"dp {dp}")
    if tp > 1:
        parts.append(f"tp {tp}")
    if pp > 1:
        parts.append(f"pp {pp}")
    return " × ".join(parts)


USER_CODE_DP_MEANING = ("processes torchrun starts for the script; with DDP each is a data-parallel "
                        "replica training on its own share of the data")


def describe(spec: dict) -> dict:
    """The plan stored on the job and shown on its page: mesh shape, what each dimension means,
    the expected role of every rank, and the communication settings."""
    res, par, comm = spec["resources"], spec["parallel"], spec["comm"]
    world = int(res["nodes"]) * int(res["procs_per_node"])
    if spec.get("entrypoint"):
        return {**describe_user_code(spec, world), "placement": placement(res)}
    auto = par == "auto"
    tp = 1 if auto else int(par["tp"])
    pp = 1 if auto else int(par["pp"])
    fsdp = False if auto else bool(par["fsdp"])
    recompute = "none" if auto else par.get("recompute", "none")  # a spec stored before these fields
    shard_optimizer = False if auto else bool(par.get("shard_optimizer", False))
    dp = world // (tp * pp) if auto or par.get("dp") is None else int(par["dp"])
    grid = Mesh(pp=pp, dp=dp, tp=tp, fsdp=fsdp)
    mesh = grid.shape
    dims = [{"name": d, "size": mesh[d], "meaning": grid.meaning(d)} for d in grid.dims()]
    stages = stage_layers(int(spec["model"]["layers"]), pp)
    heads = int(spec["model"].get("heads", 1))
    roles = []
    for rank in range(world):
        c = grid.coords(rank)
        bits = [f"replica {c['dp']}/{dp}" + (" (sharded)" if fsdp else "")
                + (f" (1/{dp} of the optimizer state)" if shard_optimizer else "")]
        if tp > 1:
            per = heads // tp
            bits.append(f"tp {c['tp']}/{tp}: heads {c['tp'] * per}-{(c['tp'] + 1) * per - 1}")
        if pp > 1:
            blocks = stages[c["pp"]]
            bits.append(f"stage {c['pp']}/{pp}: blocks {blocks.start}-{blocks.stop - 1}")
        roles.append({"rank": rank, "coords": c, "role": ", ".join(bits)})
    plan = {"dp": dp, "tp": tp, "pp": pp, "fsdp": fsdp, "world_size": world, "mesh": mesh,
            "order": list(MESH_ORDER), "dims": dims, "strategy": strategy_name(dp, tp, pp, fsdp),
            "roles": roles, "sync": comm["sync"], "compression": comm["compression"],
            "balance": spec["train"]["balance"], "recompute": recompute, "shard_optimizer": shard_optimizer,
            "placement": placement(res)}
    if pp > 1:
        plan["microbatches"] = int(par["microbatches"])
        plan["schedule"] = par["schedule"]
    return plan


def placement(res: dict) -> dict:
    """Where the job may run (the scheduler's eligibility.py): its device, the memory each GPU
    must have, the node selector, and one line saying so for the page."""
    device, mem, labels = res.get("device", "cpu"), res.get("gpu_memory_gb"), dict(res.get("labels") or {})
    unit = "cuda GPU(s)" if device == "cuda" else f"{device} slot(s)"
    text = f"{res['nodes']} node(s) x {res['procs_per_node']} {unit}"
    if mem:
        text += f" of at least {mem:g} GB each"
    if labels:
        text += ", on nodes labelled " + ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return {"device": device, "gpu_memory_gb": mem, "labels": labels, "text": text}


def describe_user_code(spec: dict, world: int) -> dict:
    """An entrypoint job's plan: plain dp over `world` processes (the spec's rules allow no
    other), each rank a data-parallel replica. No stage split or head ranges: the model is the
    script's."""
    grid = Mesh(pp=1, dp=world, tp=1, fsdp=False)
    dims = [{"name": "dp", "size": world, "meaning": USER_CODE_DP_MEANING}] if world > 1 else []
    roles = [{"rank": r, "coords": grid.coords(r), "role": f"data-parallel replica {r}/{world}"}
             for r in range(world)]
    return {"dp": world, "tp": 1, "pp": 1, "fsdp": False, "world_size": world, "mesh": grid.shape,
            "order": list(MESH_ORDER), "dims": dims, "strategy": strategy_name(world, 1, 1, False),
            "roles": roles, "sync": spec["comm"]["sync"], "compression": spec["comm"]["compression"],
            "balance": spec["train"]["balance"], "recompute": "none", "shard_optimizer": False,
            "user_code": True}
