"""Configuration errors are one clear line, not a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


@pytest.mark.skipif(
    not _port_open("127.0.0.1", 5432), reason="needs the machine's plain PostgreSQL on 127.0.0.1:5432"
)
def test_database_without_pgvector_stops_with_one_line():
    env = dict(os.environ, DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres")
    proc = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "has no pgvector extension" in lines[0] and "unset DATABASE_URL" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "gunicorn", "synapse_web.wsgi:application", "--bind", "127.0.0.1:0", "--workers", "1"],
        ["-m", "celery", "-A", "synapse_web", "worker", "-Q", "cpu", "--concurrency", "1"],
        ["-m", "celery", "-A", "synapse_web", "beat", "--schedule", "/dev/null"],
    ],
    ids=["gunicorn", "celery worker", "celery beat"],
)
def test_a_bad_setting_stops_gunicorn_and_celery_with_one_line(command):
    """Found by review: the README says a bad value stops gunicorn at start-up with one line; it
    printed the settings' traceback from each worker it booted, and a Celery worker or beat
    (docker-compose's worker-cpu, worker-gpu, beat) a traceback through click and kombu."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("SYNAPSE_", "CELERY_")) and name != "SECRET_KEY"}
    env["DEBUG"] = "0"
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["synapse: SECRET_KEY must be set when DEBUG=0"], proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [["round_status"], ["migrate", "--noinput"]])
def test_a_database_that_cannot_be_reached_stops_a_command_with_one_line(command):
    """Found by review: a DATABASE_URL naming a host where no PostgreSQL answers (or a wrong
    port, a server down) stopped every command with psycopg's traceback."""
    env = dict(os.environ, DATABASE_URL="postgres://synapse:secret-password@127.0.0.1:1/synapse")
    proc = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("synapse: cannot connect to the database DATABASE_URL names: "), lines
    assert "Connection refused" in lines[0] and "secret-password" not in lines[0]


@pytest.mark.slow
def test_a_data_folder_that_cannot_be_made_stops_a_command_with_one_line(tmp_path):
    """Found by review: a SYNAPSE_DATA_DIR that cannot be made (under a file, say) stopped every
    command with a NotADirectoryError traceback from starting the embedded database."""
    (tmp_path / "a-file").write_text("")
    env = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    env["SYNAPSE_DATA_DIR"] = str(tmp_path / "a-file" / "data")
    proc = subprocess.run([sys.executable, "manage.py", "round_status"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"synapse: SYNAPSE_DATA_DIR={env['SYNAPSE_DATA_DIR']!r}: "), lines
    assert "Not a directory" in lines[0]


@pytest.mark.slow
def test_a_command_on_an_unmigrated_database_says_to_migrate(tmp_path):
    """Found by review: round_status, erase_client or issue_user_token run before `migrate`
    (a fresh SYNAPSE_DATA_DIR, a new DATABASE_URL) stopped with psycopg's traceback about a
    missing relation."""
    env = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    env["SYNAPSE_DATA_DIR"] = str(tmp_path / "data")
    try:
        for command in (["round_status"], ["erase_client", "acme/one"]):
            proc = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=180)
            assert proc.returncode == 2, proc.stderr
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert len(lines) == 1, proc.stderr
            assert lines[0].startswith("synapse: the database is not migrated ("), lines
            assert lines[0].endswith("run `python manage.py migrate` first"), lines
    finally:
        subprocess.run([sys.executable, "manage.py", "embedded_db", "stop"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120)


@pytest.mark.parametrize("argv", [["round_status"], ["migrate"]])
def test_a_missing_table_says_to_migrate_except_to_migrate_itself(argv, monkeypatch, capsys):
    """A failed statement on a database behind the code is "run migrate"; the same error from
    `migrate` (a migration that failed) is its own, not advice to run what just failed."""
    import importlib.util

    import django.core.management
    from django.db import ProgrammingError

    spec = importlib.util.spec_from_file_location("synapse_manage", ROOT / "manage.py")
    manage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(manage)

    def fails(argv):
        raise ProgrammingError('relation "federation_round" does not exist')

    monkeypatch.setattr(django.core.management, "execute_from_command_line", fails)
    monkeypatch.setattr(manage, "_unapplied_migrations", lambda: 3)
    monkeypatch.setattr(sys, "argv", ["manage.py", *argv])
    if argv == ["migrate"]:
        with pytest.raises(ProgrammingError):
            manage.main()
        return
    with pytest.raises(SystemExit) as stop:
        manage.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "synapse: the database is not migrated (3 migrations not applied): run `python manage.py "
        "migrate` first\n"
    )


