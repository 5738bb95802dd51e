"""The planner's memory: the knowledge base and device calibrations."""
from __future__ import annotations

from django.conf import settings
from django.db import models

from jobs.models.attempts import Attempt
from jobs.models.runs import Job


class KnowledgeRecord(models.Model):
    """What one finished attempt measured (jobs/planning/services/knowledge.py writes it when the attempt
    ends, from its warm steps; jobs/planning/policy/knowledge.py computes it): model shape, plan, where it
    ran, measured step time, peak memory and throughput, and what the planner predicted. The
    planner, the run-time predictor and the knowledge page read these. A user-code job's record
    has no model shape (null fields). Kept when its job is deleted."""

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="knowledge")
    attempt = models.OneToOneField(Attempt, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="knowledge")
    # model shape (null for user code)
    kind = models.CharField(max_length=16, null=True, blank=True)
    layers = models.PositiveIntegerField(null=True, blank=True)
    hidden = models.PositiveIntegerField(null=True, blank=True)
    heads = models.PositiveIntegerField(null=True, blank=True)
    seq_len = models.PositiveIntegerField(null=True, blank=True)
    vocab = models.PositiveIntegerField(null=True, blank=True)
    params = models.BigIntegerField(null=True, blank=True)
    global_batch = models.PositiveIntegerField(null=True, blank=True)
    # the plan, in the planner's terms (trainyard/plan)
    dp = models.PositiveIntegerField(null=True, blank=True)
    tp = models.PositiveIntegerField(null=True, blank=True)
    pp = models.PositiveIntegerField(null=True, blank=True)
    micro_batch = models.PositiveIntegerField(null=True, blank=True)
    fsdp = models.BooleanField(null=True, blank=True)
    shard_optimizer = models.BooleanField(null=True, blank=True)
    recompute = models.CharField(max_length=16, null=True, blank=True)
    schedule = models.CharField(max_length=16, null=True, blank=True)
    # where it ran
    nodes = models.PositiveIntegerField()
    procs_per_node = models.PositiveIntegerField()
    device_name = models.CharField(max_length=128, help_text='"cpu", or the CUDA device name the nodes reported')
    # measured
    step_time_s = models.FloatField(help_text="median over warm steps of the slowest rank's step_s")
    warm_steps = models.PositiveIntegerField(help_text="steps the median is over (the attempt's first 3 left out)")
    mem_bytes = models.BigIntegerField(null=True, blank=True, help_text="peak over ranks and steps")
    tokens_per_s = models.FloatField(null=True, blank=True, help_text="the job's, all ranks together")
    tflops_per_device = models.FloatField(null=True, blank=True, help_text="what the hardware executed (recompute included)")
    # predicted by the planner (parallel: auto jobs), else null
    predicted_step_time_s = models.FloatField(null=True, blank=True)
    predicted_memory_gb = models.FloatField(null=True, blank=True, help_text="per device")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["kind", "device_name"], name="knowledge_kind_device_idx")]

    def __str__(self) -> str:
        return f"knowledge {self.pk}: attempt {self.attempt_id}"

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node


class Calibration(models.Model):
    """One calibration of a device type on a node (`manage.py calibrate`, or a staff request run
    by the node's agent): the measurements (trainyard/calibration.py's document), the cost-model
    constants fit on them (trainyard/plan/calibration.py) and their evaluation on held-out runs
    before (the default constants) and after. The newest row per device_name is what the planner
    uses for that device (jobs.planning.constants.constants_for, with the row's peak_tflops: peak_for)."""

    device_name = models.CharField(max_length=200, db_index=True, help_text='"cpu" or the CUDA device name')
    kind = models.CharField(max_length=8, help_text="cpu | cuda")
    node = models.CharField(max_length=200, help_text="the node (host) it was measured on")
    peak_tflops = models.FloatField(help_text="the peak the efficiencies are relative to (the best measured GEMM)")
    constants = models.JSONField(help_text="DeviceConstants.to_dict() of the fit")
    measurements = models.JSONField(help_text="the harness's document (trainyard.calibration)")
    evaluation = models.JSONField(help_text='{"held_out": [...], "before": {...}, "after": {...}}')
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="calibrations")

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.device_name} on {self.node} ({self.created_at:%Y-%m-%d %H:%M})"


