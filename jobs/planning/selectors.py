"""Reads of the knowledge base (`KnowledgeRecord`, written by jobs/planning/services/knowledge.py): who
may see which records, the records nearest a configuration, the best measured plan per model
shape and cluster, and the nearest measured step times the run-time predictor uses; and of its
adaptation outcomes (`AdaptationOutcome`): the plans that ran out of memory in a configuration,
the bottleneck outcomes recorded for one (`adaptation_outcomes`), and who may see which. A sibling
of jobs/scheduling/selectors.py under the same contract (reads never import the API, serializers, payloads
or services); jobs/planning/policy/knowledge.py does the ranking and the aggregation.

`shape` is a model dict as the planner takes it ({kind, layers, hidden, heads, seq_len, vocab},
plus "global_batch" when known); `cluster` is the planner's ({nodes, devices_per_node, device:
{name} or a name}); a device name "cpu" means CPU processes, "cuda" any GPU, anything else that
exact device type.
"""
from __future__ import annotations

from collections.abc import Mapping

from django.db.models import Q, QuerySet

from jobs.models import AdaptationOutcome, Attempt, KnowledgeRecord, Node
from jobs.planning.policy import adaptations, knowledge
from jobs.planning.policy.predictor import JobShape, MeasuredStep

# Records ranked per query, newest first (the ranking itself is in Python).
CANDIDATES = 5000
# Records the predictor is given (it keeps the nearest group of them).
PREDICTOR_CANDIDATES = 20
# What ranking needs of a row (the rest stays in the database).
RANK_FIELDS = ("id", "kind", "layers", "hidden", "heads", "seq_len", "vocab", "global_batch", "nodes",
               "procs_per_node", "device_name", "step_time_s", "predicted_step_time_s", "created_at",
               *knowledge.PLAN_FIELDS)


def knowledge_visible_to(user) -> QuerySet[KnowledgeRecord]:
    """Records of jobs the user can see: their own and their teams' (staff: every record, also
    those whose job was deleted)."""
    qs = KnowledgeRecord.objects.select_related("job", "attempt")
    if user.is_staff:
        return qs
    return qs.filter(Q(job__owner=user) | Q(job__team__in=user.groups.all())).distinct()


def knowledge_filter(qs: QuerySet[KnowledgeRecord], *, kind: str | None = None, device: str | None = None,
                     layers: int | None = None, hidden: int | None = None) -> QuerySet[KnowledgeRecord]:
    """The API's and the page's filters (already validated)."""
    if kind is not None:
        qs = qs.filter(kind=kind)
    if device is not None:
        qs = qs.filter(_device_q(device))
    if layers is not None:
        qs = qs.filter(layers=layers)
    if hidden is not None:
        qs = qs.filter(hidden=hidden)
    return qs


def _device_q(name: str) -> Q:
    if name == "cuda":
        return ~Q(device_name="cpu")
    return Q(device_name=name)


def _device_of(cluster: Mapping) -> str:
    dev = cluster.get("device", "cpu")
    return str(dev.get("name", "cpu") if isinstance(dev, Mapping) else dev)


def _world_of(cluster: Mapping) -> int | None:
    nodes, per = cluster.get("nodes"), cluster.get("devices_per_node", cluster.get("procs_per_node"))
    return int(nodes) * int(per) if nodes and per else None


def _point(r: KnowledgeRecord) -> knowledge.Point:
    return knowledge.Point(r.pk, r.layers, r.hidden, r.seq_len, r.global_batch or 0, r.world, r.step_time_s,
                           plan={k: getattr(r, k) for k in knowledge.PLAN_FIELDS}, created=r.created_at.timestamp())


def _query(shape: Mapping, cluster: Mapping) -> dict:
    return {"layers": shape.get("layers"), "hidden": shape.get("hidden"), "seq_len": shape.get("seq_len"),
            "global_batch": shape.get("global_batch"), "world": _world_of(cluster)}


def _candidates(shape: Mapping, cluster: Mapping) -> list[KnowledgeRecord]:
    qs = KnowledgeRecord.objects.filter(kind=shape.get("kind", "gpt"), layers__isnull=False).filter(
        _device_q(_device_of(cluster)))
    return list(qs.order_by("-id").only(*RANK_FIELDS)[:CANDIDATES])


