"""What users ask of their jobs: submit (the JobSpec parsed and planned, its code checked, run time predicted), cancel, and apply the profile's recommendation.
"""
from __future__ import annotations

from typing import TYPE_CHECKING
from functools import partial
from django.conf import settings
from django.db import transaction
from jobs.planning import autoplan, selectors as planning_selectors
from jobs.core import dispatch
from jobs.scheduling import selectors
from jobs.core.errors import InvalidInput, TooManyRequests, TransitionError
from jobs.models import Attempt, Job, JobTag
from jobs.planning.policy import adaptations, planner, predictor
from jobs.attempts.policy import profiling
from jobs.scheduling import policy as scheduling
from jobs.scheduling.policy import eligibility
from jobs.attempts.services.attempts import attempt_stop
from jobs.attempts.services.tuning import spec_change_apply, spec_value
from jobs.bundles.services import bundle_files
from jobs.attempts.services.elastic import check_counts, fixed_at
from jobs.attempts.services.events import job_event, job_set_status
from trainyard.spec import JobSpec, SpecError, parse_job_spec
from trainyard.tags import MAX_TAGS, note_problem, tag_problem, tags_problems


if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractUser


def _check_queued_cap(user) -> None:
    # One user must not fill the queue (and the scheduler's every tick) for everyone: checked before
    # the spec is even parsed. Two submits racing may both pass; the cap is a bound, not an exact count.
    cap = settings.TRAINYARD_MAX_QUEUED_JOBS_PER_USER
    if cap and Job.objects.filter(owner=user, status=Job.Status.QUEUED).count() >= cap:
        raise TooManyRequests({"spec": [f"you already have {cap} queued jobs, the most one user may have "
                                        f"waiting (TRAINYARD_MAX_QUEUED_JOBS_PER_USER); cancel one or wait "
                                        f"until one starts"]})


def submitted_spec(data: object) -> JobSpec:
    """The JobSpec a user submitted (their JSON/YAML mapping), parsed once at the edge (the API,
    the submit form, a task): SpecError naming each bad field, the data path checked against this
    control plane's data root. The services take the typed value from here on."""
    return parse_job_spec(data, data_root=settings.TRAINYARD_DATA_ROOT)


