"""The notifications' writes. `notify_event` is the one entry point for other domains' code above
this one (experiments): call it inside the writer's transaction; the fan-out is sent after commit."""
from jobs.notify.services.deliveries import delivery_body, delivery_try
from jobs.notify.services.fanout import notify_event, notify_fanout, resolve_event
from jobs.notify.services.subscriptions import (email_subscribe, hook_secret, sign, subscription_delete,
                                                subscription_update, webhook_check_url, webhook_create)

__all__ = ["delivery_body", "delivery_try", "email_subscribe", "hook_secret", "notify_event", "notify_fanout",
           "resolve_event", "sign", "subscription_delete", "subscription_update", "webhook_check_url", "webhook_create"]
