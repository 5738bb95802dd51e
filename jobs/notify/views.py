"""The notifications page (/notifications/): your webhooks and email subscriptions, their recent
deliveries, and forms to add, pause, resume and delete them. A new hook's secret is shown on the
answer to its form, once. The same services as the API; refusals are shown as the API's field
errors (400)."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from jobs.core.errors import DomainError
from jobs.models import Subscription
from jobs.notify import selectors, services
from jobs.notify.policy.events import EVENTS, FORMATS, STAFF_EVENTS
from jobs.notify.rows import delivery_row, subscription_row
from trainyard.textdoc import whole_number

RECENT = 5


def _context(request, **extra) -> dict:
    subs = []
    for sub in selectors.subscriptions_of(request.user):
        row = subscription_row(sub)
        row["deliveries"] = [delivery_row(d) for d in selectors.deliveries_of(sub)[:RECENT]]
        subs.append(row)
    events = [e for e in EVENTS if request.user.is_staff or e not in STAFF_EVENTS]
    teams = list(request.user.groups.order_by("name").values_list("name", flat=True))
    return {"subs": subs, "events": events, "formats": FORMATS, "teams": teams, **extra}


def _create(request):
    p = request.POST
    events, team = p.getlist("events"), p.get("team") or None
    if p.get("channel") == Subscription.Channel.WEBHOOK:
        hook, secret = services.webhook_create(user=request.user, url=p.get("url", ""), events=events, team=team,
                                               fmt=p.get("format", "json"))
        return {"created": subscription_row(hook), "secret": secret}
    services.email_subscribe(user=request.user, events=events, team=team)
    return None


@login_required
@require_http_methods(["GET", "POST"])
def notifications(request):
    if request.method == "GET":
        return render(request, "jobs/notifications.html", _context(request))
    action = request.POST.get("action")
    try:
        if action == "create":
            shown = _create(request)
            if shown:  # the secret, this once: rendered, not redirected to
                return render(request, "jobs/notifications.html", _context(request, **shown), status=201)
        elif action in ("pause", "resume", "delete"):
            raw = request.POST.get("id", "")
            sub = selectors.subscription_of(request.user, whole_number(raw) or 0)
            if action == "delete":
                services.subscription_delete(sub, user=request.user)
            else:
                services.subscription_update(sub, user=request.user, changes={"active": action == "resume"})
        else:
            return render(request, "jobs/notifications.html", _context(request, errors={"action": ["unknown action"]}),
                          status=400)
    except DomainError as exc:
        return render(request, "jobs/notifications.html", _context(request, errors=exc.errors, form=request.POST),
                      status=exc.status_code)
    return redirect("notifications")