def job_submit(*, user: AbstractUser, spec: JobSpec) -> Job:
    """Queue a validated JobSpec (`submitted_spec`). Raises SpecError (nothing is created) when
    `parallel: auto` finds no plan that fits, or when the cluster's nodes could never hold a plain cpu job's shape;
    TooManyRequests (429) when the user already has TRAINYARD_MAX_QUEUED_JOBS_PER_USER jobs
    waiting. A job no registered node can serve (cuda on a CPU-only cluster, labels no node
    carries) is queued with `job.warnings` saying so (`placement_warnings`)."""
    if not isinstance(spec, JobSpec):
        raise TypeError("job_submit takes a parsed JobSpec (services.submitted_spec)")
    _check_queued_cap(user)
    parsed = spec
    code_errors = code_problems(parsed)
    if code_errors:
        raise SpecError(code_errors)
    r = parsed.resources
    everything = selectors.cluster_snapshot()
    nodes = [n for n in everything if n.pool == (r.pool or "")]  # a pool's seats, or Trainyard's own agents
    if r.pool and not nodes:
        pools = sorted({n.pool for n in everything if n.pool})
        raise SpecError({"resources.pool": [f"no pool named {r.pool}; "
                                            + (f"pools: {', '.join(pools)}" if pools else "staff have configured none")]})
    if not nodes:
        raise SpecError({"resources": ["no nodes have registered yet; start a node agent first"]})
    warnings = placement_warnings(nodes, parsed)
    least = r.min_nodes or r.nodes  # an elastic job runs on its least nodes too
    if not (r.device != "cpu" or r.labels) and not scheduling.fits_cluster(nodes, least, r.procs_per_node):
        biggest = max(n.slots for n in nodes)
        where = f"pool {r.pool}" if r.pool else "the cluster"
        raise SpecError({"resources": [
            f"needs {least} node(s) with {r.procs_per_node} slot(s) each, but {where} has "
            f"{len(nodes)} node(s) with at most {biggest} slot(s): it could never run"]})
    auto = None
    runs = parsed
    if parsed.parallel == "auto" and parsed.model is not None and parsed.model.kind == "gpt":
        # a new spec, running the best plan (an elastic job's for its most nodes; each attempt's
        # world is planned again: jobs/attempts/services/elastic.py)
        runs, auto = autoplan.resolve_auto(fixed_at(parsed.to_json(), r.nodes) if r.elastic else parsed)
    runs, learned = start_from_knowledge(runs) if parsed.adapt == "auto" else (runs, None)
    stored = runs.to_json()
    if r.elastic:  # dp follows the node count
        stored["resources"]["min_nodes"] = r.min_nodes
        if isinstance(stored["parallel"], dict):
            stored["parallel"]["dp"] = None
        check_counts(stored, {"auto": True} if auto is not None else None)
    elif runs.parallel != "auto":
        stored["parallel"]["dp"] = runs.dp
    plan = planner.describe(stored)
    plan["source"] = ("spec" if parsed.parallel != "auto" else
                      "auto: planned by run.prepare on the ranks from the model's shape" if parsed.user_code else
                      "auto: data parallel over all processes (an MLP is not searched)" if auto is None else
                      f"auto: the planner's best of {auto['candidates']} plans ({auto['constants_source']})")
    if parsed.parallel == "auto" and parsed.user_code:
        plan["auto_inputs"] = autoplan.user_model_inputs(parsed)  # carried in each Launch
    if auto is not None:
        plan["auto"] = auto
        # what the planner expects of the plan the job runs (searched once)
        plan["planner"] = autoplan.predicted(auto["chosen"], auto["constants_source"])
    elif parsed.model is not None and parsed.model.kind == "gpt":
        plan["planner"] = autoplan.predict_spec(runs)
    team = user.groups.order_by("name").first()
    shape = predictor.shape_from_spec(stored, user.get_username(), team.name if team else None)
    prediction = predictor.predict(shape, planning_selectors.past_runs(),
                                   knowledge=planning_selectors.knowledge_for_prediction(shape))
    plan["predicted_s"] = None if prediction.seconds is None else round(prediction.seconds, 1)
    plan["prediction_source"] = prediction.source
    with transaction.atomic():
        job = Job.objects.create(
            name=parsed.name, owner=user, team=team, spec=stored, plan=plan, predicted_s=prediction.seconds,
            priority=Job.PRIORITIES[parsed.priority], slots=r.world_size, status_reason="; ".join(warnings)[:500],
            note=parsed.note)
        JobTag.objects.bulk_create([JobTag(job=job, name=t) for t in parsed.tags])
        job_event(job, "submitted", f"submitted by {user.get_username()}", actor=user, plan_source=plan["source"],
                  **({"warnings": warnings} if warnings else {}))
        if learned is not None:
            job_event(job, "adapted", learned.pop("message"), cause="knowledge", **learned)
        job.warnings = warnings  # for the submit's response only (the API's `warnings`, the form's message)
        transaction.on_commit(dispatch.request_tick)
        transaction.on_commit(partial(dispatch.publish_cluster_changed, "jobs"))
    return job


