"""The control plane's Celery app: serves the `control` queue (jobs.tasks) and sends to the node
agents' queues by task name (jobs.dispatch), so jobs/ never imports workers/. Broker: Django's
settings.REDIS_URL; configuration: trainyard.launch.CELERY_SETTINGS, the same as the agents'.
controlplane.celery adds the beat schedule."""
from __future__ import annotations

from celery import Celery
from django.conf import settings

from trainyard.launch import CELERY_SETTINGS

app = Celery("trainyard-control", broker=settings.REDIS_URL, include=["jobs.tasks"])
app.conf.update(CELERY_SETTINGS)
