"""The nodes API: list and detail, and the staff actions drain/cordon/uncordon/clear.
"""
from __future__ import annotations
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from trainyard.textdoc import echo
from jobs.core.http import require_staff
from jobs.fleet.services import nodes as fleet_services_nodes
from jobs.core.dbtext import text_problem
from jobs.core.errors import NotFound
from jobs.models import Node
from jobs.fleet.serializers import NodeSerializer


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = NodeSerializer
    queryset = Node.objects.all().order_by("name")
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    def get_object(self):
        name = self.kwargs["name"]
        # no node has a name with NUL (PostgreSQL's text refuses it: the lookup raised, a 500)
        node = None if text_problem(name) else self.get_queryset().filter(name=name).first()
        if node is None:
            raise NotFound({"node": [f"no node named {echo(self.kwargs['name'])}"]})
        return node

    def _schedulable(self, request, action: str):
        node = self.get_object()
        require_staff(request, f"{action} nodes")
        mode = request.data.get("mode") if isinstance(request.data, dict) else None
        node = fleet_services_nodes.node_set_schedulable(node, user=request.user, action=action, mode=mode)
        return Response(NodeSerializer(node).data)

    @extend_schema(request={"application/json": {"type": "object", "properties": {
        "mode": {"type": "string", "enum": ["finish", "preempt"]}}, "required": ["mode"]}}, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """No new work; running jobs finish ("finish") or checkpoint and move ("preempt") (staff)."""
        return self._schedulable(request, "drain")

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request, name=None):
        """No new work; running jobs continue (staff)."""
        return self._schedulable(request, "cordon")

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request, name=None):
        """The node takes new work again (staff)."""
        return self._schedulable(request, "uncordon")

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def clear(self, request, name=None):
        """Lift the node's quarantine (staff)."""
        node = self.get_object()
        require_staff(request, "clear a quarantine")
        node = fleet_services_nodes.node_clear(node, user=request.user)
        return Response(NodeSerializer(node).data)
