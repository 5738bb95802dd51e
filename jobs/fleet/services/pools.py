"""Staff configure pools (issue 27): a Slurm pool's settings are checked by trainyard.slurm's
SlurmSettings (every bad field named), and its seats follow `max_nodes` (seats beyond it are
removed when idle, cordoned while a job still holds them)."""
from __future__ import annotations

from django.db import transaction
from pydantic import ValidationError

from jobs.core import dispatch
from jobs.core.errors import InvalidInput
from jobs.models import Allocation, Node, Pool
from jobs.models.pools import MAX_POOL_NODES

GB = 1e9
POOL_FIELDS = ("kind", "enabled", "max_nodes", "slots_per_node", "device", "gpu_memory_gb", "settings",
               "agent_python", "agent_code_dir", "agent_run_dir", "agent_env")


def pool_check(fields: dict) -> dict:
    """The fields of a pool, checked; InvalidInput naming each bad one (`settings.<field>` for the
    Slurm settings' own)."""
    from trainyard.slurm import SlurmSettings

    errors: dict[str, list[str]] = {}
    unknown = sorted(set(fields) - set(POOL_FIELDS))
    if unknown:
        errors["detail"] = [f"unknown fields: {', '.join(unknown)}"]
    for key, top in (("max_nodes", MAX_POOL_NODES), ("slots_per_node", 64)):
        value = fields.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            errors[key] = [f"a whole number between 1 and {top}"]
    if fields.get("device", "cpu") not in ("cpu", "cuda"):
        errors["device"] = ["cpu or cuda"]
    env = fields.get("agent_env") or {}
    if not isinstance(env, dict) or any(not str(k).replace("_", "").isalnum() or str(k).startswith("TRAINYARD_NODE")
                                        for k in env):
        errors["agent_env"] = ["an object of VARIABLE: value (no TRAINYARD_NODE_* variables)"]
    for key in ("agent_python", "agent_code_dir", "agent_run_dir"):
        value = fields.get(key, "")
        if not isinstance(value, str) or (value and not value.startswith("/")):
            errors[key] = ["an absolute path on the compute nodes"]
    try:
        fields["settings"] = SlurmSettings.model_validate(fields.get("settings") or {}).model_dump(mode="json")
    except ValidationError as exc:
        for err in exc.errors():
            path = ".".join(str(p) for p in ("settings", *err["loc"]))
            errors.setdefault(path, []).append(err["msg"])
    if errors:
        raise InvalidInput(errors)
    return fields


@transaction.atomic
def pool_save(name: str, **fields) -> Pool:
    """Create or update the pool `name` and bring its seats in line (one transaction)."""
    fields = pool_check(fields)
    pool = Pool.objects.select_for_update().filter(name=name).first()
    if pool is None:
        pool = Pool(name=name)
        pool.full_clean(exclude=[f for f in POOL_FIELDS if f not in fields] + ["settings"], validate_unique=True)
    for key, value in fields.items():
        setattr(pool, key, value)
    pool.save()
    seats_sync(pool)
    transaction.on_commit(dispatch.request_tick)
    return pool


def seat_names(pool: Pool) -> list[str]:
    return [f"{pool.name}-{i}" for i in range(pool.max_nodes)]


def seat_shape(pool: Pool) -> dict:
    """What an idle seat offers the scheduler: the pool's slots and device (a heartbeat overwrites
    them with what the node really has while a job holds it; the release puts these back)."""
    gpus = pool.slots_per_node if pool.device == "cuda" else 0
    return {"slots": pool.slots_per_node, "slots_approved": pool.slots_per_node, "device_kind": pool.device,
            "gpu_count": gpus, "gpu_memory_bytes": int((pool.gpu_memory_gb or 0) * GB), "devices": [],
            "labels": {"pool": pool.name}}


def seats_sync(pool: Pool) -> None:
    """One seat per node the pool may hold: created READY (the pool's device and slots; no address,
    no credential until a Slurm job holds it), the rest removed when idle, cordoned while held."""
    wanted = seat_names(pool)
    taken = Node.objects.filter(name__in=wanted).exclude(pool=pool).values_list("name", flat=True).first()
    if taken:
        raise InvalidInput({"name": [f"node {taken} exists and is not a seat of pool {pool.name}: choose another name"]})
    shape = seat_shape(pool)
    for name in wanted:
        node, created = Node.objects.get_or_create(name=name, defaults={"pool": pool, "address": "", **shape})
        if not created and node.holder_id is None:
            Node.objects.filter(pk=node.pk).update(**shape, status=Node.Status.READY if pool.enabled
                                                   else Node.Status.CORDONED, drain_mode="")
    if not pool.enabled:
        Node.objects.filter(pool=pool, holder=None).update(status=Node.Status.CORDONED)
    for node in Node.objects.filter(pool=pool).exclude(name__in=wanted):
        busy = node.holder_id is not None or Allocation.objects.filter(node=node).exists()
        if busy:
            Node.objects.filter(pk=node.pk).update(status=Node.Status.CORDONED, drain_mode="cordon")
        else:
            node.delete()
    dispatch.publish_cluster_changed("nodes")
