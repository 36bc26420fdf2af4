"""HTTPS deployment settings (SYNAPSE_HTTPS, SYNAPSE_BEHIND_PROXY, SYNAPSE_HSTS_*) and the
sign-in throttle's settings, read as the settings module reads them: from the environment of a
fresh process (settings are module-level), against a database that is never reached; and the
client's address behind a proxy."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import RequestFactory

from federation.services import client_ip
from tests.conftest import ROOT

HOST = "synapse.example.org"
# What the settings read, taken out of the inherited environment so that each case says all of it.
READ = (
    "CELERY_BROKER_URL",
    "CELERY_RESULT_BACKEND",
    "DEBUG",
    "SECRET_KEY",
    "SECRET_KEY_FALLBACKS",
    "ALLOWED_HOSTS",
    "DATABASE_URL",
    "SYNAPSE_HTTPS",
    "SYNAPSE_BEHIND_PROXY",
    "SYNAPSE_HSTS_SECONDS",
    "SYNAPSE_HSTS_INCLUDE_SUBDOMAINS",
    "SYNAPSE_HSTS_PRELOAD",
    "SYNAPSE_LOGIN_FAILURES_PER_USERNAME",
    "SYNAPSE_LOGIN_FAILURES_PER_IP",
    "SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS",
)

# A production-like environment as `make demo` serves it: DEBUG off, a long random secret key.
# The database URL names a port nothing listens on: neither the checks nor the requests below
# may need a database.
PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": HOST,
    "DATABASE_URL": "postgres://synapse:synapse@127.0.0.1:9/synapse",
}

PROBE = f"""
import json, os
import django
os.environ["DJANGO_SETTINGS_MODULE"] = "synapse_web.settings"
django.setup()
from django.conf import settings
from django.test import Client

names = [
    "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_SSL_REDIRECT", "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS", "SECURE_HSTS_PRELOAD", "SECURE_PROXY_SSL_HEADER",
    "SESSION_COOKIE_HTTPONLY", "SECURE_REFERRER_POLICY", "X_FRAME_OPTIONS",
    "SYNAPSE_LOGIN_FAILURES_PER_USERNAME", "SYNAPSE_LOGIN_FAILURES_PER_IP",
    "SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS", "CELERY_RESULT_BACKEND", "SECRET_KEY",
]
out = {{"settings": {{name: getattr(settings, name, None) for name in names}}}}

def seen(response):
    cookie = response.cookies.get("csrftoken")
    return {{
        "status": response.status_code,
        "location": response.get("Location"),
        "hsts": response.get("Strict-Transport-Security"),
        "frame": response.get("X-Frame-Options"),
        "referrer": response.get("Referrer-Policy"),
        "csp": response.get("Content-Security-Policy"),
        "csrf_cookie_secure": bool(cookie["secure"]) if cookie else None,
    }}

