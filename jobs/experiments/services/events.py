"""An experiment's timeline (as JobEvent is a job's), and the one place its end is announced."""
from __future__ import annotations

from functools import partial

from django.db import transaction

from django.conf import settings

from jobs.core import dispatch
from jobs.models import Experiment, ExperimentEvent
from jobs.notify.services import notify_event


def experiment_event(experiment: Experiment, kind: str, message: str, **data) -> ExperimentEvent:
    """One entry of the experiment's timeline; the experiment page hears of it after commit."""
    event = ExperimentEvent.objects.create(experiment=experiment, kind=kind, message=message[:1000], data=data)
    payload = {"type": "experiment.event", "event": {"kind": kind, "message": event.message, "data": data,
                                                    "at": event.created_at.isoformat()}}
    transaction.on_commit(partial(dispatch.publish, f"experiment.{experiment.pk}", payload))
    return event


def _experiment_ended(experiment: Experiment) -> None:
    """The experiment reached an end (succeeded, failed, stopped): called once per ending, inside
    the transaction that ended it. Writes the "ended" event and announces `experiment.ended` to its
    owner's and team's subscriptions (jobs/notify: sent after commit)."""
    best = experiment.trials.exclude(metric=None).order_by("metric" if experiment.search.get("mode") != "max"
                                                           else "-metric", "number").first()
    experiment_event(experiment, "ended", f"experiment {experiment.status}"
                     + (f": {experiment.status_reason}" if experiment.status_reason else ""),
                     status=experiment.status, best_job=best.job_id if best else None,
                     best_metric=best.metric if best else None)
    link = f"{settings.TRAINYARD_PUBLIC_URL}/experiments/{experiment.pk}/" if settings.TRAINYARD_PUBLIC_URL else ""
    notify_event("experiment.ended", user=experiment.owner, team=experiment.team, data={
        "experiment": experiment.pk, "name": experiment.name, "status": experiment.status,
        "reason": experiment.status_reason, "metric": experiment.search.get("metric"), "url": link,
        "best": {"job": best.job_id, "values": best.values, "metric": best.metric} if best else None})