def test_docker_compose_file_declares_the_services():
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "web", "worker-cpu", "worker-gpu", "llm", "beat"} <= set(services)
    assert "beat" in services["beat"]["command"]  # rounds close at their deadline
    assert "pgvector" in services["postgres"]["image"]
    assert services["web"]["environment"]["DATABASE_URL"].startswith("postgres")
    # The GPU worker tunes the router (routing.finetune): its image needs torch's CUDA build,
    # which the Dockerfile installs from the index the build argument names (CPU by default).
    gpu_build = services["worker-gpu"]["build"]
    assert "/whl/cu" in gpu_build["args"]["TORCH_INDEX"]
    assert "--index-url ${TORCH_INDEX}" in (ROOT / "Dockerfile").read_text()
    assert "-Q gpu" in services["worker-gpu"]["command"]
    # Found by review: migrations run once before anything uses the database (the workers and
    # beat did not wait for web's migrate); gunicorn gets SIGTERM (sh was PID 1); the GPU
    # services are a profile (a CPU-only host could not start them, and tuning went to a queue
    # nothing consumed); vLLM is served as `vllm serve MODEL`.
    assert "migrate" in services["migrate"]["command"]
    for name in ("web", "worker-cpu", "worker-gpu", "beat"):
        assert services[name]["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"}, name
        assert "migrate" not in str(services[name]["command"])
    assert "exec gunicorn" in services["web"]["command"]
    assert services["worker-gpu"]["profiles"] == services["llm"]["profiles"] == ["gpu"]
    assert not any("profiles" in services[n] for n in ("postgres", "redis", "migrate", "web",
                                                       "worker-cpu", "beat"))
    env = compose["x-synapse-env"]
    assert env["SYNAPSE_ROUTER_TUNE_QUEUE"] == "${SYNAPSE_ROUTER_TUNE_QUEUE:-cpu}"
    assert "-Q cpu" in services["worker-cpu"]["command"]
    assert env["SYNAPSE_LLM_BASE_URL"] == "${SYNAPSE_LLM_BASE_URL:-}"
    assert services["llm"]["entrypoint"] == ["vllm", "serve"]
    assert not services["llm"]["command"][0].startswith("-")  # the model, positional
    assert not services["llm"]["image"].endswith(":latest")


@pytest.mark.django_db
def test_healthz_answers_ok_and_503_when_the_database_does_not(client, monkeypatch):
    from django.db import OperationalError

    from synapse_web import health

    assert client.get("/healthz").json() == {"status": "ok", "database": "ok", "migrations": "ok"}

    class Down:
        def cursor(self):
            raise OperationalError("connection refused")

    monkeypatch.setattr(health, "connection", Down())  # the database going away under a live server
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "database": "OperationalError"}


@pytest.mark.django_db
def test_healthz_is_503_while_a_migration_of_this_code_is_not_applied(client):
    """Found by the operations audit: /healthz asked the database `SELECT 1` only, so a new
    release whose migrations had not run (started before `migrate`, or after it failed) was
    reported healthy and put behind the load balancer, where every query of a new table or
    column was a 500. A migration the database has and this code does not (a newer release
    migrated while this one serves) is no reason to take it out."""
    from django.db import connection
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connection)
    newest = recorder.migration_qs.filter(app="federation").order_by("-id").first()
    newest.delete()  # this test's transaction only: the schema is as it was
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "database": "ok", "migrations": "pending"}

    recorder.record_applied("federation", newest.name)
    recorder.record_applied("federation", "9999_of_a_newer_release")
    response = client.get("/healthz")
    assert response.status_code == 200, response.json()
    assert response.json()["migrations"] == "ok"