client = Client(HTTP_HOST="{HOST}")
out["http_root"] = seen(client.get("/"))
out["http_health"] = seen(client.get("/healthz"))
out["http_login"] = seen(client.get("/accounts/login/"))
out["https_login"] = seen(client.get("/accounts/login/", secure=True))
out["forwarded_https_root"] = seen(client.get("/", HTTP_X_FORWARDED_PROTO="https"))
print(json.dumps(out))
"""


def clean_env(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in READ}
    return {**base, **env}


def probe(**env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_settings(seen: dict, **expected) -> None:
    assert {name: seen["settings"][name] for name in expected} == expected


def check_deploy(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_the_switch_production_stays_on_plain_http():
    # `make demo`: DEBUG=0 over http on 127.0.0.1; a secure cookie would never come back.
    seen = probe(**PRODUCTION)
    assert_settings(
        seen,
        SESSION_COOKIE_SECURE=False,
        CSRF_COOKIE_SECURE=False,
        SECURE_SSL_REDIRECT=False,
        SECURE_HSTS_SECONDS=0,
        SECURE_PROXY_SSL_HEADER=None,
        SESSION_COOKIE_HTTPONLY=True,
        SECURE_REFERRER_POLICY="same-origin",
        X_FRAME_OPTIONS="DENY",
        # The sign-in throttle's defaults.
        SYNAPSE_LOGIN_FAILURES_PER_USERNAME=10,
        SYNAPSE_LOGIN_FAILURES_PER_IP=50,
        SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS=900,
    )
    assert seen["http_root"]["status"] == 302 and seen["http_root"]["location"].startswith(
        "/accounts/login/"
    )
    assert seen["http_login"]["status"] == 200 and seen["http_login"]["csrf_cookie_secure"] is False
    assert seen["http_login"]["hsts"] is None and seen["https_login"]["hsts"] is None
    assert seen["http_login"]["frame"] == "DENY" and seen["http_login"]["referrer"] == "same-origin"
    # scripts only from the server's own files, never framed (tests/browser: nothing refused)
    policy = dict(d.strip().split(" ", 1) for d in seen["http_login"]["csp"].split(";"))
    assert policy["script-src"] == "'self'" and policy["object-src"] == "'none'"
    assert policy["frame-ancestors"] == "'none'" and policy["form-action"] == "'self'"


def test_https_switch_secures_cookies_redirects_and_sends_hsts():
    seen = probe(**PRODUCTION, SYNAPSE_HTTPS="1")
    assert_settings(
        seen,
        SESSION_COOKIE_SECURE=True,
        CSRF_COOKIE_SECURE=True,
        SECURE_SSL_REDIRECT=True,
        SECURE_HSTS_SECONDS=31536000,
        SECURE_HSTS_INCLUDE_SUBDOMAINS=False,
        SECURE_HSTS_PRELOAD=False,
        SECURE_PROXY_SSL_HEADER=None,
    )
    assert seen["http_root"]["status"] == 301
    assert seen["http_root"]["location"] == f"https://{HOST}/"
    assert seen["http_login"]["status"] == 301
    # Health checks over plain http are answered, not redirected (503 here: the probe's database
    # is unreachable on purpose).
    assert seen["http_health"]["status"] == 503 and seen["http_health"]["location"] is None
    assert seen["https_login"]["status"] == 200
    assert seen["https_login"]["hsts"] == "max-age=31536000"
    assert seen["https_login"]["csrf_cookie_secure"] is True
    # Without SYNAPSE_BEHIND_PROXY a client's X-Forwarded-Proto is not believed.
    assert seen["forwarded_https_root"]["status"] == 301


def test_behind_a_proxy_x_forwarded_proto_says_https():
    seen = probe(
        **PRODUCTION,
        SYNAPSE_HTTPS="1",
        SYNAPSE_BEHIND_PROXY="1",
        SYNAPSE_HSTS_SECONDS="3600",
        SYNAPSE_HSTS_INCLUDE_SUBDOMAINS="1",
    )
    assert seen["settings"]["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert seen["forwarded_https_root"]["status"] == 302
    assert seen["forwarded_https_root"]["location"].startswith("/accounts/login/")
    assert seen["forwarded_https_root"]["hsts"] == "max-age=3600; includeSubDomains"
    assert seen["http_root"]["status"] == 301


def test_sign_in_throttle_settings_come_from_the_environment():
    custom = probe(
        **PRODUCTION,
        SYNAPSE_LOGIN_FAILURES_PER_USERNAME="5",
        SYNAPSE_LOGIN_FAILURES_PER_IP="0",
        SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS="3600",
    )
    assert_settings(
        custom,
        SYNAPSE_LOGIN_FAILURES_PER_USERNAME=5,
        SYNAPSE_LOGIN_FAILURES_PER_IP=0,
        SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS=3600,
    )


@pytest.mark.parametrize(
    "env, named",
    [
        ({"SYNAPSE_LOGIN_FAILURES_PER_IP": "-1"}, "SYNAPSE_LOGIN_FAILURES_PER_IP"),
        ({"SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS": "0"}, "SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS"),
        # was a ValueError traceback; NaN was taken as the federation's ε budget
        ({"SYNAPSE_CONN_MAX_AGE": "1m"}, "SYNAPSE_CONN_MAX_AGE='1m': takes a whole number"),
        ({"SYNAPSE_EPSILON_BUDGET": "nan"}, "SYNAPSE_EPSILON_BUDGET='nan': takes a number"),
        # answered 500 to every routing request that named no reranker
        ({"SYNAPSE_ROUTING_RERANKER": "Fusion"}, "SYNAPSE_ROUTING_RERANKER='Fusion'"),
        # a RabbitMQ broker left the result backend `amqp`, which Celery refused at every task
        ({"CELERY_BROKER_URL": "amqp://guest:secret@127.0.0.1:5672//"},
         "CELERY_BROKER_URL=amqp://… needs CELERY_RESULT_BACKEND"),
    ],
)
def test_a_bad_setting_stops_with_one_line(env, named):
    proc = check_deploy(**PRODUCTION, **env)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert "secret@" not in proc.stderr  # a broker's password is not printed


def test_without_a_secret_key_a_developer_checkout_makes_its_own_once(tmp_path):
    """The development key was a constant in the code: `make demo`'s rounds drew their noise from
    a secret anyone could read (the pipeline derives it from SECRET_KEY)."""
    import stat

    local = {"DEBUG": "1", "SYNAPSE_DATA_DIR": str(tmp_path), "DATABASE_URL": PRODUCTION["DATABASE_URL"]}
    first = probe(**local)["settings"]["SECRET_KEY"]
    path = tmp_path / "secret_key"
    assert path.read_text().strip() == first and len(first) >= 50
    assert "dev-only" not in first and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert probe(**local)["settings"]["SECRET_KEY"] == first  # every process of the checkout
    assert probe(**local, SECRET_KEY="given")["settings"]["SECRET_KEY"] == "given"


def test_the_result_backend_is_a_redis_broker_or_named():
    redis = probe(**PRODUCTION, CELERY_BROKER_URL="redis://127.0.0.1:6379/0")
    assert redis["settings"]["CELERY_RESULT_BACKEND"] == "redis://127.0.0.1:6379/0"
    rabbit = probe(**PRODUCTION, CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//",
                   CELERY_RESULT_BACKEND="redis://127.0.0.1:6379/1")
    assert rabbit["settings"]["CELERY_RESULT_BACKEND"] == "redis://127.0.0.1:6379/1"


def test_serving_another_host_with_debug_on_by_default_stops_with_one_line():
    """A deployment that sets ALLOWED_HOSTS and a SECRET_KEY but forgets DEBUG=0 would show
    Django's traceback pages (the rows a view read, any organization's) on its host."""
    forgot = {k: v for k, v in PRODUCTION.items() if k != "DEBUG"}
    proc = check_deploy(**forgot)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"ALLOWED_HOSTS names {HOST}" in lines[0], proc.stderr
    assert "DEBUG=0" in lines[0]
    # DEBUG=1 on purpose, or only local hosts, start as before
    assert probe(**{**forgot, "DEBUG": "1"})["settings"]
    assert probe(**{**forgot, "ALLOWED_HOSTS": "127.0.0.1,localhost"})["settings"]


def test_check_deploy_passes_with_https_on():
    proc = check_deploy(**PRODUCTION, SYNAPSE_HTTPS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    # Only the two checks settings.py silences, with its reason (HSTS beyond this site).
    assert "System check identified no issues (2 silenced)." in output, output


def test_check_deploy_names_what_is_missing_without_https():
    # The same check is not blind: on plain http it lists what SYNAPSE_HTTPS would turn on.
    proc = check_deploy(**PRODUCTION)
    assert proc.returncode == 1
    for check in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert check in proc.stderr, proc.stderr


def test_client_ip_trusts_x_forwarded_for_only_behind_a_proxy(settings):
    factory = RequestFactory()
    request = factory.get(
        "/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="203.0.113.9, 198.51.100.1"
    )
    settings.SYNAPSE_BEHIND_PROXY = False
    assert client_ip(request) == "10.0.0.2"
    settings.SYNAPSE_BEHIND_PROXY = True
    # The last entry is the one the proxy appended; earlier ones the client may have forged.
    assert client_ip(request) == "198.51.100.1"
    forged = factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="not-an-address")
    assert client_ip(forged) == "10.0.0.2"
    assert client_ip(factory.get("/", REMOTE_ADDR="10.0.0.2")) == "10.0.0.2"
    # An IPv6 zone of any length is not a visitor's address (nor one PostgreSQL's inet takes).
    zoned = factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="fe80::1%" + "a" * 300)
    assert client_ip(zoned) == "10.0.0.2"
    assert client_ip(factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="2001:db8::7")) == "2001:db8::7"
    # with the client's port, as Azure Application Gateway appends it: was the proxy's address
    # for every visitor (one sign-in throttle count for all)
    for entry, address in (("203.0.113.5:4711", "203.0.113.5"), ("[2001:db8::7]:443", "2001:db8::7"),
                           ("[2001:db8::8]", "2001:db8::8")):
        ported = factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=f"1.1.1.1, {entry}")
        assert client_ip(ported) == address, entry
    for forged in ("203.0.113.5:99999x", "[not-an-address]:443", "203.0.113.5:"):
        assert client_ip(factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=forged)) == "10.0.0.2"


# --- every variable the settings read, set to a bad value ------------------------------------------
# Found by review: a number that was not one stopped start-up with a ValueError traceback, and NaN,
# infinity, a negative number or 0 where it means nothing were taken as they were (a NaN ε budget
# seeded the federation's policy row; SYNAPSE_TASK_VISIBILITY_SECONDS=0 had Redis hand every task
# to a second worker at once; SYNAPSE_TUNING_CHECK_SECONDS=0 expired beat's check before any
# worker could take it; SYNAPSE_ROUTING_VERSION_TTL=inf kept a process on its first global).
SETTINGS_FILE = ROOT / "synapse_web" / "settings.py"


def settings_from(monkeypatch, **env: str) -> dict:
    """The settings module run afresh in this process under `env` (with PRODUCTION), the rest of
    what it reads taken out of the environment."""
    import runpy

    for name in list(os.environ):
        if name in READ or name.startswith(("SYNAPSE_", "CELERY_")) or name in (
            "CSRF_TRUSTED_ORIGINS", "STATIC_ROOT", "LOG_LEVEL"
        ):
            monkeypatch.delenv(name)
    for name, value in {**PRODUCTION, **env}.items():
        monkeypatch.setenv(name, value)
    return runpy.run_path(str(SETTINGS_FILE))


def refused(monkeypatch, **env: str) -> str:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured) as caught:
        settings_from(monkeypatch, **env)
    message = str(caught.value)
    assert "\n" not in message
    return message


NUMBERS = {
    # variable: (values refused, a value taken, what it is read as)
    "SYNAPSE_CONN_MAX_AGE": (["abc", "-5", "1.5"], "0", 0),
    "SYNAPSE_LOGIN_FAILURES_PER_USERNAME": (["ten", "-1"], "0", 0),
    "SYNAPSE_LOGIN_FAILURES_PER_IP": (["abc", "-1"], "0", 0),
    "SYNAPSE_LOGIN_FAILURE_WINDOW_SECONDS": (["15m", "0"], "60", 60),
    "SYNAPSE_HSTS_SECONDS": (["one year", "-1"], "0", 0),
    "SYNAPSE_LOCK_WAIT_SECONDS": (["abc", "nan", "0", "601"], "0.5", 0.5),
    "SYNAPSE_MAX_SUBMISSION_BYTES": (["2MB", "0", "-1"], "1024", 1024),
    "SYNAPSE_EMBEDDING_DIM": (["abc", "0", "3072"], "768", 768),
    "SYNAPSE_ROUTER_TUNE_EPOCHS": (["x", "-1", "32768"], "2", 2),
    "SYNAPSE_TUNING_REQUEUE_SECONDS": (["nan", "0", "-1"], "60", 60.0),
    "SYNAPSE_TUNING_CHECK_SECONDS": (["0", "-1", "inf"], "5", 5.0),
    "SYNAPSE_MAX_QUERY_CHARS": (["0", "x"], "100", 100),
    "SYNAPSE_MAX_ROUTE_BATCH": (["0", "-3"], "10", 10),
    "SYNAPSE_ROUTE_RATE_LIMIT": (["-1", "lots"], "0", 0),
    "SYNAPSE_LLM_BATCH_SECONDS": (["nan", "-1"], "0", 0.0),
    "SYNAPSE_ROUTING_REBUILD_SECONDS": (["-1", "soon"], "0", 0.0),
    "SYNAPSE_ROUTING_VERSION_TTL": (["inf", "-2"], "0", 0.0),
    "SYNAPSE_ERASURE_CHECK_SECONDS": (["-1", "nan", "1m"], "0", 0.0),
    "SYNAPSE_ROUTING_CALL_RETENTION_DAYS": (["x", "0"], "7", 7),
    "SYNAPSE_EPSILON_BUDGET": (["nan", "inf", "0", "-1"], "2.5", 2.5),
    "SYNAPSE_DELTA_PRIME": (["0", "1", "2", "nan"], "1e-6", 1e-6),
    "SYNAPSE_TASK_MAX_DELIVERIES": (["0", "three"], "1", 1),
    "SYNAPSE_TASK_VISIBILITY_SECONDS": (["0", "12h"], "86400", 86400),
    "SYNAPSE_TASK_TIME_LIMIT_SECONDS": (["0", "3h", "-1"], "600", 600),
    "SYNAPSE_DEADLINE_CHECK_SECONDS": (["0", "x", "nan"], "1", 1.0),
    # read outside the settings (routing.embeddings, routing.llm), checked at start-up all the same
    "SYNAPSE_ONNX_THREADS": (["two", "-1"], "1", 1),
    "SYNAPSE_EMBEDDING_CACHE_ENTRIES": (["-1", "10k"], "0", 0),
    "SYNAPSE_LLM_PAUSE_SECONDS": (["-1", "nan", "x"], "0", 0.0),
    "SYNAPSE_MERGE_LLM_CALL_SECONDS": (["-1", "inf", "soon"], "0", 0.0),
}


@pytest.mark.parametrize(
    "name, value", [(name, value) for name, (bad, _, _) in NUMBERS.items() for value in bad]
)
def test_a_bad_number_stops_with_one_line_naming_the_variable(monkeypatch, name, value):
    message = refused(monkeypatch, **{name: value})
    assert message.startswith(f"{name}={value!r}: takes "), message


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_a_good_number_is_taken_and_empty_means_the_default(monkeypatch, name):
    _, good, read = NUMBERS[name]
    seen = settings_from(monkeypatch, **{name: good})
    if name in seen:  # the three read elsewhere are only checked here
        assert seen[name] == read and type(seen[name]) is type(read)
    default = settings_from(monkeypatch)
    assert settings_from(monkeypatch, **{name: ""}).get(name) == default.get(name)


def test_a_task_time_limit_not_below_the_visibility_timeout_stops_with_one_line(monkeypatch):
    """Redis hands a task's message to another worker once the task has run the visibility
    timeout: a task may not be allowed to run that long (its hard limit is 60 s past the soft)."""
    message = refused(monkeypatch, SYNAPSE_TASK_VISIBILITY_SECONDS="3600",
                      SYNAPSE_TASK_TIME_LIMIT_SECONDS="3540")
    assert message.startswith("SYNAPSE_TASK_TIME_LIMIT_SECONDS=3540 must be more than 60 s below "
                              "SYNAPSE_TASK_VISIBILITY_SECONDS=3600"), message
    seen = settings_from(monkeypatch, SYNAPSE_TASK_VISIBILITY_SECONDS="3600",
                         SYNAPSE_TASK_TIME_LIMIT_SECONDS="3539")
    assert (seen["CELERY_TASK_SOFT_TIME_LIMIT"], seen["CELERY_TASK_TIME_LIMIT"]) == (3539, 3599)


@pytest.mark.parametrize("value", ["", "  "])
def test_the_numbers_read_outside_the_settings_take_their_default_when_set_to_nothing(
    monkeypatch, value
):
    """Found by review: the settings read SYNAPSE_LLM_PAUSE_SECONDS= as its default (30), as the
    README says, but routing.llm read it as 0 (the LLM asked again at every call after it was
    found down); set to spaces, it and the two routing.embeddings reads were a ValueError at the
    first routing request, after start-up had let them through."""
    from routing.embeddings import ONNX_INT8_DYNAMIC_MODEL, EmbeddingEngine
    from routing.llm import get_llm

    # start-up takes them, and leaves them set for their readers
    settings_from(monkeypatch, SYNAPSE_LLM_PAUSE_SECONDS=value, SYNAPSE_ONNX_THREADS=value,
                  SYNAPSE_EMBEDDING_CACHE_ENTRIES=value)
    assert get_llm(base_url="http://127.0.0.1:9/v1", model="m").pause == 30.0
    assert EmbeddingEngine(ONNX_INT8_DYNAMIC_MODEL)._cache_size == 200_000


def test_the_database_connection_age_reaches_the_database_settings(monkeypatch):
    seen = settings_from(monkeypatch, SYNAPSE_CONN_MAX_AGE="7")
    assert seen["DATABASES"]["default"]["CONN_MAX_AGE"] == 7


@pytest.mark.parametrize(
    "name", ["DEBUG", "SYNAPSE_HTTPS", "SYNAPSE_BEHIND_PROXY", "SYNAPSE_HSTS_INCLUDE_SUBDOMAINS",
             "SYNAPSE_HSTS_PRELOAD", "SYNAPSE_DB_PREPARE"],
)
def test_a_switch_takes_yes_or_no_and_nothing_else(monkeypatch, name):
    """Found by review: anything but 1/true/yes/on was off, without a word: SYNAPSE_HTTPS=ture
    served session cookies without Secure and no HSTS, as if https had not been asked for."""
    for value in ("ture", "2", "enabled", "y"):
        assert refused(monkeypatch, **{name: value}).startswith(f"{name}={value!r}: takes 1 or 0"), value
    setting = {"SYNAPSE_HSTS_INCLUDE_SUBDOMAINS": "SECURE_HSTS_INCLUDE_SUBDOMAINS",
               "SYNAPSE_HSTS_PRELOAD": "SECURE_HSTS_PRELOAD"}.get(name, name)
    for value, read in (("1", True), (" Yes", True), ("ON", True), ("true", True),
                        ("0", False), ("no", False), ("Off", False), ("FALSE", False), ("", False)):
        assert settings_from(monkeypatch, **{name: value})[setting] is read, value


@pytest.mark.parametrize(
    "url, named",
    [
        ("notaurl", "DATABASE_URL is not a URL"),
        ("postgres//synapse:secret@db/synapse", "DATABASE_URL is not a URL"),
        ("mysql://synapse:secret@db/synapse", "DATABASE_URL=mysql://… is not PostgreSQL"),
        ("sqlite:///synapse.db", "DATABASE_URL=sqlite://… is not PostgreSQL"),
        ("redis://:secret@db:6379/0", "DATABASE_URL=redis://… is not PostgreSQL"),
        # a password with an unquoted character the URL cannot hold, a port that is no number
        ("postgres://synapse:se[cret@db/synapse", "DATABASE_URL=postgres://… cannot be read"),
        ("postgres://synapse:secret@db:port/synapse", "DATABASE_URL=postgres://… cannot be read"),
    ],
)
def test_a_database_url_that_is_not_postgresql_stops_with_one_line(monkeypatch, url, named):
    """Found by review: a URL of no scheme dj-database-url knows was an UnknownSchemeError
    traceback, one it could not parse a ParseError traceback, and one of another database
    (mysql, sqlite) went on to fail later on a missing driver or pgvector."""
    message = refused(monkeypatch, DATABASE_URL=url)
    assert message.startswith(named), message
    assert "secret" not in message  # the password is not printed


def test_a_bad_database_url_is_one_line_from_manage_py():
    proc = check_deploy(**{**PRODUCTION, "DATABASE_URL": "postgresql:/synapse:secret@db:5432/synapse"})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "DATABASE_URL" in lines[0], proc.stderr
    assert "secret" not in proc.stderr


@pytest.mark.parametrize(
    "env, named",
    [
        # no URL at all: the line said `notaurl://… needs CELERY_RESULT_BACKEND`, and a URL
        # missing its `:` was printed whole, password included
        ({"CELERY_BROKER_URL": "notaurl"}, "CELERY_BROKER_URL is not a URL"),
        ({"CELERY_BROKER_URL": "redis//:secret@redis:6379/0"}, "CELERY_BROKER_URL is not a URL"),
        # a transport kombu does not have: the first task sent failed
        ({"CELERY_BROKER_URL": "reddis://:secret@redis:6379/0",
          "CELERY_RESULT_BACKEND": "redis://redis:6379/1"},
         "CELERY_BROKER_URL=reddis://… names no broker Celery knows"),
        ({"CELERY_BROKER_URL": "amqp://guest:secret@rabbit:5672//",
          "CELERY_RESULT_BACKEND": "rpc://"}, "CELERY_RESULT_BACKEND=rpc://… joins no chords"),
        ({"CELERY_BROKER_URL": "amqp://guest:secret@rabbit:5672//",
          "CELERY_RESULT_BACKEND": "amqp://guest:secret@rabbit:5672//"},
         "CELERY_RESULT_BACKEND=amqp://… names no result backend Celery knows"),
        ({"CELERY_BROKER_URL": "redis://:secret@redis:6379/0", "CELERY_RESULT_BACKEND": "redis"},
         "CELERY_RESULT_BACKEND is not a URL"),
    ],
)
def test_a_broker_or_result_backend_celery_cannot_use_stops_with_one_line(monkeypatch, env, named):
    """Found by review: the merge pipeline is a chord; a result backend that joins none (rpc://,
    which the comment in the settings names) or a transport Celery does not have was taken, and
    every round's close failed when it sent its tasks."""
    message = refused(monkeypatch, **env)
    assert message.startswith(named), message
    assert "secret" not in message


