"""Trainyard's state. Rows change only through jobs.services (see docs/architecture.md, section 5)."""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models

from trainyard import attemptauth


class Node(models.Model):
    class Status(models.TextChoices):
        READY = "READY"
        DRAINING = "DRAINING"
        CORDONED = "CORDONED"
        QUARANTINED = "QUARANTINED"
        LOST = "LOST"

    name = models.CharField(max_length=64, unique=True)
    address = models.CharField(max_length=255)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.READY)
    slots = models.PositiveIntegerField()
    labels = models.JSONField(default=dict, blank=True)
    devices = models.JSONField(default=list, blank=True)
    # What the last heartbeat's `devices` advertise (jobs/policy/scheduling/eligibility.py): "cuda"
    # with gpu_count GPUs, the smallest of gpu_memory_bytes; "cpu"; "" before any device report.
    # Placement reads these, not the JSON (a cuda job runs only where gpu_count > 0).
    device_kind = models.CharField(max_length=8, blank=True, default="")
    gpu_count = models.PositiveIntegerField(default=0)
    gpu_memory_bytes = models.BigIntegerField(default=0, help_text="the smallest advertised GPU's total memory")
    cpu_percent = models.FloatField(null=True, blank=True)
    mem_percent = models.FloatField(null=True, blank=True)
    agent_id = models.CharField(max_length=64, blank=True, help_text="changes when the agent restarts")
    registered_at = models.DateTimeField(auto_now_add=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Set when the node was implicated in repeated failures; only an admin clears it. Kept apart from
    # `status` so a quarantined node that goes LOST and comes back is still quarantined.
    quarantined_at = models.DateTimeField(null=True, blank=True)
    quarantine_reason = models.CharField(max_length=500, blank=True)
    # DRAINING: "finish" lets running attempts end on their own, "preempt" checkpoints them away.
    drain_mode = models.CharField(max_length=16, blank=True)
    # Identity (issue 16): staff register a node (manage.py node_add, or approve its join request);
    # its credential is derived from the master key and this salt (trainyard.nodeauth) and only its
    # SHA-256 is kept. `slots_approved` caps what a heartbeat may offer (`slots` = the lower of the
    # two); `address` is the registered one, never a heartbeat's.
    credential_salt = models.CharField(max_length=64, blank=True)
    credential_digest = models.CharField(max_length=64, blank=True)
    slots_approved = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["status", "last_heartbeat"])]

    def __str__(self) -> str:
        return self.name


class NodeJoinRequest(models.Model):
    """A heartbeat from a node no staff member registered: refused, and shown here until staff
    approve it (admin action: registers the node and shows its credential once) or delete it."""

    name = models.CharField(max_length=64, unique=True)
    address = models.CharField(max_length=255, blank=True)
    slots = models.PositiveIntegerField(default=0)
    labels = models.JSONField(default=dict, blank=True)
    heartbeats = models.PositiveIntegerField(default=0)
    first_seen = models.DateTimeField(auto_now_add=True)
    last_seen = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-last_seen"]

    def __str__(self) -> str:
        return f"join request from {self.name}"


class SecurityEvent(models.Model):
    """A refused report: a bad signature, a node reporting for another node's allocation, a
    heartbeat under another node's name. One row per (kind, node), counted, so a flood of
    forgeries grows a counter, not the table."""

    kind = models.CharField(max_length=32)
    node = models.CharField(max_length=64)
    detail = models.CharField(max_length=500, blank=True)
    count = models.PositiveIntegerField(default=0)
    first_at = models.DateTimeField(auto_now_add=True)
    last_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-last_at"]
        constraints = [models.UniqueConstraint(fields=["kind", "node"], name="security_event_kind_node")]

    def __str__(self) -> str:
        return f"{self.kind} from {self.node} (x{self.count})"


class ControlPlaneClock(models.Model):
    """One row: when the node check last ran, and since when the control plane has been healthy
    (checking on schedule, the database writable). Nodes are judged LOST only over healthy time:
    after a stall (control worker or beat down, database locked) a node that went silent only
    because its heartbeats could not be applied gets a whole TRAINYARD_NODE_LOST_S again."""

    last_check_at = models.DateTimeField(null=True, blank=True)
    healthy_since = models.DateTimeField(null=True, blank=True)
    stalls = models.PositiveIntegerField(default=0, help_text="stalls seen (a gap between checks over the limit)")
    last_stall_s = models.FloatField(null=True, blank=True, help_text="the latest stall's length")
    last_stall_at = models.DateTimeField(null=True, blank=True, help_text="when the latest stall ended")

    def __str__(self) -> str:
        return f"control plane healthy since {self.healthy_since}"