class AdaptationOutcome(models.Model):
    """What one automatic adaptation of an `adapt: auto` job taught (jobs/planning/services/knowledge.py
    `knowledge_adaptation` writes it from the job's `adaptations` entry): the configuration it
    happened in (model shape, global batch, world, device type) and, for an OOM, the plan that ran
    out of memory and the memory it ran out under; for a sustained bottleneck, the spec change, the
    values it replaced, and whether it was kept with its measured gain. The planner keeps the next
    auto job of that configuration off a plan that ran out (jobs/planning/autoplan.py), and submit
    starts it with a change that was kept (jobs/runs/services.py). Kept when its job is deleted."""

    class Kind(models.TextChoices):
        OOM = "oom"
        BOTTLENECK = "bottleneck"

    job = models.ForeignKey(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="adaptation_outcomes")
    attempt_number = models.PositiveIntegerField(null=True, blank=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    # the configuration: model shape (model_kind is the shape's `kind`; null for user code), batch, world, device
    model_kind = models.CharField(max_length=16, null=True, blank=True)
    layers = models.PositiveIntegerField(null=True, blank=True)
    hidden = models.PositiveIntegerField(null=True, blank=True)
    heads = models.PositiveIntegerField(null=True, blank=True)
    seq_len = models.PositiveIntegerField(null=True, blank=True)
    vocab = models.PositiveIntegerField(null=True, blank=True)
    global_batch = models.PositiveIntegerField(null=True, blank=True)
    nodes = models.PositiveIntegerField(help_text="the attempt's node count (an elastic job's, where it ran)")
    procs_per_node = models.PositiveIntegerField()
    device_name = models.CharField(max_length=128, help_text='"cpu", or the CUDA device name the nodes reported')
    # oom: the plan that ran out of memory (the planner's terms), the re-plan's limit and the device's memory
    dp = models.PositiveIntegerField(null=True, blank=True)
    tp = models.PositiveIntegerField(null=True, blank=True)
    pp = models.PositiveIntegerField(null=True, blank=True)
    micro_batch = models.PositiveIntegerField(null=True, blank=True)
    fsdp = models.BooleanField(null=True, blank=True)
    shard_optimizer = models.BooleanField(null=True, blank=True)
    recompute = models.CharField(max_length=16, null=True, blank=True)
    schedule = models.CharField(max_length=16, null=True, blank=True)
    limit_gb = models.FloatField(null=True, blank=True, help_text="what the re-plan had to predict below (adapt's limit)")
    device_memory_gb = models.FloatField(null=True, blank=True,
                                         help_text="the memory of a device the plan ran out on (null: unknown)")
    # bottleneck: the change (dotted spec paths -> new values), what it replaced, and how it went
    bottleneck_class = models.CharField(max_length=16, blank=True, default="", help_text="communication | input")
    change = models.JSONField(null=True, blank=True)
    before = models.JSONField(null=True, blank=True)
    outcome = models.CharField(max_length=16, blank=True, default="", help_text="kept | reverted (bottleneck)")
    measured_gain = models.FloatField(null=True, blank=True, help_text="step_s_before / step_s_after - 1")
    predicted_gain = models.FloatField(null=True, blank=True)
    step_s_before = models.FloatField(null=True, blank=True)
    step_s_after = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["model_kind", "layers", "hidden", "kind"], name="adaptation_shape_idx")]

    def __str__(self) -> str:
        return f"{self.kind} adaptation of job {self.job_id}: {self.outcome or 'recorded'}"