def test_celery_urls_that_work_are_taken(monkeypatch):
    for env in (
        {"CELERY_BROKER_URL": "redis://redis:6379/0"},
        {"CELERY_BROKER_URL": "rediss://:pw@redis:6380/0?ssl_cert_reqs=required"},
        {"CELERY_BROKER_URL": "sentinel://s1:26379;sentinel://s2:26379",
         "CELERY_RESULT_BACKEND": "redis://redis:6379/1"},
        {"CELERY_BROKER_URL": "amqp://guest:guest@rabbit:5672//",
         "CELERY_RESULT_BACKEND": "db+postgresql://synapse:pw@postgres/celery"},
        {"CELERY_BROKER_URL": "pyamqp://guest@rabbit//", "CELERY_RESULT_BACKEND": "redis://r:6379/1"},
    ):
        seen = settings_from(monkeypatch, **env)
        assert seen["CELERY_BROKER_URL"] == env["CELERY_BROKER_URL"]


def test_log_level_is_a_level_name_in_any_case(monkeypatch):
    """Found by review: LOG_LEVEL=info (or a misspelt level) stopped every command with a
    traceback ending in `ValueError: Unable to configure root logger`."""
    assert settings_from(monkeypatch, LOG_LEVEL="info")["LOGGING"]["root"]["level"] == "INFO"
    assert settings_from(monkeypatch)["LOGGING"]["root"]["level"] == "WARNING"
    message = refused(monkeypatch, LOG_LEVEL="LOUD")
    assert message.startswith("LOG_LEVEL='LOUD': takes DEBUG, INFO, WARNING, ERROR or CRITICAL"), message
    proc = check_deploy(**PRODUCTION, LOG_LEVEL="verbose")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "LOG_LEVEL" in lines[0], proc.stderr