def start_from_knowledge(spec: JobSpec) -> tuple[JobSpec, dict | None]:
    """An `adapt: auto` job starts from what worked (issue 24): the newest bottleneck change the
    knowledge base recorded as kept for this configuration (model shape, global batch, world,
    device type) whose replaced values the spec still has, validated like a submit (a change a
    spec rule refuses is skipped). (the spec to run, the "adapted" event's data) or (spec, None)."""
    stored = spec.to_json()
    device = "cpu" if spec.resources.device == "cpu" else autoplan.device_facts("cuda")["name"]
    outcomes = planning_selectors.adaptation_outcomes(stored, device_name=device)
    for o in adaptations.starting_changes(stored, outcomes):
        try:
            changed = profiling.spec_with_change(stored, o["change"])
        except (SpecError, KeyError, TypeError):
            continue
        new = changed.to_json()
        after = {k: spec_value(new, k) for k in o["change"]}
        before = {k: o["before"][k] for k in o["change"]}
        text = ", ".join(f"{k} {before[k]} -> {after[k]}" for k in after)
        gain = f"measured gain {o['measured_gain'] * 100:+.0f}%" if o["measured_gain"] is not None else "no gain measured"
        src = f"job {o['job']}" if o["job"] is not None else "a deleted job"
        return changed, {"message": f"started with {text}: the knowledge base's outcome for this model shape, batch "
                                    f"and world ({src} adapted so and kept it, {gain})",
                         "source_job": o["job"], "change": o["change"], "before": before, "after": after,
                         "measured_gain": o["measured_gain"]}
    return spec, None


def placement_warnings(nodes: list[scheduling.NodeState], spec: JobSpec) -> list[str]:
    """Why no registered node could run the job (its device, GPU memory, labels or shape), as a
    warning, not a refusal: the node it needs may join later, and the job waits for it."""
    r = spec.resources
    want = scheduling.QueuedJob(0, 1, r.nodes, r.procs_per_node,
                                **eligibility.job_requirement(spec.to_json()["resources"]))
    why = eligibility.unservable_reason(nodes, want, schedulable_only=False)
    return [f"{why}: the job waits until such a node joins"] if why else []


def code_problems(spec: JobSpec) -> dict[str, list[str]]:
    """An entrypoint job's code as SpecError.errors: code.bundle must name a stored bundle and
    entrypoint.script a file in it. A module is not checked: it may come from the nodes'
    PYTHONPATH as well as from the bundle."""
    if spec.code is None:
        return {}
    files = bundle_files(spec.code.bundle)
    if files is None:
        return {"code.bundle": [f"no code bundle {spec.code.bundle} is stored: upload it first "
                                f"(POST /api/v1/code/, or trainyard submit --code DIR)"]}
    script = spec.entrypoint.script if spec.entrypoint is not None else None
    if script is None or script in files:
        return {}
    scripts = sorted(f for f in files if f.endswith(".py"))
    hint = (f"; its Python files include {', '.join(scripts[:5])}{', ...' if len(scripts) > 5 else ''}"
            if scripts else "; it holds no .py file")
    return {"entrypoint.script": [f"{script} is not a file in bundle {spec.code.bundle[:19]}...{hint}"]}


def job_cancel(job: Job, *, user: AbstractUser) -> Job:
    """Cancel a job: at once while queued, else stop its attempt (the job ends CANCELLED when its
    processes exit). Raises TransitionError when the job already ended."""
    with transaction.atomic():
        job = Job.objects.get(pk=job.pk)
        if job.status in Job.TERMINAL:
            raise TransitionError(f"job is already {job.status}")
        if job.status == Job.Status.QUEUED:
            job_set_status(job, Job.Status.QUEUED, Job.Status.CANCELLED, f"cancelled by {user.get_username()}")
            job_event(job, "cancelled", f"cancelled by {user.get_username()} while queued", actor=user)
            return job
        Job.objects.filter(pk=job.pk).update(cancel_requested=True)
        job_set_status(job, Job.ACTIVE, Job.Status.STOPPING, f"cancel requested by {user.get_username()}")
        job_event(job, "cancel_requested", f"cancel requested by {user.get_username()}", actor=user)
        attempt = job.attempts.exclude(status=Attempt.Status.ENDED).order_by("-number").first()
        if attempt is not None:
            attempt_stop(attempt, reason="cancel")
    return job