def knowledge_nearest(shape: Mapping, cluster: Mapping, plan: Mapping | None = None,
                      limit: int = 5) -> list[KnowledgeRecord]:
    """The `limit` records of the same model kind and device type nearest this configuration:
    those that ran `plan` first (only the plan fields given are compared), then by the distance
    over the log-ratios of layers, hidden, seq_len, global_batch and world size (each record
    carries it as `.distance`), newest first among equals. Every record is read, whoever ran it."""
    rows = {r.pk: r for r in _candidates(shape, cluster)}
    ranked = knowledge.rank_nearest(_query(shape, cluster), [_point(r) for r in rows.values()], plan, limit)
    out = []
    for point, dist in ranked:
        r = rows[point.id]
        r.distance = dist
        r.plan_match = knowledge.plan_matches(point.plan, plan)
        out.append(r)
    return out


BEST_FIELDS = (*knowledge.SHAPE_FIELDS, "global_batch", "nodes", "procs_per_node", "device_name",
               *knowledge.PLAN_FIELDS, "tokens_per_s", "step_time_s", "tflops_per_device", "mem_bytes")


def knowledge_best_table(qs: QuerySet[KnowledgeRecord] | None = None) -> list[dict]:
    """The best measured plan per model shape (and global batch) and cluster, by tokens/s, over
    `qs` (default: every record). No job ids or owners: aggregates only."""
    qs = KnowledgeRecord.objects.all() if qs is None else qs
    return knowledge.best_plans(qs.filter(kind__isnull=False).order_by().values(*BEST_FIELDS))


def knowledge_best(shape: Mapping, cluster: Mapping) -> dict | None:
    """The best measured plan for exactly this model shape and cluster (and global batch, when
    `shape` gives one), or None when nothing of it was measured."""
    qs = KnowledgeRecord.objects.filter(_device_q(_device_of(cluster)), **{
        k: shape[k] for k in (*knowledge.SHAPE_FIELDS, "global_batch") if shape.get(k) is not None})
    if cluster.get("nodes"):
        qs = qs.filter(nodes=cluster["nodes"])
    per = cluster.get("devices_per_node", cluster.get("procs_per_node"))
    if per:
        qs = qs.filter(procs_per_node=per)
    best = knowledge_best_table(qs)
    return max(best, key=lambda b: b["tokens_per_s"]) if best else None


def _cuda_names() -> list[str]:
    names = set()
    for devices in Node.objects.values_list("devices", flat=True):
        for d in devices or []:
            if isinstance(d, dict) and d.get("kind") == "cuda" and d.get("name"):
                names.add(str(d["name"]))
    return sorted(names)


def knowledge_for_prediction(shape: JobShape) -> list[MeasuredStep]:
    """The records nearest a built-in job (same kind; its device type: cpu, or the GPU types the
    nodes report), nearest first, as the run-time predictor takes them. None for user code."""
    if shape.entrypoint is not None:
        return []
    if shape.device == "cuda":
        names = _cuda_names()
        device_q = Q(device_name__in=names) if names else ~Q(device_name="cpu")
    else:
        device_q = Q(device_name="cpu")
    rows = {r.pk: r for r in KnowledgeRecord.objects.filter(device_q, kind=shape.kind, layers__isnull=False)
            .order_by("-id").only(*RANK_FIELDS)[:CANDIDATES]}
    query = {"layers": shape.layers, "hidden": shape.hidden, "seq_len": shape.seq_len,
             "global_batch": shape.global_batch, "world": shape.world_size}
    ranked = knowledge.rank_nearest(query, [_point(r) for r in rows.values()], None, PREDICTOR_CANDIDATES)
    out = []
    for point, dist in ranked:
        r = rows[point.id]
        near = JobShape(kind=r.kind, layers=r.layers, hidden=r.hidden, heads=r.heads or 1, seq_len=r.seq_len,
                        vocab=r.vocab or 1, global_batch=r.global_batch or 1, nodes=r.nodes,
                        procs_per_node=r.procs_per_node, device="cpu" if r.device_name == "cpu" else "cuda")
        out.append(MeasuredStep(near, r.step_time_s, dist))
    return out


# ---------------------------------------------------------------- adaptation outcomes