@pytest.mark.django_db
def test_secret_key_fallbacks_keep_people_signed_in_across_a_key_rotation(
    monkeypatch, client, django_user_model, settings
):
    """Found by the operations audit: SECRET_KEY_FALLBACKS could not be set, so rotating
    SECRET_KEY (a key leaked, a routine rotation) signed every operator and admin out at once."""
    fallbacks = settings_from(monkeypatch, SECRET_KEY_FALLBACKS=" old-key-1 , ,old-key-0 ")[
        "SECRET_KEY_FALLBACKS"]
    assert fallbacks == ["old-key-1", "old-key-0"]
    assert settings_from(monkeypatch)["SECRET_KEY_FALLBACKS"] == []
    user = django_user_model.objects.create_user("rotated", password="a long enough password")
    page = "/accounts/password_change/"  # signed-in people only

    def signed_in_under_old_key_then_rotated(fallback_keys):
        settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "old-key-1", []
        client.force_login(user)
        assert client.get(page).status_code == 200
        settings.SECRET_KEY, settings.SECRET_KEY_FALLBACKS = "new-key", fallback_keys
        return client.get(page)

    assert signed_in_under_old_key_then_rotated([]).status_code == 302  # signed out
    assert signed_in_under_old_key_then_rotated(fallbacks).status_code == 200


