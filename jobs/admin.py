from django import forms
from django.contrib import admin, messages

from jobs.models import (Allocation, ApiToken, Attempt, Checkpoint, CodeBundle, Experiment, ExperimentEvent, Job, JobEvent,
                         MetricSample, MetricStep, Node, NodeJoinRequest, Pool, Quota, QuotaChange, SecurityEvent,
                         SlurmJob, Trial)
from jobs.models.telemetry import RetentionPolicy


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Nodes are added by `manage.py node_add` or by approving a join request (which issues the
    credential); here staff see them, edit labels and slots, and reissue a credential."""

    list_display = ("name", "status", "address", "slots", "slots_approved", "cpu_percent", "mem_percent",
                    "last_heartbeat")
    list_filter = ("status",)
    search_fields = ("name", "address")
    exclude = ("credential_salt", "credential_digest")
    actions = ["reissue_credential"]

    def has_add_permission(self, request):
        return False  # a node needs a credential: node_add, or approve its join request

    @admin.action(description="Reissue the credential (shown once; the old one stops working)")
    def reissue_credential(self, request, queryset):
        from jobs import services

        for node in queryset:
            _, credential = services.node_add(node.name, slots=node.slots_approved or node.slots,
                                              address=node.address, reissue=True)
            messages.warning(request, f"Credential of node {node.name} (shown once, put it in the node's 0600 "
                                      f"--credential-file): {credential}")


class PoolForm(forms.ModelForm):
    """The pool's fields and Slurm settings checked by the same service as `manage.py pool_set`
    (jobs.fleet.services.pools.pool_check): each bad field is shown on its own."""

    class Meta:
        model = Pool
        fields = ["name", "kind", "enabled", "max_nodes", "slots_per_node", "device", "gpu_memory_gb", "settings",
                  "agent_python", "agent_code_dir", "agent_run_dir", "agent_env"]

    def clean(self):
        from jobs.core.errors import InvalidInput
        from jobs.fleet.services.pools import POOL_FIELDS, pool_check

        data = super().clean()
        try:
            checked = pool_check({k: data[k] for k in POOL_FIELDS if k in data})
        except InvalidInput as exc:
            for path, msgs in exc.errors.items():
                field = path.split(".")[0]
                self.add_error(field if field in self.fields else None, f"{path}: {' '.join(msgs)}")
            return data
        data["settings"] = checked["settings"]
        return data


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    """Slurm pools (issue 27): staff say how to reach Slurm (the CLI here, or SSH to a login node
    with a key they provide), the partition, account, QOS, priority bands and time limit, and how
    many nodes Trainyard may hold. Saving brings the pool's seats (nodes <name>-<i>) in line."""

    form = PoolForm
    list_display = ("name", "kind", "enabled", "max_nodes", "slots_per_node", "device", "updated_at")

    def save_model(self, request, obj, form, change):
        from jobs.fleet.services.pools import POOL_FIELDS, pool_save

        pool_save(obj.name, **{k: form.cleaned_data[k] for k in POOL_FIELDS if k in form.cleaned_data})
        obj.refresh_from_db()


@admin.register(SlurmJob)
class SlurmJobAdmin(admin.ModelAdmin):
    list_display = ("slurm_id", "attempt", "pool", "state", "category", "reason", "submitted_at", "launched_at",
                    "ended_at", "released_at")
    list_filter = ("state", "pool")
    readonly_fields = [f.name for f in SlurmJob._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(NodeJoinRequest)
class NodeJoinRequestAdmin(admin.ModelAdmin):
    """Heartbeats from nodes nobody registered: refused until staff approve one here."""

    list_display = ("name", "address", "slots", "labels", "heartbeats", "first_seen", "last_seen")
    readonly_fields = list_display
    actions = ["approve"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.action(description="Approve: register the node with the slots and address it asked for")
    def approve(self, request, queryset):
        from jobs import services

        for req in queryset:
            _, credential = services.node_add(req.name, slots=max(1, req.slots), address=req.address,
                                              labels=req.labels)
            messages.warning(request, f"Node {req.name} registered. Its credential (shown once, put it in the node's "
                                      f"0600 --credential-file and restart its agent): {credential}")


@admin.register(SecurityEvent)
class SecurityEventAdmin(admin.ModelAdmin):
    """Refused reports (bad signature, another node's allocation, a heartbeat over its approval)."""

    list_display = ("kind", "node", "count", "detail", "first_at", "last_at")
    list_filter = ("kind",)
    search_fields = ("node",)
    readonly_fields = list_display

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class AttemptInline(admin.TabularInline):
    model = Attempt
    extra = 0
    fields = ("number", "status", "outcome", "stop_reason", "started_at", "ended_at")
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "team", "status", "priority", "slots", "step", "restarts", "created_at")
    list_filter = ("status", "priority", "team")
    search_fields = ("name", "owner__username")
    readonly_fields = ("created_at", "started_at", "finished_at")
    inlines = [AttemptInline]


class AllocationInline(admin.TabularInline):
    model = Allocation
    extra = 0
    readonly_fields = ("node", "node_rank", "slot_ids", "ranks", "active", "result", "ended_at")


@admin.register(Attempt)
class AttemptAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "number", "status", "outcome", "stop_reason", "started_at", "ended_at")
    list_filter = ("status", "outcome")
    search_fields = ("job__name", "job__id")
    inlines = [AllocationInline]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ("id", "attempt", "node", "node_rank", "slot_ids", "active", "ended_at")
    list_filter = ("active", "node")
    search_fields = ("node__name", "attempt__job__name")


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "step", "size_bytes", "save_s", "blocking_s", "superseded", "pinned", "created_at")
    list_filter = ("superseded", "pinned")
    search_fields = ("job__name", "path")


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ("id", "team", "user", "max_slots", "device_hours", "updated_at")
    search_fields = ("team__name", "user__username")

    def save_model(self, request, obj, form, change):
        from django.db import transaction

        from jobs import services

        with transaction.atomic():
            before = Quota.objects.filter(pk=obj.pk).values("max_slots", "device_hours").first() if change else None
            super().save_model(request, obj, form, change)
            services.quota_audit(obj, actor=request.user, old=before)


