"""Settings for artweb, all from the environment (12-factor).

Embedded default: SQLite + a filesystem Celery broker inside ARTWEB_DATA_DIR, so one command runs
the whole platform with no external service. Production: set DATABASE_URL (PostgreSQL) and
CELERY_BROKER_URL (Redis), DEBUG=0, SECRET_KEY (or SECRET_KEY_FILE) and ALLOWED_HOSTS.

Why one module of this length: every setting with the environment variable it reads and a line on
what it does, in the one file Django reads.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from artweb.env import env_bool, env_choice, env_float, env_int, env_list, env_str, load_or_create_secret
from artweb.logs import logging_config
from projects.queues import Queue, queue_name_problem  # plain: importable before Django is set up

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = env_bool("DEBUG", False)
DATA_DIR = Path(env_str("ARTWEB_DATA_DIR", str(BASE_DIR / "data"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)

# SECRET_KEY (or SECRET_KEY_FILE) from the environment; a self-hosted install without one gets a
# random key generated once and kept in the data dir (never a key that ships in the source).
SECRET_KEY = env_str("SECRET_KEY") or load_or_create_secret(DATA_DIR / "secret_key")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "artweb",
    "projects",
    "frontend",
]

MIDDLEWARE = [
    # First: a request id on every response, and JSON error objects on /api and /v1 for whatever
    # escapes a view (a body over DATA_UPLOAD_MAX_MEMORY_SIZE: 413; an unhandled exception: 500).
    "projects.middleware.RequestIdMiddleware",
    "projects.metrics.MetricsMiddleware",  # latency by URL pattern and status (projects.metrics)
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "frontend.content_security_policy.ContentSecurityPolicyMiddleware",
]

ROOT_URLCONF = "artweb.urls"
WSGI_APPLICATION = "artweb.wsgi.application"
ASGI_APPLICATION = "artweb.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# --- database -------------------------------------------------------------------------------
_default_db_url = f"sqlite:///{DATA_DIR / 'artweb.sqlite3'}"
DATABASE_URL = env_str("DATABASE_URL") or _default_db_url
try:
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=env_int("DB_CONN_MAX_AGE", 0, minimum=0))
except ValueError as exc:
    raise ImproperlyConfigured(f"DATABASE_URL is invalid: {exc}") from exc
if _db["ENGINE"] == "django.db.backends.sqlite3":
    # The web process and the worker share one SQLite file: WAL lets readers run beside a writer,
    # the busy timeout waits instead of failing, and IMMEDIATE write transactions take the write
    # lock up front so two writers never deadlock on a lock upgrade ("database is locked").
    _db["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
    }
DATABASES = {"default": _db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- auth -----------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "/login/"  # the dashboard's sign-in page
LOGIN_REDIRECT_URL = "/projects/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(DATA_DIR / "static")))
# Served by whitenoise from the app folders directly, so no collectstatic step is needed to start.
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

# --- security (production values pass `manage.py check --deploy`) -----------------------------
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# Error reports (the DEBUG page included) hide URL/DSN settings and mask `user:password@` in any URL.
DEFAULT_EXCEPTION_REPORTER_FILTER = "artweb.error_reports.CredentialMaskingReporterFilter"

# --- REST API -------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "projects.api.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["projects.api.permissions.TeamPermission"],
    "DEFAULT_PAGINATION_CLASS": "projects.api.pagination.OpenAIListPagination",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "projects.api.errors.exception_handler",
    "DEFAULT_PARSER_CLASSES": [
        # training.rollouts.strict_json: depth limit, no NaN / out-of-range numbers / lone surrogates / NUL.
        "projects.api.parsers.StrictJSONParser",
        "projects.api.parsers.LimitedFormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "artweb API",
    "DESCRIPTION": "Train multi-step LLM agents with GRPO and serve every checkpoint.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI assets from the drf-spectacular-sidecar package: no CDN at run time.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    # Exports and ART's training jobs (/v1/preview/) share one set of states: one enum, one name.
    "ENUM_NAME_OVERRIDES": {"JobStatusEnum": "projects.models.TrainingJobStatus"},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "projects.api.schema.document_errors",  # every error response: OpenAI's error object
    ],
}

# --- teams ----------------------------------------------------------------------------------
# How long an invitation to join a team can be accepted (projects.services.invitations).
INVITATION_TTL_HOURS = env_int("INVITATION_TTL_HOURS", 72, minimum=1)

# --- Celery ---------------------------------------------------------------------------------
BROKER_DIR = DATA_DIR / "broker"
# "localhost" only keeps kombu from warning about a missing host; the folders below are the broker.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or "filesystem://localhost//"
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {}
if CELERY_BROKER_URL.startswith("filesystem://"):
    # Embedded broker: messages are files in one folder of the data dir; no server needed.
    for _sub in ("queue", "processed", "control"):
        (BROKER_DIR / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "store_processed": False,
    }
elif CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    # Runs are long: a message must not be redelivered to a second worker while the first one is
    # still training (visibility timeout > longest run). Duplicate delivery is harmless anyway
    # because the task's first act is an idempotent claim.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 43200)}
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_TRACK_STARTED = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# --- training -------------------------------------------------------------------------------
# A running run (or queued evaluation job) whose worker has not written a heartbeat for this long
# is considered orphaned and is re-enqueued: a run resumes from its last checkpoint, an evaluation
# restarts from scratch.
RUN_HEARTBEAT_TIMEOUT_S = env_float("RUN_HEARTBEAT_TIMEOUT_S", 300.0)
# How many workers may claim one run (or evaluation): one that lost its worker this many times
# fails with "worker lost N times; last seen on <worker> at <time>" instead of being taken over.
RUN_MAX_ATTEMPTS = env_int("RUN_MAX_ATTEMPTS", 3, minimum=1)
EVALUATION_MAX_ATTEMPTS = env_int("EVALUATION_MAX_ATTEMPTS", 3, minimum=1)
RUN_TIME_LIMIT_S = env_int("RUN_TIME_LIMIT_S", 7 * 24 * 3600, minimum=60)
# The longest a queued evaluation (POST /api/v1/evaluations) may take: past it the evaluation fails
# (Celery's soft time limit). Liveness is the heartbeat above, not this limit: an evaluation whose
# worker dies is taken over after RUN_HEARTBEAT_TIMEOUT_S and restarted from scratch.
EVALUATION_TIME_LIMIT_S = env_int("EVALUATION_TIME_LIMIT_S", 6 * 3600, minimum=60)
TRAINING_DEVICE = env_str("TRAINING_DEVICE", "cpu")
# The rollout engine (auto: vLLM on a CUDA device when installed, else transformers) and the base
# model loader for training (auto: unsloth on CUDA when installed; on insists, off never).
TRAINING_ENGINE = env_choice("ARTWEB_ENGINE", "auto", ("auto", "vllm", "transformers"))
TRAINING_UNSLOTH = env_choice("ARTWEB_UNSLOTH", "auto", ("auto", "on", "off"))
# Client training jobs: how many trained sessions a worker process keeps between jobs, so the next
# job of a model starts from memory instead of loading the base model and checkpoint (0: never).
RESIDENT_SESSIONS = env_int("RESIDENT_SESSIONS", 1, minimum=0)
# The host's trainer service (``python -m training.hosting.service``; `manage.py up` starts one):
# client training jobs keep their sessions there, many models' adapters on one copy of each base.
# Empty: each worker process keeps its own (RESIDENT_SESSIONS). Its token comes from the environment.
TRAINER_SERVICE_URL = env_str("TRAINER_SERVICE_URL", "")
TRAINER_SERVICE_TOKEN = env_str("TRAINER_SERVICE_TOKEN", "")
TRAINER_SERVICE_PORT = env_int("TRAINER_SERVICE_PORT", 8200, minimum=0)
# Platform GRPO runs train on that service too (their session beside the others; the worker loads
# the tokenizer only). False: they train in the worker process, as without a service.
TRAINER_SERVICE_RUNS = env_bool("TRAINER_SERVICE_RUNS", True)
# The memory the trainer service's resident sessions may hold (adapters, gradients, AdamW moments)
# before the least recently used idle one is saved to disk and unloaded; 0: no limit.
TRAINER_SESSION_MEMORY_MB = env_int("TRAINER_SESSION_MEMORY_MB", 4096, minimum=0)
# Torch intra-op threads per process (the worker's training, serve_inference); 0 = torch's default,
# one per core. `manage.py up` sets it for its children to cores // torch processes (and
# OMP_WAIT_POLICY=PASSIVE) unless the environment sets it: see benchmarks/threads_split.py.
TORCH_THREADS = env_int("TORCH_THREADS", 0, minimum=0)
# This host's checkpoint folders: what its trainer writes, and its cache of stored checkpoints.
CHECKPOINT_DIR = Path(env_str("ARTWEB_CHECKPOINT_DIR", str(DATA_DIR / "checkpoints"))).resolve()
# --- storage of checkpoints and exports (projects.storage) ----------------------------------
# local (embedded): the folders under CHECKPOINT_DIR are the stored objects. s3: an S3-compatible
# bucket shared by every host; each host caches what it reads under its CHECKPOINT_DIR.
STORAGE_BACKEND = env_choice("STORAGE_BACKEND", "local", ("local", "s3"))
STORAGE_S3_BUCKET = env_str("STORAGE_S3_BUCKET")
STORAGE_S3_PREFIX = env_str("STORAGE_S3_PREFIX", "artweb").strip("/")
STORAGE_S3_ENDPOINT_URL = env_str("STORAGE_S3_ENDPOINT_URL")  # MinIO etc.; empty: AWS
STORAGE_S3_REGION = env_str("STORAGE_S3_REGION", "us-east-1")
STORAGE_S3_ACCESS_KEY_ID = env_str("STORAGE_S3_ACCESS_KEY_ID")  # or _FILE; empty: boto3's own chain
STORAGE_S3_SECRET_ACCESS_KEY = env_str("STORAGE_S3_SECRET_ACCESS_KEY")  # or _FILE
if STORAGE_BACKEND == "s3" and not STORAGE_S3_BUCKET:
    raise ImproperlyConfigured("STORAGE_BACKEND=s3 needs STORAGE_S3_BUCKET")
MODEL_CACHE_DIR = DATA_DIR / "models"
MAX_TASKSET_BYTES = env_int("MAX_TASKSET_BYTES", 50 * 1024 * 1024, minimum=1024)
# An imported LoRA adapter (POST /api/v1/models/<id>/adapter/): the archive, and each file in it.
MAX_ADAPTER_BYTES = env_int("MAX_ADAPTER_BYTES", 1024 * 1024 * 1024, minimum=1024)
# Client-driven training (/v1/preview/, OpenPipe ART's protocol): the largest request body those
# paths accept (trajectory groups with logprobs are large; over it: 413), and the longest one
# training job (one step) may take.
PREVIEW_MAX_BODY_BYTES = env_int("PREVIEW_MAX_BODY_BYTES", 64 * 1024 * 1024, minimum=1024)
TRAINING_JOB_TIME_LIMIT_S = env_int("TRAINING_JOB_TIME_LIMIT_S", 6 * 3600, minimum=60)
# The Tinker API (projects.tinker): how long retrieve_future holds a poll before "try_again" (the
# SDK's own poll gives up after 45 s and asks again at once).
TINKER_POLL_S = env_int("TINKER_POLL_S", 25, minimum=1)
# A training client whose session was lost with its trainer process is rebuilt by running its
# requests since its last saved state again (projects.jobs.tinker_recovery); past this many, it is lost.
TINKER_REPLAY_MAX = env_int("TINKER_REPLAY_MAX", 500, minimum=0)
# Fair sharing of the trainer (issue 51): a team's Tinker futures queued or running at once, samples
# and training requests counted apart; one more is a 429 with Retry-After (TINKER_RETRY_AFTER_S).
# A sample's max_tokens is capped by INFERENCE_MAX_TOKENS and, with its prompt, by the model's context.
TINKER_MAX_PENDING_SAMPLES_PER_TEAM = env_int("TINKER_MAX_PENDING_SAMPLES_PER_TEAM", 32, minimum=1)
TINKER_MAX_PENDING_TRAINING_PER_TEAM = env_int("TINKER_MAX_PENDING_TRAINING_PER_TEAM", 64, minimum=1)
TINKER_RETRY_AFTER_S = env_int("TINKER_RETRY_AFTER_S", 5, minimum=1)
# Who samples for a Tinker sampling client: auto, a live vLLM inference server of the base model
# when one serves it (the checkpoint loaded as a LoRA adapter for the call; requests with top-k,
# top-p truncation or prompt logprobs stay on the session), else the session; session: always it.
TINKER_SAMPLER = env_choice("TINKER_SAMPLER", "auto", ("auto", "session"))
# The largest request body read into memory: JSON bodies (API and gateway) and form fields; more is
# a 413. Multipart files are not counted (a task-set `file` is bounded by MAX_TASKSET_BYTES).
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 10 * 1024 * 1024, minimum=1024)

# LOG_FORMAT=json: one JSON object per line with request_id / run_id / evaluation_id /
# training_job_id where they apply (artweb.logs); text (default) appends them as key=value.
LOG_FORMAT = env_choice("LOG_FORMAT", "text", ("text", "json"))
LOGGING = logging_config(log_format=LOG_FORMAT, level=env_str("LOG_LEVEL", "INFO"))
# Webhooks (projects.services.webhooks): attempts per delivery, the backoff between them
# (base × 2^(attempt-1), capped) and the timeout of one POST.
WEBHOOK_MAX_ATTEMPTS = env_int("WEBHOOK_MAX_ATTEMPTS", 8, minimum=1)
WEBHOOK_RETRY_BASE_S = env_float("WEBHOOK_RETRY_BASE_S", 10.0)
WEBHOOK_RETRY_MAX_S = env_float("WEBHOOK_RETRY_MAX_S", 3600.0)
WEBHOOK_TIMEOUT_S = env_float("WEBHOOK_TIMEOUT_S", 10.0)
# Prometheus (projects.metrics): /metrics answers only with "Bearer $METRICS_TOKEN" (unset: off);
# a worker serves its own on METRICS_BIND_ADDRESS:WORKER_METRICS_PORT (0: off; needs
# PROMETHEUS_MULTIPROC_DIR, as its tasks run in forked children) with the same token, or without
# one on a loopback address only.
METRICS_TOKEN = env_str("METRICS_TOKEN")
WORKER_METRICS_PORT = env_int("WORKER_METRICS_PORT", 0, minimum=0)
METRICS_BIND_ADDRESS = env_str("METRICS_BIND_ADDRESS", "127.0.0.1")
# prometheus_client reads this itself, at import; named here so the deploy files' check knows it.
PROMETHEUS_MULTIPROC_DIR = env_str("PROMETHEUS_MULTIPROC_DIR")
GRADER_MAX_ERROR_FRACTION = env_float("GRADER_MAX_ERROR_FRACTION", 0.5)
RUN_REAPER_INTERVAL_S = env_float("RUN_REAPER_INTERVAL_S", 60.0)
# A client run (an ART model's training jobs, a Tinker training client) has no worker of its own:
# it ends (succeeded) once its client has sent no training job, step or session heartbeat and has
# nothing pending for this long (beat task training.close_idle_client_runs, every
# RUN_REAPER_INTERVAL_S). An ART client's next job then starts a new client run.
CLIENT_RUN_IDLE_S = env_float("CLIENT_RUN_IDLE_S", 1800.0)
if CLIENT_RUN_IDLE_S <= 0:
    raise ImproperlyConfigured("CLIENT_RUN_IDLE_S must be positive")
# The tasks live in projects.jobs.tasks; their names keep the "training." prefix they were queued under.
CELERY_TASK_DEFAULT_QUEUE = Queue.DEFAULT.value
CELERY_TASK_ROUTES = {
    "training.train_run": {"queue": Queue.TRAIN.value},
    "training.requeue_orphaned_runs": {"queue": Queue.DEFAULT.value},
    "training.requeue_orphaned_evaluations": {"queue": Queue.DEFAULT.value},
    "training.close_idle_client_runs": {"queue": Queue.DEFAULT.value},
    # A client's training job (/v1/preview/training-jobs) trains like a run: on the train queue.
    "training.train_job": {"queue": Queue.TRAIN.value},
    "training.requeue_orphaned_training_jobs": {"queue": Queue.DEFAULT.value},
    "training.requeue_orphaned_exports": {"queue": Queue.DEFAULT.value},
    "training.warn_unserved_queues": {"queue": Queue.DEFAULT.value},
    "training.expire_tinker_names": {"queue": Queue.DEFAULT.value},
    "webhooks.deliver": {"queue": Queue.DEFAULT.value},
}
# Work queues per GPU class (projects.queues): runs, evaluations and training jobs go to their base
# model's queue, this one when the operator set none. A queued item still waiting after
# QUEUE_NO_WORKER_TIMEOUT_S on a queue no live worker answers for (a control ping of
# QUEUE_PING_TIMEOUT_S) gets one warning event naming the queue.
WORK_QUEUE_DEFAULT = env_str("WORK_QUEUE_DEFAULT", Queue.TRAIN.value)
if problem := queue_name_problem(WORK_QUEUE_DEFAULT):
    raise ImproperlyConfigured(f"WORK_QUEUE_DEFAULT={WORK_QUEUE_DEFAULT!r}: {problem}")
QUEUE_NO_WORKER_TIMEOUT_S = env_float("QUEUE_NO_WORKER_TIMEOUT_S", 300.0)
QUEUE_PING_TIMEOUT_S = env_float("QUEUE_PING_TIMEOUT_S", 2.0)
CELERY_BEAT_SCHEDULE = {
    "requeue-orphaned-runs": {"task": "training.requeue_orphaned_runs", "schedule": RUN_REAPER_INTERVAL_S},
    "requeue-orphaned-evaluations": {
        "task": "training.requeue_orphaned_evaluations",
        "schedule": RUN_REAPER_INTERVAL_S,
    },
    "requeue-orphaned-training-jobs": {
        "task": "training.requeue_orphaned_training_jobs",
        "schedule": RUN_REAPER_INTERVAL_S,
    },
    "requeue-orphaned-exports": {
        "task": "training.requeue_orphaned_exports",
        "schedule": RUN_REAPER_INTERVAL_S,
    },
    "warn-unserved-queues": {"task": "training.warn_unserved_queues", "schedule": RUN_REAPER_INTERVAL_S},
    "expire-tinker-names": {"task": "training.expire_tinker_names", "schedule": RUN_REAPER_INTERVAL_S},
    "close-idle-client-runs": {"task": "training.close_idle_client_runs", "schedule": RUN_REAPER_INTERVAL_S},
    "expire-stored-completions": {"task": "training.expire_stored_completions", "schedule": 3600.0},
}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# --- serving: inference servers and the OpenAI-compatible gateway ----------------------------
# The token the gateway presents to inference servers. Every process of one installation shares
# SECRET_KEY, so the default is derived from it; set INFERENCE_SERVER_TOKEN(_FILE) to rotate it
# separately.
import hmac  # noqa: E402  (kept with the one setting that uses it)

INFERENCE_SERVER_TOKEN = (
    env_str("INFERENCE_SERVER_TOKEN")
    or hmac.new(SECRET_KEY.encode(), b"artweb inference server token", "sha256").hexdigest()
)
# The key of the secret part of adapter names on inference servers (projects.gateway.vllm): a name
# nobody can guess from a model id and step. Every gateway and worker derives the same one.
INFERENCE_ADAPTER_NAME_KEY = hmac.new(SECRET_KEY.encode(), b"artweb adapter names", "sha256").hexdigest()
INFERENCE_PORT = env_int("INFERENCE_PORT", 8100, minimum=0)
# Servers write a heartbeat this often; the gateway routes only to servers heard from within the timeout.
INFERENCE_HEARTBEAT_INTERVAL_S = env_float("INFERENCE_HEARTBEAT_INTERVAL_S", 2.0)
INFERENCE_HEARTBEAT_TIMEOUT_S = env_float("INFERENCE_HEARTBEAT_TIMEOUT_S", 10.0)
if INFERENCE_HEARTBEAT_TIMEOUT_S <= INFERENCE_HEARTBEAT_INTERVAL_S:
    raise ImproperlyConfigured("INFERENCE_HEARTBEAT_TIMEOUT_S must exceed INFERENCE_HEARTBEAT_INTERVAL_S")
INFERENCE_ADAPTER_CAPACITY = env_int("INFERENCE_ADAPTER_CAPACITY", 8, minimum=1)  # LoRA adapters kept loaded
INFERENCE_BATCH_WINDOW_MS = env_float("INFERENCE_BATCH_WINDOW_MS", 10.0)
INFERENCE_MAX_BATCH_SIZE = env_int("INFERENCE_MAX_BATCH_SIZE", 32, minimum=1)  # sequences per engine call
# continuous: requests join the running decode batch at the next token (training.serving.continuous);
# window: one engine call per batch of requests (the old scheduler, kept as the benchmark's reference)
INFERENCE_SCHEDULER = env_choice("INFERENCE_SCHEDULER", "continuous", ("continuous", "window"))
INFERENCE_DEFAULT_MAX_TOKENS = env_int("INFERENCE_DEFAULT_MAX_TOKENS", 256, minimum=1)
INFERENCE_MAX_TOKENS = env_int("INFERENCE_MAX_TOKENS", 4096, minimum=1)
# Servers load LoRA checkpoints only from under this directory (the path arrives over HTTP).
INFERENCE_ADAPTER_ROOT = Path(env_str("INFERENCE_ADAPTER_ROOT", str(CHECKPOINT_DIR))).resolve()
# STORAGE_BACKEND=s3: where an inference server keeps the checkpoints it fetched from the bucket (a
# folder of its own: what is there is evicted, least recently used first, beyond the budget; 0 = no
# budget). The local store's folders are the store itself and are never evicted.
INFERENCE_CACHE_DIR = Path(env_str("INFERENCE_CACHE_DIR", str(DATA_DIR / "inference-cache"))).resolve()
INFERENCE_CACHE_BUDGET_BYTES = env_int("INFERENCE_CACHE_BUDGET_BYTES", 20 * 1024**3, minimum=0)
GATEWAY_RATE_LIMIT_PER_MINUTE = env_int(
    "GATEWAY_RATE_LIMIT_PER_MINUTE", 600, minimum=0
)  # per API key; 0 = off
GATEWAY_RETRY_AFTER_S = env_int("GATEWAY_RETRY_AFTER_S", 5, minimum=1)  # Retry-After when no server is live
GATEWAY_UPSTREAM_TIMEOUT_S = env_float("GATEWAY_UPSTREAM_TIMEOUT_S", 600.0)
# Spreading among the servers of one base model (projects.gateway.balance): a server that does not
# hold the checkpoint's adapter counts as this many more requests in flight (the cost of loading
# it); a server that refused a connection is tried last for this many seconds.
GATEWAY_ADAPTER_LOAD_COST = env_int("GATEWAY_ADAPTER_LOAD_COST", 4, minimum=0)
GATEWAY_SERVER_DOWN_S = env_float("GATEWAY_SERVER_DOWN_S", 10.0)
# Seconds a web process remembers an authenticated API key and a model route (0 = off): a revoked
# key keeps working, and a new checkpoint becomes :latest, up to this long later.
GATEWAY_LOOKUP_CACHE_S = env_float("GATEWAY_LOOKUP_CACHE_S", 1.0)
# Stored completions (projects.gateway.capture): the most a row holds (request, reply, ids and
# logprobs, as compact JSON); over it the logprobs go, and a row still over it is not stored.
STORED_COMPLETION_MAX_BYTES = env_int("STORED_COMPLETION_MAX_BYTES", 1_048_576, minimum=1024)
if GATEWAY_LOOKUP_CACHE_S < 0:
    raise ImproperlyConfigured("GATEWAY_LOOKUP_CACHE_S must be 0 or more")
# serve_inference: transformers (CPU/GPU, batched), vllm, or auto (vllm on a CUDA host with vLLM);
# the program started instead of vLLM's server (wrappers, test doubles), empty = vLLM's own.
INFERENCE_ENGINE = env_str("INFERENCE_ENGINE", "transformers").strip().lower() or "transformers"
INFERENCE_VLLM_COMMAND = env_str("INFERENCE_VLLM_COMMAND", "")
# Where vLLM is when this interpreter does not import it (a GPU image with the gpu extra does): the
# python of a virtualenv of vLLM's own; `make install` puts the CPU build in .venv-vllm. Used by
# serve_inference --engine vllm and by runs whose rollouts sample with vLLM (ARTWEB_ENGINE).
VLLM_PYTHON = env_str("VLLM_PYTHON", str(BASE_DIR / ".venv-vllm" / "bin" / "python"))
# vLLM's weight dtype for serve_inference (--dtype): auto is the model's, bf16 on vLLM's CPU build
# even for a float32 model; a CPU trainer's run (float32) whose rollouts sample that server needs
# float32 there to pass the sampler check (bf16 logprobs differ by ~3e-3).
INFERENCE_VLLM_DTYPE = env_choice("INFERENCE_VLLM_DTYPE", "auto", ("auto", "bfloat16", "float16", "float32"))
# The CPU build's KV cache in GiB (its default takes a share of all memory: tens of GiB).
VLLM_CPU_KV_CACHE_GIB = env_float("VLLM_CPU_KV_CACHE_GIB", 2.0)
if VLLM_CPU_KV_CACHE_GIB <= 0:
    raise ImproperlyConfigured("VLLM_CPU_KV_CACHE_GIB must be more than 0")
# The rate limiter's counters live in the cache: per-process memory by default (exact for one web
# process); several web processes must share one, e.g. CACHE_URL=redis://127.0.0.1:6379/1.
CACHE_URL = env_str("CACHE_URL")
if CACHE_URL.startswith(("redis://", "rediss://")):
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": CACHE_URL}}
elif CACHE_URL:
    raise ImproperlyConfigured(f"CACHE_URL={CACHE_URL!r}: only redis:// URLs are supported (or unset)")
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- graders --------------------------------------------------------------------------------
# Python graders run in a sandbox subprocess (network, mount and PID namespaces via `unshare`,
# resource limits). ALLOW_UNSANDBOXED is for development machines without namespaces only.
GRADER_SANDBOX_TIMEOUT_S = env_float("GRADER_SANDBOX_TIMEOUT_S", 5.0)
GRADER_SANDBOX_CPU_S = env_int("GRADER_SANDBOX_CPU_S", 5, minimum=1)
GRADER_SANDBOX_MEMORY_MB = env_int("GRADER_SANDBOX_MEMORY_MB", 512, minimum=64)
# The regex grader's limit per match (a catastrophic pattern is a regex_timeout error, not a stall).
GRADER_REGEX_TIMEOUT_S = env_float("GRADER_REGEX_TIMEOUT_S", 1.0)
if not 0 < GRADER_REGEX_TIMEOUT_S <= 60:  # also refuses nan
    raise ImproperlyConfigured(
        f"GRADER_REGEX_TIMEOUT_S={GRADER_REGEX_TIMEOUT_S!r}: must be more than 0 and at most 60"
    )
GRADER_SANDBOX_ALLOW_UNSANDBOXED = env_bool("GRADER_SANDBOX_ALLOW_UNSANDBOXED", False)

# Sandboxes at once on this host (python graders and MCP stdio servers together), per team and in
# total: a slot is a lock file in SANDBOX_SLOT_DIR, which every process of the host must share.
# Workers wait up to SANDBOX_WAIT_S for a slot; the web (grader runs, tool listings) waits
# SANDBOX_WEB_WAIT_S and then answers 429.
SANDBOX_SLOT_DIR = Path(env_str("SANDBOX_SLOT_DIR", str(DATA_DIR / "sandbox-slots"))).resolve()
SANDBOX_MAX_TOTAL = env_int("SANDBOX_MAX_TOTAL", 16, minimum=1)
SANDBOX_MAX_PER_TEAM = env_int("SANDBOX_MAX_PER_TEAM", 4, minimum=1)
SANDBOX_WAIT_S = env_float("SANDBOX_WAIT_S", 600.0)
SANDBOX_WEB_WAIT_S = env_float("SANDBOX_WEB_WAIT_S", 2.0)

# --- environments ---------------------------------------------------------------------------
# An MCP environment's stdio command runs a program on the worker: besides the shipped demo server
# (exactly `python -m training.environments.mcp_demo.server`) only these commands may run, each
# matched whole, arguments included (comma-separated; a command's words split as a shell would).
# Listing an interpreter with a script names that script only.
MCP_STDIO_PROGRAMS: tuple[str, ...] = tuple(env_list("MCP_STDIO_PROGRAMS", []))
# Environment variable names (or patterns such as GITHUB_*) a stdio config.env may set; none by
# default. Names that steer an interpreter, the loader or a shell (PYTHON*, LD_*, PATH, BROWSER, ...)
# are refused even when listed.
MCP_STDIO_ENV: tuple[str, ...] = tuple(env_list("MCP_STDIO_ENV", []))
# The operator's own stdio commands keep the host's network (the demo server never does).
MCP_STDIO_NETWORK = env_bool("MCP_STDIO_NETWORK", False)
MCP_STDIO_MEMORY_MB = env_int("MCP_STDIO_MEMORY_MB", 1024, minimum=128)

# --- outbound calls -------------------------------------------------------------------------
# Judge endpoints, remote policies, scenario generation and MCP server URLs reach public addresses
# only (training.safety.outbound, built by projects.outbound). These hosts, addresses or CIDRs, each
# optionally with :port, are allowed even when internal (comma-separated); a bad entry fails here.
OUTBOUND_ALLOW: tuple[str, ...] = tuple(env_list("OUTBOUND_ALLOW", []))


def _outbound_allow_checked() -> None:
    from training.safety.outbound import OutboundPolicy  # standard library only

    try:
        OutboundPolicy(allow=OUTBOUND_ALLOW)
    except ValueError as exc:
        raise ImproperlyConfigured(f"OUTBOUND_ALLOW: {exc}") from exc


_outbound_allow_checked()

# --- costs ----------------------------------------------------------------------------------
# Optional prices (projects.selectors.costs): 0 or unset means "not priced", shown as such, never
# as a cost of 0. Device-hours are the worker's wall clock × the devices it held (training.cost).
PRICE_PER_GPU_HOUR = env_float("PRICE_PER_GPU_HOUR", 0.0)
PRICE_PER_CPU_HOUR = env_float("PRICE_PER_CPU_HOUR", 0.0)
PRICE_PER_1K_TOKENS = env_float("PRICE_PER_1K_TOKENS", 0.0)  # tokens sampled + tokens trained
PRICE_PER_1K_JUDGE_TOKENS = env_float("PRICE_PER_1K_JUDGE_TOKENS", 0.0)  # judge prompt + completion
COST_CURRENCY = env_str("COST_CURRENCY", "USD")
for _price in (
    "PRICE_PER_GPU_HOUR",
    "PRICE_PER_CPU_HOUR",
    "PRICE_PER_1K_TOKENS",
    "PRICE_PER_1K_JUDGE_TOKENS",
):
    if not 0 <= globals()[_price] < float("inf"):  # also refuses nan
        raise ImproperlyConfigured(f"{_price}={globals()[_price]} must be a number >= 0")