def test_a_log_line_says_when_its_level_its_logger_and_its_process():
    """Found by the operations audit: the console handler had no format, so a line was the bare
    message: the web app's and the workers' lines in one container log could not be filtered by
    level nor traced to the code or the process that wrote them."""
    proc = subprocess.run(
        [sys.executable, "-c",
         "import os, logging, django\n"
         "os.environ['DJANGO_SETTINGS_MODULE'] = 'synapse_web.settings'\n"
         "django.setup()\n"
         "logging.getLogger('federation.pipeline').warning('round %s failed: %s', 7, 'why')\n"
         "print(os.getpid())"],
        cwd=ROOT, env=clean_env(**PRODUCTION), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    pid = proc.stdout.strip()
    assert re.fullmatch(
        rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} WARNING federation\.pipeline \[{pid}\] "
        r"round 7 failed: why", line), line


@pytest.mark.parametrize(
    "hosts, named",
    [
        ("https://synapse.example.org", "ALLOWED_HOSTS names 'https://synapse.example.org': a host"),
        ("synapse.example.org/", "ALLOWED_HOSTS names 'synapse.example.org/': a host"),
        ("127.0.0.1,synapse.example.org:8000", "ALLOWED_HOSTS names 'synapse.example.org:8000': a host"),
        ("[::1]:8000", "ALLOWED_HOSTS names '[::1]:8000': a host"),
        ("127.0.0.1,::1", "ALLOWED_HOSTS names '::1': an IPv6 address matches requests only in "
                          "brackets, as a Host header writes it ([::1])"),
        (" , ", "ALLOWED_HOSTS is empty"),
    ],
)
def test_allowed_hosts_that_match_no_request_stop_with_one_line(monkeypatch, hosts, named):
    """Found by review: a URL, a path or a port in ALLOWED_HOSTS matches no Host header (Django
    compares the host without its port), and an empty list with DEBUG off matches none: every
    request was a 400, the compose healthcheck's too, with nothing said at start-up."""
    message = refused(monkeypatch, ALLOWED_HOSTS=hosts)
    assert message.startswith(named), message