def test_every_variable_the_server_reads_is_in_the_readme_configuration_table():
    """Found by review: SYNAPSE_EMBEDDING_CACHE_ENTRIES (routing.embeddings; gunicorn.conf.py
    sets it) was read but not in the table."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    table = {name for row in section.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split(" | ")[0])}
    read = set()
    for folder in ("synapse_web", "routing", "federation", "workers", "compendium"):
        for path in (ROOT / folder).rglob("*.py"):
            if "client_cli" in path.name:  # the client toolkit's own (its own section)
                continue
            source = path.read_text(encoding="utf-8")
            read |= set(re.findall(r"""(?:environ\.get\(|environ\[|env_\w+\()\s*["']([A-Z][A-Z0-9_]+)["']""",
                                   source))
    read -= {"XDG_CACHE_HOME", "TEXTGRAD_LOG_DIR", "DJANGO_SETTINGS_MODULE"}  # not ours to set
    assert read - table == set(), "read but not in README's Configuration table"
    documented_elsewhere = {"SYNAPSE_VLLM_GPU_MEMORY"}  # docker-compose.yml's, for vLLM
    assert table - read - documented_elsewhere == set(), "in the table but read nowhere"


def test_the_image_leaves_out_the_env_file_that_holds_the_deployment_secrets():
    """Found by review: the README has the compose settings (SECRET_KEY, SYNAPSE_LLM_API_KEY,
    SYNAPSE_METRICS_TOKEN) put in an `.env` file next to docker-compose.yml, which is the build
    context: the Dockerfile's `COPY . .` put it in the image, for anyone who pulls it to read."""
    import fnmatch

    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for path in (".env", ".env.production", ".data/secret_key", ".venv/bin/python"):
        assert any(fnmatch.fnmatch(path, p) or path.startswith(p + "/") for p in patterns), path
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_docker_compose_passes_what_a_deployment_behind_a_proxy_or_with_a_hosted_llm_sets():
    """Found by review: x-synapse-env passed SYNAPSE_LLM_BASE_URL but not its SYNAPSE_LLM_API_KEY
    (a hosted endpoint was asked without the key), nor CSRF_TRUSTED_ORIGINS (which the README
    says to set behind a proxy that rewrites Host) or the HSTS choices beside SYNAPSE_HSTS_SECONDS:
    set in the shell or .env, they never reached the containers."""
    import re

    import yaml

    env = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["x-synapse-env"]
    assert env["SYNAPSE_LLM_API_KEY"] == "${SYNAPSE_LLM_API_KEY:-}"
    assert env["CSRF_TRUSTED_ORIGINS"] == "${CSRF_TRUSTED_ORIGINS:-http://127.0.0.1:8000,http://localhost:8000}"
    assert env["SYNAPSE_HSTS_INCLUDE_SUBDOMAINS"] == "${SYNAPSE_HSTS_INCLUDE_SUBDOMAINS:-0}"
    assert env["SYNAPSE_HSTS_PRELOAD"] == "${SYNAPSE_HSTS_PRELOAD:-0}"
    # Found by audit: nor SYNAPSE_NOISE_SECRET: the workers' merges drew the noise from
    # SECRET_KEY whatever the operator set, and rotating SECRET_KEY changed it.
    assert env["SYNAPSE_NOISE_SECRET"] == "${SYNAPSE_NOISE_SECRET:-}"
    # and every name it sets is one the server reads
    settings = (ROOT / "synapse_web" / "settings.py").read_text()
    for name in env:
        assert re.search(rf"""["']{name}["']""", settings), name


def _compose_seconds(duration: str) -> float:
    """A compose duration (`40s`, `15m`, `1h30m`) in seconds."""
    import re

    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def test_docker_compose_stops_the_server_and_workers_after_their_work_not_docker_s_ten_seconds():
    """Found by review: no service set stop_grace_period, so `docker compose stop` (or `up` of a
    new release) sent SIGKILL 10 s after SIGTERM. Celery's warm shutdown was still waiting for a
    merge or tuning: killed, its late-acknowledged message stayed unacknowledged in Redis until
    the visibility timeout (12 h) and no fresh worker took it meanwhile (reproduced with a worker
    on redis-server, SIGTERM, SIGKILL 10 s later, a second worker). gunicorn's in-flight requests
    (graceful_timeout) were cut off at 10 s too."""
    import yaml
    from gunicorn.config import Config

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    graceful = Config().graceful_timeout  # gunicorn.conf.py and the command leave it as it is
    assert "graceful_timeout" not in (ROOT / "gunicorn.conf.py").read_text()
    assert "graceful-timeout" not in services["web"]["command"]
    assert _compose_seconds(services["web"]["stop_grace_period"]) > graceful
    for name in ("worker-cpu", "worker-gpu"):
        # a merge, or an epoch of tuning on CPU (about 7 minutes on one core at MetaTool's size)
        assert _compose_seconds(services[name]["stop_grace_period"]) >= 600, name


def test_the_server_logs_each_request_to_stdout_in_the_image_and_compose():
    """Found by the operations audit: `make demo` passed --access-logfile -, but the image's and
    docker-compose's gunicorn got no access log, so a production server logged no request, not
    even the path of a 500. gunicorn reads gunicorn.conf.py from its working directory."""
    import runpy

    import yaml
    from gunicorn.config import Config

    assert Config().accesslog is None  # gunicorn's own default: no access log
    assert runpy.run_path(str(ROOT / "gunicorn.conf.py"))["accesslog"] == "-"
    web = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["web"]
    arguments = web["command"].split("exec gunicorn", 1)[1].split()
    assert "--config" not in arguments and "-c" not in arguments  # it reads gunicorn.conf.py


def test_an_installed_package_carries_the_data_files_its_code_reads(tmp_path):
    """Found by review: the wheel `pip install .` builds held only .py files, so an installed
    `synapse-client` (a client organization's machine) had no routing/default_params.json and,
    for a global whose head carries no fitted weights (one fitted on the client, a global
    published without a probe set), ranked with RoutingParams' built-in weights instead of the
    file the server routes with, silently."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    tracked = subprocess.run(
        ["git", "ls-files", "pyproject.toml", "README.md", "synapse_web", "compendium", "routing",
         "federation", "workers"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    for name in tracked:  # a copy: building in the checkout would leave build/ and egg-info there
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         str(source), "-w", str(tmp_path / "wheel")],
        check=True, capture_output=True, text=True,
    )
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    data = [name for name in tracked if "/" in name and not name.endswith(".py")]
    assert "routing/default_params.json" in data
    assert [name for name in data if name not in packaged] == []