class Job(models.Model):
    class Status(models.TextChoices):
        QUEUED = "QUEUED"
        STARTING = "STARTING"
        RUNNING = "RUNNING"
        STOPPING = "STOPPING"
        SUCCEEDED = "SUCCEEDED"
        FAILED = "FAILED"
        CANCELLED = "CANCELLED"

    ACTIVE = (Status.STARTING, Status.RUNNING, Status.STOPPING)
    TERMINAL = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)
    PRIORITIES = {"low": 0, "normal": 1, "high": 2}

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    spec = models.JSONField()
    plan = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    status_reason = models.CharField(max_length=500, blank=True)
    priority = models.SmallIntegerField(default=1)
    slots = models.PositiveIntegerField(help_text="processes the job needs at once (nodes x procs_per_node)")
    step = models.PositiveBigIntegerField(default=0)
    restarts = models.PositiveIntegerField(default=0)
    cancel_requested = models.BooleanField(default=False)
    # Nodes the next attempt should not use (the node that failed to join a rendezvous, ...);
    # ignored when the job could not fit without them.
    avoid_nodes = models.JSONField(default=list, blank=True)
    predicted_s = models.FloatField(null=True, blank=True, help_text="predicted run time (jobs/policy/predictor.py)")
    predicted_start_at = models.DateTimeField(null=True, blank=True, help_text="ETA while queued")
    borrowing = models.BooleanField(default=False, help_text="runs beyond its team's quota on idle capacity")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["status", "-priority", "id"], name="job_queue_idx"),
            models.Index(fields=["owner", "-id"], name="job_owner_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.pk}:{self.name}"

    @property
    def total_steps(self) -> int:
        return int(self.spec.get("train", {}).get("steps", 0))


class Checkpoint(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    attempt = models.ForeignKey("Attempt", null=True, on_delete=models.SET_NULL, related_name="checkpoints")
    step = models.PositiveBigIntegerField()
    path = models.CharField(max_length=1000)
    size_bytes = models.BigIntegerField(default=0)
    blocking_s = models.FloatField(default=0)
    save_s = models.FloatField(default=0)
    superseded = models.BooleanField(default=False)
    pinned = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True, help_text="files removed by retention")

    class Meta:
        ordering = ["-step", "-id"]
        indexes = [models.Index(fields=["job", "-step"])]
        constraints = [models.UniqueConstraint(fields=["job", "path"], name="checkpoint_path_unique")]


class Attempt(models.Model):
    class Status(models.TextChoices):
        STARTING = "STARTING"
        RUNNING = "RUNNING"
        STOPPING = "STOPPING"
        ENDED = "ENDED"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STARTING)
    # succeeded | failed:<class> | preempted | rolled_back | cancelled | lost
    outcome = models.CharField(max_length=64, null=True, blank=True)
    stop_reason = models.CharField(max_length=64, blank=True, help_text="why the control plane stopped it")
    failure = models.JSONField(default=dict, blank=True, help_text="evidence behind a failed outcome")
    resumed_from = models.ForeignKey(Checkpoint, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    resumed_from_step = models.PositiveBigIntegerField(null=True, blank=True)
    # Progress as the relay committed it: the hang detector's evidence.
    last_step = models.PositiveBigIntegerField(default=0)
    # Set when the control plane wrote the attempt off with a node it lost (jobs/services/nodes.py):
    # the last step it had accepted. Nothing of the attempt beyond it is taken in: its ranks may
    # still run behind a partition, and their later samples and checkpoints belong to no line.
    fenced_step = models.PositiveBigIntegerField(null=True, blank=True)
    last_progress_at = models.DateTimeField(null=True, blank=True)
    stragglers = models.JSONField(default=list, blank=True, help_text="[{rank, node, ratio, ...}] flagged now")
    rank_plans = models.JSONField(default=dict, blank=True,
                                  help_text='{"<rank>": {coords, role, param_bytes, optim_bytes}} as the runtime reported them')
    profile = models.JSONField(default=dict, blank=True,
                               help_text="what bounds its step and the recommended change (jobs/policy/profiling.py)")
    preempt_requested_at = models.DateTimeField(null=True, blank=True)
    preempt_reason = models.CharField(max_length=500, blank=True)
    preempt_for = models.PositiveIntegerField(null=True, blank=True, help_text="the queued job its slots go to")
    # With the master key, derives the attempt's bus password, manifest-proof key and rendezvous
    # token (trainyard/attemptauth.py); not a secret on its own.
    bus_salt = models.CharField(max_length=64, default=attemptauth.new_salt, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="attempt_number_unique")]
        indexes = [models.Index(fields=["status"])]