@pytest.mark.parametrize("blank", [" ", "\t \n"])
def test_a_secret_key_of_blanks_is_no_secret_key(monkeypatch, blank):
    """Found by review: SECRET_KEY=" " (an unfilled template) was taken as the key with DEBUG=0,
    signing every session with a key anyone could guess."""
    assert refused(monkeypatch, SECRET_KEY=blank) == "SECRET_KEY must be set when DEBUG=0"


@pytest.mark.parametrize("blank", [" ", "\t \n"])
def test_a_noise_secret_of_blanks_is_no_noise_secret(monkeypatch, blank):
    """Found by audit: SYNAPSE_NOISE_SECRET=" " (an unfilled template, as SECRET_KEY=" " is no
    key) was taken as the secret of every edge release's noise seed: a secret of one space,
    which anyone could try, and the Laplace noise of every release redrawn and subtracted.
    Blanks only are unset, as the README's "unset: derived from SECRET_KEY"."""
    assert settings_from(monkeypatch, SYNAPSE_NOISE_SECRET=blank)["SYNAPSE_NOISE_SECRET"] == ""
    given = settings_from(monkeypatch, SYNAPSE_NOISE_SECRET="a server-side secret")
    assert given["SYNAPSE_NOISE_SECRET"] == "a server-side secret"


