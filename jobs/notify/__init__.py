"""Notifications (issue 25): per-user and per-team subscriptions to job, experiment, node and quota
events, delivered by email and by signed webhooks from the control worker after commit."""
