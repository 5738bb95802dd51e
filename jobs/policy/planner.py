"""The parallel plan of a job, described from its validated spec (pure: dicts in, dicts out).

The runtime lays the world out as a ("pp", "dp", "tp") grid, tp innermost (workers/runtime/
parallel.py, which the control plane must not import: it pulls in torch); `rank_coords` below is
the same arithmetic, so the page can say what each rank will be before the runtime reports what
it really holds (the `rank_plan` event). A plan search (cost model over candidate meshes) is not
built: `parallel: auto` means plain data parallelism over every process.
"""
from __future__ import annotations

MESH_ORDER = ("pp", "dp", "tp")
DIM_MEANING = {
    "pp": "pipeline stages: each holds a contiguous slice of the layers",
    "dp": "data parallel replicas: each trains on its own share of the global batch",
    "tp": "tensor parallel: attention heads and MLP columns split across these ranks",
}
FSDP_MEANING = ("data parallel, fully sharded (FSDP2): each replica holds 1/dp of the parameters, "
                "gradients and optimizer state")


def rank_coords(rank: int, mesh: dict[str, int]) -> dict[str, int]:
    dp, tp = mesh["dp"], mesh["tp"]
    return {"pp": rank // (dp * tp), "dp": (rank // tp) % dp, "tp": rank % tp}


def stage_layers(layers: int, pp: int) -> list[tuple[int, int]]:
    """[first, last] block of each stage, as even as possible (earlier stages get the extra)."""
    base, extra = divmod(layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n - 1))
        start += n
    return out


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
    mesh = {"pp": pp, "dp": dp, "tp": tp}
    dims = [{"name": d, "size": mesh[d],
             "meaning": FSDP_MEANING if (d == "dp" and fsdp) else DIM_MEANING[d]}
            for d in MESH_ORDER if mesh[d] > 1]
    layers = int(spec["model"]["layers"])
    stages = stage_layers(layers, pp)
    heads = int(spec["model"].get("heads", 1))
    roles = []
    for rank in range(world):
        c = rank_coords(rank, mesh)
        bits = [f"replica {c['dp']}/{dp}" + (" (sharded)" if fsdp else "")]
        if tp > 1:
            per = heads // tp
            bits.append(f"tp {c['tp']}/{tp}: heads {c['tp'] * per}-{(c['tp'] + 1) * per - 1}")
        if pp > 1:
            first, last = stages[c["pp"]]
            bits.append(f"stage {c['pp']}/{pp}: blocks {first}-{last}")
        roles.append({"rank": rank, "coords": c, "role": ", ".join(bits)})
    plan = {"dp": dp, "tp": tp, "pp": pp, "fsdp": fsdp, "world_size": world, "mesh": mesh,
            "order": list(MESH_ORDER), "dims": dims, "strategy": strategy_name(dp, tp, pp, fsdp),
            "roles": roles, "sync": comm["sync"], "compression": comm["compression"],
            "balance": spec["train"]["balance"]}
    if pp > 1:
        plan["microbatches"] = int(par["microbatches"])
        plan["schedule"] = par["schedule"]
    return plan