@pytest.mark.parametrize(
    "url, named",
    [
        ("localhost:8000/v1", "SYNAPSE_LLM_BASE_URL names a URL without http:// or https://"),
        ("llm:8000", "SYNAPSE_LLM_BASE_URL names a URL without http:// or https://"),
        ("ftp://user:pw@llm/v1", "SYNAPSE_LLM_BASE_URL names ftp://…"),
        ("http://", "SYNAPSE_LLM_BASE_URL names http://…"),
        ("http://llm:80000/v1", "SYNAPSE_LLM_BASE_URL cannot be read as a URL"),
        ("http://user:secret@[::1/v1", "SYNAPSE_LLM_BASE_URL cannot be read as a URL"),
        (" ", "SYNAPSE_LLM_BASE_URL names a URL without http:// or https://"),
    ],
)
def test_an_llm_url_httpx_cannot_ask_stops_with_one_line(monkeypatch, url, named):
    """Found by audit: the README says a malformed URL stops start-up; SYNAPSE_LLM_BASE_URL
    without its scheme (localhost:8000/v1) started, and every routing call with `reranker: llm`
    and every merge's summary found the endpoint "down" (UnsupportedProtocol) and fell back."""
    message = refused(monkeypatch, SYNAPSE_LLM_BASE_URL=url)
    assert message.startswith(named) and "http://HOST:PORT/v1" in message, message
    assert "secret" not in message and "pw" not in message


def test_llm_urls_httpx_asks_are_taken(monkeypatch):
    for url in ("http://llm:8000/v1", "https://user:secret@api.example.org", "http://[::1]:8080",
                "HTTP://127.0.0.1:8000/v1"):
        assert settings_from(monkeypatch, SYNAPSE_LLM_BASE_URL=url)["SYNAPSE_LLM_BASE_URL"] == url


def test_a_gguf_model_that_is_not_there_stops_with_one_line(monkeypatch, tmp_path):
    """Found by audit: a misspelt SYNAPSE_LLM_GGUF started, and every routing call with
    `reranker: llm` and every merge's summary fell back without the LLM ("GGUF model file not
    found"), as a misspelt SYNAPSE_ROUTING_PARAMS did before it stopped start-up."""
    missing = tmp_path / "model.guff"
    message = refused(monkeypatch, SYNAPSE_LLM_GGUF=str(missing))
    assert message.startswith(f"SYNAPSE_LLM_GGUF={str(missing)!r}: no such file"), message
    assert refused(monkeypatch, SYNAPSE_LLM_GGUF=str(tmp_path)).startswith("SYNAPSE_LLM_GGUF=")
    given = tmp_path / "model.gguf"
    given.write_bytes(b"GGUF")
    for value in (str(given), "smollm2", ""):
        settings_from(monkeypatch, SYNAPSE_LLM_GGUF=value)


def test_allowed_hosts_django_takes_are_taken(monkeypatch):
    hosts = "synapse.example.org,.example.net,127.0.0.1,[::1],*"
    assert settings_from(monkeypatch, ALLOWED_HOSTS=hosts)["ALLOWED_HOSTS"] == hosts.split(",")
    # DEBUG on, where Django itself lets an empty list mean the local hosts
    assert settings_from(monkeypatch, DEBUG="1", ALLOWED_HOSTS="")["ALLOWED_HOSTS"] == []


@pytest.mark.parametrize(
    "origins",
    ["synapse.example.org", "https://synapse.example.org/", "https://synapse.example.org/login",
     "ftp://synapse.example.org", "https://"],
)
def test_csrf_trusted_origins_that_match_no_origin_stop_with_one_line(monkeypatch, origins):
    """Found by review: an origin is compared as scheme://host[:port]; one with a path (a trailing
    slash) or without a scheme matched no browser's Origin, and every form posted through a proxy
    that rewrites Host was a 403 (the missing scheme only in `manage.py check`, not gunicorn)."""
    message = refused(monkeypatch, CSRF_TRUSTED_ORIGINS=f"http://127.0.0.1:8000,{origins}")
    assert message.startswith(f"CSRF_TRUSTED_ORIGINS names {origins!r}: "), message


