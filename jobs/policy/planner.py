"""The parallel plan of a job, described from its validated spec (pure: dicts in, dicts out).

The mesh arithmetic (the ("pp", "dp", "tp") grid, tp innermost; the stage split; what each
dimension means) is trainyard/mesh.py's, the same the runtime uses, so the page can say what
each rank will be before the runtime reports what it really holds (the `rank_plan` event). A
plan search (cost model over candidate meshes) is not built: `parallel: auto` means plain data
parallelism over every process.
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


def describe(spec: dict) -> dict:
    """The plan stored on the job and shown on its page: mesh shape, what each dimension means,
    the expected role of every rank, and the communication settings."""
    res, par, comm = spec["resources"], spec["parallel"], spec["comm"]
    world = int(res["nodes"]) * int(res["procs_per_node"])
    auto = par == "auto"
    tp = 1 if auto else int(par["tp"])
    pp = 1 if auto else int(par["pp"])
    fsdp = False if auto else bool(par["fsdp"])
    dp = world // (tp * pp) if auto or par.get("dp") is None else int(par["dp"])
    grid = Mesh(pp=pp, dp=dp, tp=tp, fsdp=fsdp)
    mesh = grid.shape
    dims = [{"name": d, "size": mesh[d], "meaning": grid.meaning(d)} for d in grid.dims()]
    stages = stage_layers(int(spec["model"]["layers"]), pp)
    heads = int(spec["model"].get("heads", 1))
    roles = []
    for rank in range(world):
        c = grid.coords(rank)
        bits = [f"replica {c['dp']}/{dp}" + (" (sharded)" if fsdp else "")]
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
            "balance": spec["train"]["balance"]}
    if pp > 1:
        plan["microbatches"] = int(par["microbatches"])
        plan["schedule"] = par["schedule"]
    return plan