@admin.register(QuotaChange)
class QuotaChangeAdmin(admin.ModelAdmin):
    list_display = ("id", "subject", "old", "new", "actor", "created_at")
    search_fields = ("subject",)

    def has_change_permission(self, request, obj=None):
        return False  # an audit log


@admin.register(JobEvent)
class JobEventAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "attempt", "kind", "message", "actor", "created_at")
    list_filter = ("kind",)
    search_fields = ("job__name", "message")


@admin.register(MetricSample)
class MetricSampleAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "attempt", "rank", "step", "loss", "samples_per_s", "step_s")
    list_filter = ("rank",)
    search_fields = ("job__name",)
    show_full_result_count = False  # a COUNT(*) over every per-rank row on each page


@admin.register(MetricStep)
class MetricStepAdmin(admin.ModelAdmin):
    """One row per (attempt, step), every rank reduced (issue 26): written only by the relay's rollup,
    so read-only here (an edit would no longer be the reduction of the stored samples)."""

    list_display = ("id", "job", "attempt", "step", "ranks", "loss_mean", "step_s_mean", "step_s_max",
                    "step_s_max_rank")
    search_fields = ("job__name",)
    list_select_related = ("job", "attempt")
    show_full_result_count = False  # a COUNT(*) over every job's steps on each page

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(CodeBundle)
class CodeBundleAdmin(admin.ModelAdmin):
    """Every staff member sees the stored code bundles and may delete one (its file goes too);
    bundles are created only by uploads (POST /api/v1/code/) and never edited."""

    list_display = ("digest", "owner", "bytes", "files", "created_at", "last_used_at")
    search_fields = ("digest", "owner__username")
    readonly_fields = ("digest", "owner", "bytes", "files", "file_list", "created_at", "last_used_at")

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    def has_module_permission(self, request):
        return request.user.is_active and request.user.is_staff

    def has_delete_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def delete_model(self, request, obj):
        from jobs import services

        services.bundle_delete(obj)

    def delete_queryset(self, request, queryset):
        from jobs import services

        for bundle in queryset:
            services.bundle_delete(bundle)


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are created by `manage.py api_token` or a login (the key is shown there, once); here
    they can only be seen by prefix and revoked (deleting one closes its websockets)."""

    list_display = ("prefix", "user", "created")
    list_filter = ("user",)
    readonly_fields = ("prefix", "user", "created")
    exclude = ("digest",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class TrialInline(admin.TabularInline):
    model = Trial
    extra = 0
    fields = ("number", "job", "values", "status", "metric", "steps", "rung", "status_reason", "ended_at")
    readonly_fields = fields
    can_delete = False


class ExperimentEventInline(admin.TabularInline):
    model = ExperimentEvent
    extra = 0
    fields = ("created_at", "kind", "message")
    readonly_fields = fields
    can_delete = False


@admin.register(Experiment)
class ExperimentAdmin(admin.ModelAdmin):
    """Experiments are submitted through the API or the CLI (their first trials are jobs); their
    state changes only through the services: here staff see them and may stop them."""

    list_display = ("id", "name", "owner", "team", "status", "created_at", "finished_at")
    list_filter = ("status", "team")
    search_fields = ("name", "owner__username")
    readonly_fields = ("owner", "team", "spec", "search", "status", "status_reason", "created_at", "finished_at")
    inlines = [TrialInline, ExperimentEventInline]
    actions = ["stop"]

    def has_add_permission(self, request):
        return False  # POST /api/v1/experiments/ or `trainyard experiment submit`: validated, trials created

    @admin.action(description="Stop the experiment (running trials are cancelled)")
    def stop(self, request, queryset):
        from jobs import services
        from jobs.core.errors import DomainError

        for experiment in queryset:
            try:
                services.experiment_stop(experiment, user=request.user)
            except DomainError as exc:
                messages.warning(request, f"Experiment {experiment.pk}: {exc.message}")


@admin.register(Trial)
class TrialAdmin(admin.ModelAdmin):
    list_display = ("id", "experiment", "number", "job", "status", "metric", "steps", "rung", "created_at")
    list_filter = ("status",)
    search_fields = ("experiment__name",)
    readonly_fields = ("experiment", "number", "job", "values", "params", "status", "status_reason", "metric", "steps",
                       "rung", "rung_values", "created_at", "ended_at")

    def has_add_permission(self, request):
        return False  # trials are made by their experiment's searcher
# Notifications (jobs/notify/): read-only here; users manage their own at /notifications/ and the API.
from jobs.models import Delivery, DeliveryAttempt, Subscription  # noqa: E402


@admin.register(Subscription)
class SubscriptionAdmin(admin.ModelAdmin):
    list_display = ("id", "user", "team", "channel", "url", "active", "created_at")
    list_filter = ("channel", "active")
    exclude = ("secret_salt",)
    readonly_fields = ("user", "team", "channel", "url", "events", "payload_format", "created_at")


class DeliveryAttemptInline(admin.TabularInline):
    model = DeliveryAttempt
    extra = 0
    can_delete = False
    readonly_fields = ("number", "started_at", "duration_s", "status_code", "error", "address")


@admin.register(Delivery)
class DeliveryAdmin(admin.ModelAdmin):
    list_display = ("id", "subscription", "event", "status", "tries", "last_status_code", "created_at")
    list_filter = ("status", "event")
    readonly_fields = ("subscription", "event", "text", "body", "status", "tries", "next_try_at", "last_status_code",
                       "last_error", "created_at", "finished_at")
    inlines = [DeliveryAttemptInline]


class RetentionPolicyForm(forms.ModelForm):
    class Meta:
        model = RetentionPolicy
        fields = ("team", "rank_window_steps", "rank_sampled_per_rank", "rank_days", "reduced_days", "logs_days",
                  "finished_jobs_days")
        help_texts = {
            "team": "Empty: the site's settings (one row). A team's row overrides the site's field by field: "
                    "only the fields set here; empty fields follow the site.",
            "rank_window_steps": "Per-rank samples are kept at full resolution for the last N steps of each job "
                                 "(relative to its current step). Site default 2000.",
            "rank_sampled_per_rank": "Beyond the window, per-rank samples are thinned to every k-th step (k a power "
                                     "of two), keeping between N/2 and N steps per rank; 0 keeps none. Steps within "
                                     "50 of a straggler, restart, resume, resize or rollback are always kept in "
                                     "full. Site default 1000.",
            "rank_days": "Days after a job ends that its per-rank samples are deleted. Empty: kept (thinned).",
            "reduced_days": "Days after a job ends that its per-step rows (the cross-rank min/mean/max that charts "
                            "read) are deleted. Empty: forever.",
            "logs_days": "Days after a job ends that its kept log files are deleted. Empty: forever.",
            "finished_jobs_days": "Days after a job ends that the job itself is deleted, with its attempts, events, "
                                  "checkpoints (and their files) and logs. Empty: forever.",
        }


@admin.register(RetentionPolicy)
class RetentionPolicyAdmin(admin.ModelAdmin):
    """Telemetry retention (jobs/telemetry/retention.py), applied by the purge every TRAINYARD_TELEMETRY_PURGE_S;
    the API's /api/v1/retention/ shows and changes the same rows."""

    form = RetentionPolicyForm
    list_display = ("scope", "rank_window_steps", "rank_sampled_per_rank", "rank_days", "reduced_days",
                    "logs_days", "finished_jobs_days", "updated_at")
    search_fields = ("team__name",)

    @admin.display(description="applies to", ordering="team__name")
    def scope(self, obj):
        return f"team {obj.team.name}" if obj.team_id else "site (every team without its own setting)"

    def has_module_permission(self, request):
        return request.user.is_active and request.user.is_staff

    def has_view_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    def has_add_permission(self, request):
        return request.user.is_active and request.user.is_staff

    def has_change_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

    def has_delete_permission(self, request, obj=None):
        return request.user.is_active and request.user.is_staff

