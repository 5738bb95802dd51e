"""The notifications API: `/api/v1/webhooks/` (list own, create: 201 with the secret, once),
`/api/v1/webhooks/<id>/` (read, PATCH events/active/format, DELETE), `/api/v1/webhooks/<id>/deliveries/`
(the delivery log, owner only) and the same for email at `/api/v1/subscriptions/`. Thin: parse,
call one service, render; someone else's subscription is a 404, like one that does not exist."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework.pagination import PageNumberPagination
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.core.errors import InvalidInput
from jobs.models import Subscription
from jobs.notify import selectors, services
from jobs.notify.policy.events import EVENTS, FORMATS
from jobs.notify.rows import delivery_row, subscription_row

WEBHOOK = Subscription.Channel.WEBHOOK
EMAIL = Subscription.Channel.EMAIL
_EVENTS_SCHEMA = {"type": "array", "items": {"type": "string", "enum": list(EVENTS)}}
HOOK_REQUEST = {"application/json": {"type": "object", "required": ["url", "events"], "properties": {
    "url": {"type": "string"}, "events": _EVENTS_SCHEMA, "team": {"type": "string"},
    "format": {"type": "string", "enum": list(FORMATS)}}}}
EMAIL_REQUEST = {"application/json": {"type": "object", "required": ["events"], "properties": {
    "events": _EVENTS_SCHEMA, "team": {"type": "string"}}}}
PATCH_REQUEST = {"application/json": {"type": "object", "properties": {
    "events": _EVENTS_SCHEMA, "active": {"type": "boolean"}, "format": {"type": "string", "enum": list(FORMATS)}}}}


def _body(request, allowed: set[str] | None) -> dict:
    """The JSON object sent; `allowed`: its only fields (None: the service judges them)."""
    data = request.data
    if not isinstance(data, dict):
        raise InvalidInput("send a JSON object")
    unknown = sorted(set(data) - allowed) if allowed is not None else []
    if unknown:
        raise InvalidInput({k: ["unknown field"] for k in unknown})
    return data


def _page(view, request, qs, row):
    pager = PageNumberPagination()
    page = pager.paginate_queryset(qs, request, view=view)
    return pager.get_paginated_response([row(x) for x in page])


class WebhookListView(APIView):
    @extend_schema(operation_id="webhooks_list", responses={200: {"type": "object"}})
    def get(self, request):
        """Your webhooks (never their secrets), newest first."""
        return _page(self, request, selectors.subscriptions_of(request.user, channel=WEBHOOK), subscription_row)

    @extend_schema(operation_id="webhooks_create", request=HOOK_REQUEST, responses={201: {"type": "object"}})
    def post(self, request):
        """A webhook: 201 with its `secret`, shown this once (the HMAC key of X-Trainyard-Signature)."""
        data = _body(request, {"url", "events", "team", "format"})
        hook, secret = services.webhook_create(user=request.user, url=data.get("url"), events=data.get("events"),
                                               team=data.get("team"), fmt=data.get("format", "json"))
        return Response({**subscription_row(hook), "secret": secret}, status=201)


class SubscriptionListView(APIView):
    @extend_schema(operation_id="subscriptions_list", responses={200: {"type": "object"}})
    def get(self, request):
        """Your email subscriptions, newest first."""
        return _page(self, request, selectors.subscriptions_of(request.user, channel=EMAIL), subscription_row)

    @extend_schema(operation_id="subscriptions_create", request=EMAIL_REQUEST, responses={201: {"type": "object"}})
    def post(self, request):
        """An email subscription: to you, or (`team`) to every member of one of your teams."""
        data = _body(request, {"events", "team"})
        sub = services.email_subscribe(user=request.user, events=data.get("events"), team=data.get("team"))
        return Response(subscription_row(sub), status=201)


class _Detail(APIView):
    channel = WEBHOOK

    @extend_schema(responses={200: {"type": "object"}})
    def get(self, request, pk: int):
        return Response(subscription_row(selectors.subscription_of(request.user, pk, channel=self.channel)))

    @extend_schema(request=PATCH_REQUEST, responses={200: {"type": "object"}})
    def patch(self, request, pk: int):
        """Change `events`, `active` (and a webhook's `format`)."""
        sub = selectors.subscription_of(request.user, pk, channel=self.channel)
        changes = _body(request, None)
        return Response(subscription_row(services.subscription_update(sub, user=request.user, changes=changes)))

    @extend_schema(responses={204: None})
    def delete(self, request, pk: int):
        sub = selectors.subscription_of(request.user, pk, channel=self.channel)
        services.subscription_delete(sub, user=request.user)
        return Response(status=204)


def _detail_ids(prefix: str):
    return extend_schema_view(get=extend_schema(operation_id=f"{prefix}_retrieve"),
                              patch=extend_schema(operation_id=f"{prefix}_partial_update"),
                              delete=extend_schema(operation_id=f"{prefix}_destroy"))


@_detail_ids("webhooks")
class WebhookDetailView(_Detail):
    channel = WEBHOOK


@_detail_ids("subscriptions")
class SubscriptionDetailView(_Detail):
    channel = EMAIL


class DeliveryListView(APIView):
    channel = WEBHOOK

    @extend_schema(responses={200: {"type": "object"}})
    def get(self, request, pk: int):
        """The delivery log, newest first: each delivery's status and every try (owner only)."""
        sub = selectors.subscription_of(request.user, pk, channel=self.channel)
        return _page(self, request, selectors.deliveries_of(sub), delivery_row)


@extend_schema_view(get=extend_schema(operation_id="webhooks_deliveries_list"))
class WebhookDeliveryListView(DeliveryListView):
    channel = WEBHOOK


@extend_schema_view(get=extend_schema(operation_id="subscriptions_deliveries_list"))
class SubscriptionDeliveryListView(DeliveryListView):
    channel = EMAIL