def test_csrf_trusted_origins_django_takes_are_taken(monkeypatch):
    origins = "https://synapse.example.org,http://10.0.0.5:8000,https://*.example.net"
    assert settings_from(monkeypatch, CSRF_TRUSTED_ORIGINS=origins)["CSRF_TRUSTED_ORIGINS"] == (
        origins.split(","))


def test_an_empty_folder_or_queue_is_the_default_not_the_current_directory(monkeypatch):
    """Found by review: SYNAPSE_DATA_DIR= (as `make demo` reads it too: `$(or ...,.data)`) put the
    embedded database, the tuned routers and a development secret key in the current directory,
    the checkout's root, where git does not ignore them, while the Makefile read .data/secret_key;
    STATIC_ROOT= had collectstatic write into the current directory; CELERY_TASK_DEFAULT_QUEUE=
    sent the merge tasks to a queue named '' that no worker consumes."""
    seen = settings_from(monkeypatch, SYNAPSE_DATA_DIR="", STATIC_ROOT="", CELERY_TASK_DEFAULT_QUEUE="")
    assert seen["DATA_DIR"] == ROOT / ".data"
    assert seen["STATIC_ROOT"] == ROOT / "staticfiles"
    assert seen["CELERY_TASK_DEFAULT_QUEUE"] == "cpu"
    given = settings_from(monkeypatch, SYNAPSE_DATA_DIR="/srv/synapse", STATIC_ROOT="/srv/static",
                          CELERY_TASK_DEFAULT_QUEUE="merges")
    assert given["DATA_DIR"] == Path("/srv/synapse") and given["STATIC_ROOT"] == Path("/srv/static")
    assert given["CELERY_TASK_DEFAULT_QUEUE"] == "merges"


def test_a_routing_params_file_that_is_not_there_stops_with_one_line(monkeypatch, tmp_path):
    """Found by review: a misspelt SYNAPSE_ROUTING_PARAMS started, and every router build logged a
    warning and routed with other weights than the operator's (a file broken later still does,
    routing.services.routing_params: routing goes on)."""
    missing = tmp_path / "params.jsn"
    message = refused(monkeypatch, SYNAPSE_ROUTING_PARAMS=str(missing))
    assert message.startswith(f"SYNAPSE_ROUTING_PARAMS={str(missing)!r}: no such file"), message
    assert refused(monkeypatch, SYNAPSE_ROUTING_PARAMS=str(tmp_path)).startswith("SYNAPSE_ROUTING_PARAMS=")
    given = tmp_path / "params.json"
    given.write_text("{}")
    assert settings_from(monkeypatch, SYNAPSE_ROUTING_PARAMS=str(given))["SYNAPSE_ROUTING_PARAMS"] == str(given)
    assert settings_from(monkeypatch, SYNAPSE_ROUTING_PARAMS="")["SYNAPSE_ROUTING_PARAMS"] == ""


@pytest.mark.parametrize(
    "token",
    [
        "prometheus scrape token 2026 for synapse",  # words with spaces
        " " * 30,  # an unfilled template's blanks
        "a-long-enough-metrics-token-\u00e9t\u00e9-2026",  # not ASCII
        "a-long-enough-metrics-token\t2026",
    ],
)
def test_a_metrics_token_no_authorization_header_can_carry_stops_with_one_line(monkeypatch, token):
    """Found by audit: SYNAPSE_METRICS_TOKEN was only checked for its length, so a token holding
    a space (or only blanks, or a letter outside ASCII) started the server and then refused every
    scrape: `Authorization: Bearer <token>` splits at the space ("malformed Authorization
    header"), and a header's bytes come to Django as Latin-1, so a UTF-8 letter never compares
    equal. A value the variable cannot take stops start-up naming it, as the README says."""
    message = refused(monkeypatch, SYNAPSE_METRICS_TOKEN=token)
    assert message.startswith("SYNAPSE_METRICS_TOKEN"), message
    assert token not in message  # a secret is never echoed


def test_a_metrics_token_of_visible_ascii_is_taken(monkeypatch):
    token = "Abc-123_~!.+/=" + "x" * 20
    assert settings_from(monkeypatch, SYNAPSE_METRICS_TOKEN=token)["SYNAPSE_METRICS_TOKEN"] == token


def test_a_routing_params_file_that_is_no_parameters_file_stops_start_up(settings, tmp_path):
    """Settings check only that SYNAPSE_ROUTING_PARAMS is there: a JSON of something else
    started, and every router build then warned and routed with other weights than the
    operator's. The routing app's start-up reads it and stops with one line saying why."""
    from django.apps import apps
    from django.core.exceptions import ImproperlyConfigured

    other = tmp_path / "params.json"
    other.write_text('{"tools": []}')
    settings.SYNAPSE_ROUTING_PARAMS = str(other)
    with pytest.raises(ImproperlyConfigured) as caught:
        apps.get_app_config("routing").ready()
    message = str(caught.value)
    assert message.startswith(f"SYNAPSE_ROUTING_PARAMS={str(other)!r}: {other} is not a routing "
                              "parameters file (no 'weights' or 'calibration'"), message
    assert "\n" not in message
    from routing.router import RoutingParams

    RoutingParams().save(other)
    apps.get_app_config("routing").ready()  # a parameters file: starts
