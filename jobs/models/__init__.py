"""Trainyard's state, one module per domain (as Zulip's zerver/models/), all re-exported here so
`from jobs.models import Job` works anywhere. Rows change only through the domains' services
(docs/architecture.md, section 5)."""
from jobs.models.access import ApiToken
from jobs.models.attempts import Allocation, Attempt, Checkpoint, JobEvent
from jobs.models.bundles import CodeBundle
from jobs.models.experiments import Experiment, ExperimentEvent, Trial
from jobs.models.fleet import ControlPlaneClock, Node, NodeJoinRequest, SecurityEvent
from jobs.models.notify import Delivery, DeliveryAttempt, Subscription
from jobs.models.pools import Pool, SlurmJob
from jobs.models.planning import AdaptationOutcome, Calibration, KnowledgeRecord
from jobs.models.runs import Job, JobTag
from jobs.models.scheduling import Quota, QuotaChange, SchedulerLock
from jobs.models.telemetry import MetricSample, MetricStep, RetentionPolicy

__all__ = ["AdaptationOutcome", "Allocation", "ApiToken", "Attempt", "Calibration", "Checkpoint", "CodeBundle",
           "ControlPlaneClock", "Delivery", "DeliveryAttempt", "Experiment", "ExperimentEvent", "Job", "JobEvent",
           "JobTag", "KnowledgeRecord", "MetricSample", "MetricStep", "Node", "NodeJoinRequest", "Pool", "Quota", "QuotaChange",
           "RetentionPolicy", "SchedulerLock", "SecurityEvent", "SlurmJob", "Subscription", "Trial"]