class Allocation(models.Model):
    """One node's share of an attempt. `active` holds the node's slots until its processes exit."""

    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="allocations")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="allocations")
    node_rank = models.PositiveIntegerField()
    slot_ids = models.JSONField(help_text="slot indices on the node, e.g. [0, 1]")
    ranks = models.JSONField(default=list, blank=True, help_text="[{rank, local_rank, pid}] reported by the agent")
    active = models.BooleanField(default=True)
    result = models.JSONField(null=True, blank=True, help_text="the agent's exit report")
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["attempt", "node_rank"]
        constraints = [
            models.UniqueConstraint(fields=["attempt", "node"], name="allocation_node_unique"),
            models.UniqueConstraint(fields=["attempt", "node_rank"], name="allocation_rank_unique"),
        ]
        indexes = [models.Index(fields=["node", "active"])]

    @property
    def nproc(self) -> int:
        return len(self.slot_ids)


class Quota(models.Model):
    team = models.OneToOneField(Group, null=True, blank=True, on_delete=models.CASCADE, related_name="quota")
    user = models.OneToOneField(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="quota")
    max_slots = models.PositiveIntegerField()
    device_hours = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(models.Q(team__isnull=False, user__isnull=True) | models.Q(team__isnull=True, user__isnull=False)),
                name="quota_team_xor_user",
            )
        ]


class QuotaChange(models.Model):
    """The quota audit log: who changed what, when (API, quota page and Django admin alike)."""

    team = models.ForeignKey(Group, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="+")
    subject = models.CharField(max_length=200, help_text="team:<name> or user:<name>, kept if the row goes")
    old = models.JSONField(null=True, blank=True)
    new = models.JSONField(null=True, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    attempt = models.ForeignKey(Attempt, null=True, blank=True, on_delete=models.SET_NULL, related_name="events")
    kind = models.CharField(max_length=64)
    message = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "id"])]


class MetricSample(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="metrics")
    rank = models.PositiveIntegerField()
    step = models.PositiveBigIntegerField()
    ts = models.FloatField()
    loss = models.FloatField(null=True)
    samples_per_s = models.FloatField(null=True)
    tokens_per_s = models.FloatField(null=True)
    step_s = models.FloatField(null=True)
    data_s = models.FloatField(null=True)
    compute_s = models.FloatField(null=True)
    comm_s = models.FloatField(null=True)
    optim_s = models.FloatField(null=True)
    bytes_sent = models.BigIntegerField(null=True)
    mem_bytes = models.BigIntegerField(null=True)
    compression_ratio = models.FloatField(null=True, help_text="dense bytes / bytes sent this step")
    share = models.FloatField(null=True, help_text="this rank's fraction of the global batch (balancing)")
    extra = models.JSONField(null=True, blank=True, help_text="the user's own metrics this step: {name: float}")

    FIELDS = ("rank", "step", "ts", "loss", "samples_per_s", "tokens_per_s", "step_s", "data_s",
              "compute_s", "comm_s", "optim_s", "bytes_sent", "mem_bytes", "compression_ratio", "share")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank", "step"], name="metric_attempt_rank_step_unique")
        ]
        indexes = [models.Index(fields=["job", "step"], name="metric_job_step_idx"),
                   models.Index(fields=["job", "rank", "step"], name="metric_job_rank_step_idx")]


class CodeBundle(models.Model):
    """A code bundle stored at keys.bundle_path(artifact root, digest); rows change through
    jobs.services.bundles (which also writes and deletes the file)."""

    digest = models.CharField(max_length=71, unique=True, help_text='"sha256:<hex>" of the .tar.gz')
    bytes = models.BigIntegerField(help_text="packed size")
    files = models.PositiveIntegerField(help_text="regular files in it")
    file_list = models.JSONField(default=list, help_text="the files' paths (what entrypoint.script may name)")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="code_bundles", help_text="who uploaded it first")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, help_text="last uploaded again or submitted")

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.digest


class SchedulerLock(models.Model):
    """A single row locked (SELECT ... FOR UPDATE) to serialize scheduling ticks on PostgreSQL;
    on SQLite the IMMEDIATE transaction that touches it already serializes writers."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    ticks = models.BigIntegerField(default=0)


class KnowledgeRecord(models.Model):
    """What one finished attempt measured (jobs/services/knowledge.py writes it when the attempt
    ends, from its warm steps; jobs/policy/knowledge.py computes it): model shape, plan, where it
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
    uses for that device (jobs.planning.constants_for, with the row's peak_tflops: peak_for)."""

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


class ApiToken(models.Model):
    """An API token (`Authorization: Token <key>`), stored as the SHA-256 of its key: the key is shown
    once when created (`manage.py api_token USER`, POST /api/v1/auth/token/) and a copy of the
    database authenticates nobody. A fast hash is right here: keys are 256 random bits, nothing to
    guess (jobs/tokens.py). Deleting a row revokes the key and closes its websockets."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    digest = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the key, hex")
    prefix = models.CharField(max_length=8, help_text="the key's first characters, to tell tokens apart")
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"