def adaptations_visible_to(user) -> QuerySet[AdaptationOutcome]:
    """Outcomes of jobs the user can see (staff: all, also those whose job was deleted)."""
    qs = AdaptationOutcome.objects.select_related("job")
    if user.is_staff:
        return qs
    return qs.filter(Q(job__owner=user) | Q(job__team__in=user.groups.all())).distinct()


def _config_q(shape: Mapping, global_batch, nodes, procs_per_node) -> Q | None:
    if not shape.get("kind") or any(shape.get(k) is None for k in knowledge.SHAPE_FIELDS):
        return None
    return Q(model_kind=shape["kind"], global_batch=global_batch, nodes=nodes, procs_per_node=procs_per_node,
             **{k: shape[k] for k in knowledge.SHAPE_FIELDS if k != "kind"})


def oomed_plans(shape: Mapping, cluster: Mapping) -> list[adaptations.OomedPlan]:
    """The plans that ran out of memory in exactly this configuration (model shape with
    "global_batch", cluster {nodes, procs_per_node, device}), newest first."""
    q = _config_q(shape, shape.get("global_batch"), cluster.get("nodes"),
                  cluster.get("devices_per_node", cluster.get("procs_per_node")))
    if q is None:
        return []
    rows = AdaptationOutcome.objects.filter(q, kind=AdaptationOutcome.Kind.OOM, device_name=_device_of(cluster))
    return [adaptations.OomedPlan(r.job_id, r.attempt_number, {k: getattr(r, k) for k in knowledge.PLAN_FIELDS},
                                  r.limit_gb, r.device_memory_gb) for r in rows.order_by("-id")[:CANDIDATES]]


def outcome_dict(r: AdaptationOutcome) -> dict:
    return {"id": r.pk, "job": r.job_id, "attempt_number": r.attempt_number, "class": r.bottleneck_class,
            "change": r.change or {}, "before": r.before or {}, "outcome": r.outcome, "measured_gain": r.measured_gain,
            "predicted_gain": r.predicted_gain, "step_s_before": r.step_s_before, "step_s_after": r.step_s_after,
            "created_at": r.created_at.isoformat()}


def adaptation_outcomes(spec: Mapping, *, nodes: int | None = None, device_name: str | None = None) -> list[dict]:
    """The bottleneck outcomes recorded for this stored spec's configuration (model shape, global
    batch, world, device type), newest first, as dicts (outcome_dict: change, before, outcome
    kept|reverted, measured_gain, ...). `nodes`: the world's node count when it is not the spec's
    (an elastic job's attempt); `device_name`: the exact device type (default: "cpu" for a CPU
    job, any GPU type for a cuda one). User code has no shape: nothing."""
    model = spec.get("model") if not spec.get("entrypoint") else None
    res = spec.get("resources") or {}
    if not isinstance(model, Mapping):
        return []
    q = _config_q(model, (spec.get("train") or {}).get("global_batch"), nodes or res.get("nodes", 1),
                  res.get("procs_per_node", 1))
    if q is None:
        return []
    device = device_name or ("cpu" if res.get("device", "cpu") == "cpu" else "cuda")
    rows = AdaptationOutcome.objects.filter(q, _device_q(device), kind=AdaptationOutcome.Kind.BOTTLENECK)
    return [outcome_dict(r) for r in rows.order_by("-id")[:CANDIDATES]]


PAST_RUNS = 500


def past_runs() -> list:
    """The predictor's history: attempts that ran to the end, newest PAST_RUNS."""
    from jobs.planning.policy.predictor import PastRun, shape_from_spec

    out = []
    for a in (Attempt.objects.filter(outcome="succeeded", started_at__isnull=False, ended_at__isnull=False)
              .select_related("job__team", "job__owner").order_by("-ended_at")[:PAST_RUNS]):
        job = a.job
        # An entrypoint job's steps are the ones it reported (none without the SDK), not train.steps.
        steps = (a.last_step if job.spec.get("entrypoint") else job.total_steps) - (a.resumed_from_step or 0)
        out.append(PastRun(shape_from_spec(job.spec, job.owner.username, job.team.name if job.team_id else None),
                           (a.ended_at - a.started_at).total_seconds(), max(0, steps), a.ended_at.timestamp()))
    return out
