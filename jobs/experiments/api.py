"""The experiments API under /api/v1/experiments/: submit, list, detail, stop, continue a trial.
Parse, check access, call one service, serialize."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from jobs.core.errors import Forbidden
from jobs.core.throttles import SubmitThrottle
from jobs.experiments import selectors, services
from jobs.experiments.serializers import ExperimentListSerializer, ExperimentSerializer, ExperimentSubmittedSerializer

SUBMIT_BODY = {"application/json": {"type": "object", "required": ["spec", "search"], "properties": {
    "name": {"type": "string"},
    "spec": {"type": "object", "description": "the JobSpec template (docs/architecture.md, section 7)"},
    "search": {"type": "object", "description": "{metric, mode, space, algorithm, max_trials, max_concurrent, "
                                                "seed, early_stopping: {asha: {min_steps, reduction}}} "
                                                "(trainyard/search.py)"}}}}


class ExperimentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ExperimentSerializer

    def get_throttles(self):
        return [*super().get_throttles(), *([SubmitThrottle()] if self.action == "create" else [])]

    def get_queryset(self):
        qs = selectors.experiments_visible_to(self.request.user).order_by("-id")
        return qs.prefetch_related("trials") if self.action == "list" else qs

    def get_serializer_class(self):
        return ExperimentListSerializer if self.action == "list" else ExperimentSerializer

    @extend_schema(request=SUBMIT_BODY, responses={201: ExperimentSubmittedSerializer})
    def create(self, request):
        data = request.data
        if not isinstance(data, dict):
            raise ValidationError({"spec": ["send {name, spec, search} as a JSON object"]})
        unknown = sorted(set(data) - {"name", "spec", "search"})
        if unknown:
            raise ValidationError({k: ["unknown key"] for k in unknown})
        experiment = services.experiment_submit(user=request.user, name=data.get("name"), spec=data.get("spec"),
                                                search=data.get("search"))
        return Response(ExperimentSubmittedSerializer(experiment).data, status=status.HTTP_201_CREATED)

    def _may_change(self, request, experiment) -> None:
        if not (request.user.is_staff or experiment.owner_id == request.user.pk):
            raise Forbidden("only the experiment's owner or staff may change it")

    @extend_schema(request=None, responses={202: ExperimentSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        """Stop the search: running trials are cancelled, no new ones start."""
        experiment = self.get_object()
        self._may_change(request, experiment)
        experiment = services.experiment_stop(experiment, user=request.user)
        return Response(ExperimentSerializer(experiment).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: ExperimentSerializer})
    @action(detail=True, methods=["post"], url_path=r"trials/(?P<job_id>\d+)/continue")
    def continue_trial(self, request, pk=None, job_id=None):
        """Continue an early-stopped trial from its checkpoint (its job is queued again)."""
        experiment = self.get_object()
        self._may_change(request, experiment)
        services.trial_continue(experiment, job_id=int(job_id), user=request.user)
        experiment.refresh_from_db()
        return Response(ExperimentSerializer(experiment).data, status=status.HTTP_202_ACCEPTED)
