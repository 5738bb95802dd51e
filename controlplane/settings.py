"""Django settings for Trainyard. Everything deploy-specific comes from the environment."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import psutil
from django.core.exceptions import ImproperlyConfigured

from controlplane import database, security
from trainyard import keys
from trainyard.bundle import BundleLimits

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = keys.var_dir()  # TRAINYARD_VAR_DIR, else var/ in the repository


# Secrets and sessions (issue 15, section 3; controlplane/security.py): the secret key 0600 in a
# 0700 var/, the local host names plus DJANGO_ALLOWED_HOSTS (never "*" by default).
SECRET_KEY = security.secret_key(os.environ, VAR_DIR)
# Node credentials (issue 16; trainyard/nodeauth.py) are derived from this key and a per-node salt:
# the database keeps the salt and the credential's SHA-256, never the credential. Set it apart from
# SECRET_KEY to rotate the session key without re-registering every node.
TRAINYARD_NODE_KEY = os.environ.get("TRAINYARD_NODE_KEY", "") or security.derived_key(SECRET_KEY, "node-credentials")
# A signed heartbeat older than this (sender's clock) is refused: a captured one cannot be replayed
# later to bring a dead node back. Attempt reports are bound to their allocation and idempotent.
TRAINYARD_HEARTBEAT_MAX_AGE_S = float(os.environ.get("TRAINYARD_HEARTBEAT_MAX_AGE_S", "60"))
# Unregistered nodes' join requests kept at most (a flood of invented names cannot grow the table).
TRAINYARD_JOIN_REQUESTS_MAX = int(os.environ.get("TRAINYARD_JOIN_REQUESTS_MAX", "100"))
# Security events (jobs/fleet/services/identity.py): distinct unregistered sources with a row of their own;
# beyond them each kind counts in one "(other sources)" row, so made-up node names cannot grow the table.
TRAINYARD_SECURITY_EVENT_SOURCES_MAX = int(os.environ.get("TRAINYARD_SECURITY_EVENT_SOURCES_MAX", "100"))
DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"
ALLOWED_HOSTS = security.allowed_hosts(os.environ)
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "axes",
    "jobs",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # a NUL in the path, a query parameter or a form field: 404/400 before any view can look it up
    "jobs.core.middleware.RefuseUnstorableText",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # last, as django-axes requires: turns a locked-out login into its 429 page
    "axes.middleware.AxesMiddleware",
]

# Login lockout (django-axes): a username that fails TRAINYARD_LOGIN_FAILURE_LIMIT logins in a row from
# one address is locked out there for TRAINYARD_LOGIN_COOLOFF_S (429 on the login page, the admin's
# and POST /api/v1/auth/token/). Attempts are stored in the database, so every web process agrees.
# API tokens authenticate without a password and are not affected.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = int(os.environ.get("TRAINYARD_LOGIN_FAILURE_LIMIT", "5"))
AXES_COOLOFF_TIME = timedelta(seconds=float(os.environ.get("TRAINYARD_LOGIN_COOLOFF_S", "900")))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_HTTP_RESPONSE_CODE = 429
# The address a lockout counts against: the same as the API throttles' (jobs/core/client_ip.py: the peer,
# or behind a proxy of TRAINYARD_TRUSTED_PROXIES the right-most X-Forwarded-For address not in it).
AXES_CLIENT_IP_CALLABLE = "jobs.core.client_ip.client_ip"

ROOT_URLCONF = "controlplane.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlplane.context_processors.job_statuses",
            ],
        },
    },
]
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = None

# SQLite by default, PostgreSQL with DATABASE_URL=postgres://...?sslmode=... (controlplane/database.py).
DATABASES = {"default": database.database_config(os.environ, VAR_DIR)}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # channels_redis waits in BZPOPMIN for 5 s, and redis-py 8's default socket_timeout is also
        # 5 s: the read then races the server's empty reply and an idle consumer dies with
        # TimeoutError, closing its websocket. Reads must outlast the blocking pop.
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]},
    }
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first, so a request without credentials gets 401 with WWW-Authenticate, not 403.
        "jobs.access.tokens.HashedTokenAuthentication",  # keys stored as SHA-256 (jobs/access/tokens.py)
        "rest_framework.authentication.SessionAuthentication",
    ],
    # IsAuthenticated, with requests without credentials counted against TRAINYARD_THROTTLE_ANON
    "DEFAULT_PERMISSION_CLASSES": ["jobs.core.throttles.IsAuthenticatedOrThrottled"],
    # DRF's defaults, bounded (a body nested too deeply to parse is a 400) and refusing text no database
    # can hold (a NUL anywhere in a body is a 400 naming the field): jobs/core/parsers.py.
    "DEFAULT_PARSER_CLASSES": ["jobs.core.parsers.JSONParser", "jobs.core.parsers.FormParser",
                               "jobs.core.parsers.MultiPartParser"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "jobs.core.api_errors.exception_handler",
    # jobs/core/throttles.py: rates from the TRAINYARD_THROTTLE_* settings below (429 with Retry-After)
    "DEFAULT_THROTTLE_CLASSES": ["jobs.core.throttles.AnonThrottle", "jobs.core.throttles.UserThrottle"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Trainyard API",
    "VERSION": "1.0.0",
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAuthenticated"],
    # Jobs, experiments and trials each have a `status` with its own values: named, not hashed.
    "ENUM_NAME_OVERRIDES": {"JobStatusEnum": "jobs.models.runs.Job.Status",
                            "ExperimentStatusEnum": "jobs.models.experiments.Experiment.Status",
                            "TrialStatusEnum": "jobs.models.experiments.Trial.Status"},
}

# Celery: the control plane's app (jobs/core/celery_app.py); node agents run their own (workers/celery_app.py).
CELERY_BROKER_URL = REDIS_URL

# Notifications (issue 25 section 4; jobs/notify/). TRAINYARD_WEBHOOK_ALLOW: comma-separated host names,
# addresses or CIDRs a webhook may reach (empty: none); checked at create and at every delivery.
TRAINYARD_WEBHOOK_ALLOW = security.env_list(os.environ, "TRAINYARD_WEBHOOK_ALLOW")
try:
    from jobs.notify.policy.targets import TargetError, parse_allow  # stdlib only: safe before apps load

    parse_allow(TRAINYARD_WEBHOOK_ALLOW)
except TargetError as exc:
    raise ImproperlyConfigured(str(exc)) from None
# A hook's secret is HMAC(this key, the hook's salt): the database alone cannot sign (as node credentials).
TRAINYARD_WEBHOOK_KEY = os.environ.get("TRAINYARD_WEBHOOK_KEY", "") or security.derived_key(SECRET_KEY, "webhook-secrets")
# One try: connect and each read bounded by this; at most TRAINYARD_WEBHOOK_TRIES tries, waiting
# TRAINYARD_WEBHOOK_BACKOFF_S, then twice that, ... between them.
TRAINYARD_WEBHOOK_TIMEOUT_S = float(os.environ.get("TRAINYARD_WEBHOOK_TIMEOUT_S", "5"))
TRAINYARD_WEBHOOK_TRIES = int(os.environ.get("TRAINYARD_WEBHOOK_TRIES", "4"))
TRAINYARD_WEBHOOK_BACKOFF_S = float(os.environ.get("TRAINYARD_WEBHOOK_BACKOFF_S", "10"))
# Links in notifications (e.g. https://trainyard.example.com); empty: none.
TRAINYARD_PUBLIC_URL = os.environ.get("TRAINYARD_PUBLIC_URL", "").rstrip("/")
# Email: Django's mail backends, configured from the environment (EMAIL_HOST, EMAIL_PORT, ...).
EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = os.environ.get("EMAIL_HOST", "localhost")
EMAIL_PORT = int(os.environ.get("EMAIL_PORT", "25"))
EMAIL_HOST_USER = os.environ.get("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = os.environ.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = os.environ.get("EMAIL_USE_TLS", "0") == "1"
EMAIL_USE_SSL = os.environ.get("EMAIL_USE_SSL", "0") == "1"
EMAIL_TIMEOUT = float(os.environ.get("EMAIL_TIMEOUT", "10"))
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "trainyard@localhost")

# Trainyard knobs.
# Resolved by trainyard.keys from the same environment the node agents read, so both name a
# job's checkpoint directory alike (absolute; TRAINYARD_*_ROOT, else under TRAINYARD_VAR_DIR).
TRAINYARD_DATA_ROOT = keys.data_root()
TRAINYARD_CHECKPOINT_ROOT = keys.checkpoint_root()
# Code bundles (TRAINYARD_ARTIFACT_ROOT, else <var>/artifacts; shared with the nodes).
TRAINYARD_ARTIFACT_ROOT = keys.artifact_root()
# Kept logs (TRAINYARD_KEPT_LOG_ROOT, else <var>/keptlogs, 0700): the control plane's own directory,
# which the relay writes and the web reads (both must see the same one), never under a root the
# nodes write (refused at start: a job could plant a symlink in place of its own log there).
try:
    TRAINYARD_KEPT_LOG_ROOT = keys.kept_log_root()
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from None
# A code bundle's limits (TRAINYARD_BUNDLE_MAX_FILES, _MAX_BYTES packed, _MAX_UNPACKED_BYTES, _MAX_DEPTH); the
# node agents read the same variables through trainyard.bundle.BundleLimits.from_env().
_bundle_limits = BundleLimits.from_env()
TRAINYARD_BUNDLE_MAX_FILES = _bundle_limits.max_files
TRAINYARD_BUNDLE_MAX_BYTES = _bundle_limits.max_bytes
TRAINYARD_BUNDLE_MAX_UNPACKED_BYTES = _bundle_limits.max_unpacked
# ... and at most this many path components deep per member (TRAINYARD_BUNDLE_MAX_DEPTH, default 64).
TRAINYARD_BUNDLE_MAX_DEPTH = _bundle_limits.max_depth
# A bundle no job references and nobody uploaded or submitted for this long is deleted (control beat).
TRAINYARD_BUNDLE_GC_AGE_S = float(os.environ.get("TRAINYARD_BUNDLE_GC_AGE_S", str(7 * 86400)))
# Telemetry retention (jobs/telemetry/retention.py; the settings themselves are RetentionPolicy rows):
# the control beat purges every TRAINYARD_TELEMETRY_PURGE_S seconds, each run stopping after about
# TRAINYARD_TELEMETRY_PURGE_BUDGET_S (the next goes on from there).
TRAINYARD_TELEMETRY_PURGE_S = float(os.environ.get("TRAINYARD_TELEMETRY_PURGE_S", "60"))
TRAINYARD_TELEMETRY_PURGE_BUDGET_S = float(os.environ.get("TRAINYARD_TELEMETRY_PURGE_BUDGET_S", "40"))
# Every rank's output is kept under TRAINYARD_KEPT_LOG_ROOT/logs/; a job's files together hold at
# most this many bytes (the oldest lines are cut first, and the logs API says how many).
TRAINYARD_LOG_MAX_BYTES_PER_JOB = int(os.environ.get("TRAINYARD_LOG_MAX_BYTES_PER_JOB", str(200 * 1024 * 1024)))
# manage.py relay's processes (jobs/telemetry/relay_workers.py): one per core, each its share of the job streams
TRAINYARD_RELAY_WORKERS = max(1, int(os.environ.get("TRAINYARD_RELAY_WORKERS", "1")))
# parallel: auto on CPU plans each process within this much memory (GB): by default a core's share
# of this host's memory (on one machine every agent's slot is a core of it).
TRAINYARD_CPU_DEVICE_MEMORY_GB = float(os.environ.get("TRAINYARD_CPU_DEVICE_MEMORY_GB") or round(
    psutil.virtual_memory().total / 1e9 / max(1, os.cpu_count() or 1), 1))
# Enforce that memory on each rank of a cpu job's built-in trainer (workers/runtime/memcap.py: a data
# limit above what the rank holds once started), so a plan that needs more fails with torch's own
# "can't allocate memory", as a GPU's OOM would: how the adaptation tests make a real OOM on CPU.
TRAINYARD_CPU_DEVICE_MEMORY_ENFORCE = os.environ.get("TRAINYARD_CPU_DEVICE_MEMORY_ENFORCE", "") in ("1", "true", "yes")
# A node silent this long is LOST (agents heartbeat every 2 s, so 5 missed beats).
TRAINYARD_NODE_LOST_S = float(os.environ.get("TRAINYARD_NODE_LOST_S", "10"))
# The node check runs every 2 s (beat); a longer gap between two checks that ran (worker or beat
# down, the database locked) is a control-plane stall, and silence during it is not held against
# any node (jobs/fleet/services/nodes.py, nodes_check). Default: half of TRAINYARD_NODE_LOST_S, at least
# 3 check intervals (a limit near the interval would call ordinary jitter a stall, and a node
# would never be judged).
TRAINYARD_CONTROL_STALL_S = float(os.environ.get("TRAINYARD_CONTROL_STALL_S") or max(6.0, TRAINYARD_NODE_LOST_S / 2))
# The control worker and beat stamp their liveness key (trainyard:alive:<role>) every fifth of this,
# and the key expires after it: /metrics and the nodes page show a role down within this long.
TRAINYARD_ALIVE_TTL_S = float(os.environ.get("TRAINYARD_ALIVE_TTL_S", "10"))
# A STARTING attempt whose ranks never report within this window is failed as a launch timeout.
TRAINYARD_LAUNCH_TIMEOUT_S = float(os.environ.get("TRAINYARD_LAUNCH_TIMEOUT_S", "120"))
# Slurm pools (issue 27; jobs/fleet/services/slurm.py). The Redis URL the ephemeral agents on Slurm's
# nodes connect to (empty: REDIS_URL's host; each agent gets its own seat's user), the Python they run
# with when a pool names none, and how often the batched squeue runs.
TRAINYARD_SLURM_REDIS_URL = os.environ.get("TRAINYARD_SLURM_REDIS_URL", "")
TRAINYARD_SLURM_AGENT_PYTHON = os.environ.get("TRAINYARD_SLURM_AGENT_PYTHON", "") or sys.executable
TRAINYARD_SLURM_POLL_S = float(os.environ.get("TRAINYARD_SLURM_POLL_S", "3"))
TRAINYARD_SLURM_RECONCILE_S = float(os.environ.get("TRAINYARD_SLURM_RECONCILE_S", "60"))
# A STARTING attempt with no rank reported this long after its launch gets its launch sent once more
# (a control worker killed between the tick's commit and its sends; agents ignore duplicates).
TRAINYARD_LAUNCH_RESEND_S = float(os.environ.get("TRAINYARD_LAUNCH_RESEND_S", "20"))
# hang_timeout_s: auto never goes below this (a checkpoint load or an eval pauses progress too).
TRAINYARD_HANG_FLOOR_S = float(os.environ.get("TRAINYARD_HANG_FLOOR_S", "60"))
# A node implicated in two failures within this window is quarantined until an admin clears it.
TRAINYARD_QUARANTINE_WINDOW_S = float(os.environ.get("TRAINYARD_QUARANTINE_WINDOW_S", "3600"))
TRAINYARD_QUARANTINE_FAILURES = int(os.environ.get("TRAINYARD_QUARANTINE_FAILURES", "2"))
# A preempted attempt has this long to checkpoint and exit before its processes are stopped.
TRAINYARD_PREEMPT_GRACE_S = float(os.environ.get("TRAINYARD_PREEMPT_GRACE_S", "60"))
# Quota device-hours are counted over this rolling window; fair share decays usage with this half-life.
TRAINYARD_QUOTA_WINDOW_S = float(os.environ.get("TRAINYARD_QUOTA_WINDOW_S", str(7 * 86400)))
# Reclaim (preempt borrowers) only when the entitled job would otherwise wait longer than this.
TRAINYARD_RECLAIM_WAIT_S = float(os.environ.get("TRAINYARD_RECLAIM_WAIT_S", "600"))
# An elastic job predicted to end within this long does not grow onto free nodes (the restart costs more).
TRAINYARD_ELASTIC_GROW_MIN_S = float(os.environ.get("TRAINYARD_ELASTIC_GROW_MIN_S", "300"))
TRAINYARD_FAIRSHARE_HALF_LIFE_S = float(os.environ.get("TRAINYARD_FAIRSHARE_HALF_LIFE_S", str(86400)))
# POST /api/v1/auth/token/ (jobs/access/api.py): token requests per client address (DRF rate syntax).
TRAINYARD_LOGIN_RATE = os.environ.get("TRAINYARD_LOGIN_RATE", "20/min")
# A JSON request body larger than this is a 413, read no further (jobs/core/parsers.py; a JobSpec is ~1 KB,
# its `config` at most 64 KiB).
TRAINYARD_JSON_MAX_BYTES = int(os.environ.get("TRAINYARD_JSON_MAX_BYTES", str(1024 * 1024)))
# A request body larger than this is a 413 from its headers, before any of it is received, on every
# path but /api/v1/code/ (which takes TRAINYARD_BUNDLE_MAX_BYTES plus the multipart envelope); under
# daphne, controlplane/daphne_bodies.py. A chunked body is cut off when it passes it. Default: 1 MiB, or
# TRAINYARD_JSON_MAX_BYTES if that is larger.
TRAINYARD_HTTP_MAX_BODY_BYTES = int(os.environ.get("TRAINYARD_HTTP_MAX_BODY_BYTES")
                                    or max(1024 * 1024, TRAINYARD_JSON_MAX_BYTES))
# A connection that has not sent its first request's headers this long after opening is dropped
# (slow-loris clients; controlplane/daphne_bodies.py). 0: no deadline.
TRAINYARD_HTTP_HEADER_TIMEOUT_S = float(os.environ.get("TRAINYARD_HTTP_HEADER_TIMEOUT_S", "10"))
# Request rates (jobs/core/throttles.py, DRF syntax; empty: no limit): API requests without credentials per
# address, API requests per user, and job submissions (API and form) per user. Counted per web
# process in Django's cache.
TRAINYARD_THROTTLE_ANON = os.environ.get("TRAINYARD_THROTTLE_ANON", "120/min")
TRAINYARD_THROTTLE_USER = os.environ.get("TRAINYARD_THROTTLE_USER", "3000/min")
TRAINYARD_THROTTLE_SUBMIT = os.environ.get("TRAINYARD_THROTTLE_SUBMIT", "30/min")
# A user with this many QUEUED jobs gets a 429 on the next submit (0: no cap).
TRAINYARD_MAX_QUEUED_JOBS_PER_USER = int(os.environ.get("TRAINYARD_MAX_QUEUED_JOBS_PER_USER", "100"))
# Open websockets per user in one web process (jobs/runs/consumers.py): past it the socket is closed with
# 4429 and the reason (0: no cap).
TRAINYARD_MAX_SOCKETS_PER_USER = int(os.environ.get("TRAINYARD_MAX_SOCKETS_PER_USER", "64"))

# ---------------------------------------------------------------- secrets and sessions (issue 15, s3)
# The reverse proxies in front of the web (TRAINYARD_TRUSTED_PROXIES: comma-separated addresses or
# CIDRs; default none). A request's client address (throttles, login lockout; jobs/core/client_ip.py) is its
# peer's, unless the peer is one of these: then the right-most X-Forwarded-For address not among them.
# A client-sent X-Forwarded-For is never believed otherwise (rotating it escaped every throttle).
TRAINYARD_TRUSTED_PROXIES = security.trusted_proxies(os.environ)
# Websockets from browsers: the exact origins (scheme://host[:port]) allowed, TRAINYARD_WS_ORIGINS;
# empty means the origin being served (jobs/access/ws_auth.py).
TRAINYARD_WS_ORIGINS = security.ws_origins(os.environ)
# Cookies: HttpOnly and SameSite=Lax always; TRAINYARD_TLS=1 adds Secure, HSTS (TRAINYARD_HSTS_SECONDS,
# default a year) and SECURE_PROXY_SSL_HEADER (the TLS proxy sets X-Forwarded-Proto).
globals().update(security.cookie_settings(os.environ))
# SQLite database files are 0600 (jobs/signals.py tightens them on the first connection).
# ---------------------------------------------------------------- end of secrets and sessions

# TRAINYARD_LOG_FORMAT: `plain` (the default: the message alone) or `levels` (`WARNING jobs.tasks: ...`,
# the level and the logger first). `make run` sets `levels`: its supervisor (scripts/supervise.py) then
# shows a process's warnings, errors and `trainyard.lifecycle` lines (jobs submitted, started,
# finished; nodes lost and back) on the terminal and keeps the rest in var/log/.
_LOG_FORMATS = {"plain": "%(message)s", "levels": "%(levelname)s %(name)s: %(message)s"}
_log_format = os.environ.get("TRAINYARD_LOG_FORMAT", "").strip() or "plain"
if _log_format not in _LOG_FORMATS:
    raise ImproperlyConfigured(f"TRAINYARD_LOG_FORMAT must be one of {', '.join(_LOG_FORMATS)}, not {_log_format!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"console": {"format": _LOG_FORMATS[_log_format]}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "console"}},
    "root": {"handlers": ["console"], "level": os.environ.get("TRAINYARD_LOG_LEVEL", "INFO")},
    # axes logs its banner and each failed login at INFO (one line per process on stderr, where
    # `manage.py plan` keeps its one error line); lockouts are warnings.
    "loggers": {"django.db.backends": {"level": "WARNING"}, "axes": {"level": "WARNING"}},
}