def job_apply_recommendation(job: Job, *, user: AbstractUser, change: dict | None = None) -> Job:
    """Restart a running job from its latest checkpoint with the spec change its running
    attempt's profile recommends (services.profiling): the new spec is validated like a submit
    (SpecError: nothing changes), stored with its plan, recorded as a "recommendation_applied"
    event with the values before and after, and the attempt stops like a rollback (outcome
    rolled_back), so the next attempt resumes from the checkpoint with the new spec. `change`,
    when given, must be the recommendation the caller saw. Raises TransitionError (409) when the
    job is not running, recommends no change, has another one now, or has no checkpoint yet."""
    with transaction.atomic():
        job = Job.objects.get(pk=job.pk)
        attempt = job.attempts.filter(status=Attempt.Status.RUNNING, stop_reason="").order_by("-number").first()
        if job.status != Job.Status.RUNNING or attempt is None:
            raise TransitionError(f"the job is {job.status.lower()}: a recommendation applies to a running job")
        rec = (attempt.profile or {}).get("recommendation") or {}
        if not rec.get("change"):
            raise TransitionError("the job's profile recommends no spec change now", field="recommendation")
        if change is not None and change != rec["change"]:
            raise TransitionError(f"the recommendation changed to {rec['change']}: review it and apply again",
                                  field="change")
        who = user.get_username()
        spec_change_apply(job, attempt, dict(rec["change"]), kind="recommendation_applied", actor=user,
                          recommendation=rec.get("kind"), predicted_gain=rec.get("predicted_gain"),
                          predicted_step_s=rec.get("predicted_step_s"),
                          describe=lambda text, step: (f"{who} applied the recommendation ({text}); restarting "
                                                       f"from the checkpoint at step {step}"))
    job.refresh_from_db()
    return job


def job_annotate(job: Job, *, user: AbstractUser, tags: list[str] | None = None, add: list[str] | tuple = (),
                 remove: list[str] | tuple = (), note: str | None = None) -> Job:
    """Change a job's tags and note after submit (its owner, their team, staff: whoever may see the
    job; the caller checks that): `tags` replaces the whole set, or `add`/`remove` change it in
    the same transaction as the read (two people tagging at once both keep their tag); `note`
    replaces the note. InvalidInput (nothing changes) names each bad field: a tag outside
    trainyard/tags.py's charset, more than MAX_TAGS in the end, a note too long. One "annotated"
    event records what changed; an edit that changes nothing writes nothing."""
    errors: dict[str, list[str]] = {}
    if tags is not None and (add or remove):
        errors["tags"] = ["send either tags (the whole new set) or add/remove, not both"]
    if tags is not None:
        errors.update({"tags": problems} if (problems := tags_problems(tags)) else {})
    for field, values in (("tags_add", add), ("tags_remove", remove)):  # as the API names them
        if not isinstance(values, (list, tuple)) or len(values) > MAX_TAGS:
            errors[field] = [f"a list of at most {MAX_TAGS} tags"]
            continue
        if problems := [p for p in map(tag_problem, values) if p]:
            errors[field] = problems[:5]
    if note is not None and (problem := note_problem(note)):
        errors["note"] = [problem]
    if errors:
        raise InvalidInput(errors)
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job.pk)
        before = list(job.tags.values_list("name", flat=True))
        after = list(dict.fromkeys(tags)) if tags is not None else \
            [t for t in dict.fromkeys([*before, *add]) if t not in set(remove)]
        if len(after) > len(before) and (problems := tags_problems(after)):
            raise InvalidInput({"tags" if tags is not None else "tags_add": problems})
        added = [t for t in after if t not in before]
        removed = [t for t in before if t not in after]
        note_changed = note is not None and note != job.note
        if not (added or removed or note_changed):
            return job
        job.tags.filter(name__in=removed).delete()
        JobTag.objects.bulk_create([JobTag(job=job, name=t) for t in added])
        what = [*(f"+{t}" for t in added), *(f"-{t}" for t in removed)]
        data: dict = {"tags": sorted(after), "added": added, "removed": removed}
        if note_changed:
            Job.objects.filter(pk=job.pk).update(note=note)
            job.note = note
            what.append("note cleared" if not note else "note changed")
            data["note"] = note
        job_event(job, "annotated", f"{user.get_username()} edited: {', '.join(what)}", actor=user, **data)
    return job
