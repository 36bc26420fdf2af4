"""The embedded default database (pgserver): started from a data folder of the project."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from synapse_web.embedded_db import ensure_embedded_database, stop_embedded_database

pytestmark = pytest.mark.slow


def test_a_data_folder_too_deep_for_a_unix_socket_still_connects(tmp_path):
    """A checkout deeper than about 80 characters: the server puts its socket in a runtime folder
    (a socket path holds at most 107 bytes), and the settings named the data folder, so Django
    failed with 'Unix-domain socket path ... is too long' for `make demo` and `make test`."""
    import psycopg

    data_dir = tmp_path / ("deep-" * 20) / "pgdata"
    assert len(str(data_dir / ".s.PGSQL.5432")) > 107
    try:
        settings = ensure_embedded_database(data_dir)
        assert settings["HOST"] != str(data_dir.resolve())
        with psycopg.connect(host=settings["HOST"], dbname=settings["NAME"],
                             user=settings["USER"]) as connection:
            assert connection.execute("SELECT 1").fetchone() == (1,)
    finally:
        stop_embedded_database(data_dir)


_START_TOGETHER = """
import pathlib, sys, time
from pathlib import Path
from synapse_web.embedded_db import ensure_embedded_database

# pgserver checks that the folder is missing, then makes it: the delay widens that window to what
# a loaded machine gives it, so that the race shows every time rather than now and then.
real_mkdir = pathlib.Path.mkdir
def slow_mkdir(self, *args, **kwargs):
    if self.name == "pgdata":
        time.sleep(0.5)
    return real_mkdir(self, *args, **kwargs)
pathlib.Path.mkdir = slow_mkdir

time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
print(ensure_embedded_database(Path(sys.argv[1]))["NAME"])
"""


def test_commands_started_together_on_a_new_folder_share_one_server(tmp_path):
    """Two `simulate` runs started at once on a new checkout both ran initdb on the same data
    folder, and the second failed with FileExistsError; now the first creates and starts the
    server while the others wait for it, and all of them connect to it."""
    import subprocess
    import sys
    import time

    import psycopg

    data_dir = tmp_path / "pgdata"
    go = time.time() + 3.0  # every process past its imports before any of them starts the server
    runs = [subprocess.Popen([sys.executable, "-c", _START_TOGETHER, str(data_dir), str(go)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(3)]
    try:
        outcomes = [run.communicate(timeout=180) for run in runs]
        for run, (out, err) in zip(runs, outcomes, strict=True):
            assert run.returncode == 0, err
            assert out.strip() == "synapse"
        settings = ensure_embedded_database(data_dir)
        with psycopg.connect(host=settings["HOST"], dbname="template1",
                             user=settings["USER"]) as connection:
            assert connection.execute(
                "SELECT count(*) FROM pg_extension WHERE extname = 'vector'").fetchone() == (1,)
    finally:
        stop_embedded_database(data_dir)


def test_embedded_db_status_and_stop_look_at_the_server_without_starting_it(tmp_path):
    """`manage.py embedded_db status` always said "running" and `stop` always "stopped": the
    settings the command loads started the server first (on a new data folder, initdb too), so
    a stopped server was started to be reported or stopped, and "no embedded PostgreSQL is
    running" could never be said."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {name: value for name, value in os.environ.items() if name != "DATABASE_URL"}
    env["SYNAPSE_DATA_DIR"] = str(tmp_path)

    def embedded_db(action):
        return subprocess.run([sys.executable, "manage.py", "embedded_db", action], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)

    status = embedded_db("status")
    assert status.returncode == 0, status.stderr
    assert status.stdout.strip() == f"embedded PostgreSQL in {tmp_path / 'pgdata'}: stopped"
    stop = embedded_db("stop")
    assert stop.returncode == 1
    assert stop.stderr.strip() == f"CommandError: no embedded PostgreSQL is running in {tmp_path / 'pgdata'}"
    assert not (tmp_path / "pgdata").exists()  # nothing started, nothing made

    data_dir = tmp_path / "pgdata"
    try:
        ensure_embedded_database(data_dir)
        assert embedded_db("status").stdout.strip().endswith(": running")
        # a stale pid file (the server killed, its pid file left) is a stopped server
        pid_file = data_dir / "postmaster.pid"
        lines = pid_file.read_text().splitlines()
        # stopped when it returns, not stopping: a command right after it started nothing new
        # while the old server was still shutting down (and failed to connect to it)
        assert stop_embedded_database(data_dir)
        assert not pid_file.exists()
        pid_file.write_text("\n".join(["999999999", *lines[1:]]) + "\n")
        assert embedded_db("status").stdout.strip().endswith(": stopped")
        assert embedded_db("stop").returncode == 1
    finally:
        stop_embedded_database(data_dir)


def test_the_servers_socket_is_its_owners_alone_even_outside_the_data_folder(tmp_path):
    """The server trusts every local connection as superuser. A data folder too deep for a
    socket put it in a runtime folder pgserver makes 0777 as root, and PostgreSQL makes the socket
    itself 0777: any user of the machine could connect, read and change the federation's data.
    The socket is now 0700 (root, as whom pgserver runs the server as another user, still
    connects), and stays so when another process starts the stopped server."""
    import subprocess
    import sys

    import psycopg

    data_dir = tmp_path / ("deep-" * 20) / "pgdata"
    start = ("import sys; from pathlib import Path; from synapse_web.embedded_db import "
             "ensure_embedded_database; print(ensure_embedded_database(Path(sys.argv[1]))['HOST'])")
    try:
        hosts = [ensure_embedded_database(data_dir)["HOST"]]
        stop_embedded_database(data_dir)
        hosts.append(subprocess.run([sys.executable, "-c", start, str(data_dir)], check=True,
                                    capture_output=True, text=True).stdout.strip())
        assert hosts[0] == hosts[1]
        [socket] = Path(hosts[1]).glob(".s.PGSQL.*[0-9]")
        assert stat.S_IMODE(socket.stat().st_mode) == 0o700
        with psycopg.connect(host=hosts[1], dbname="synapse", user="postgres") as connection:
            assert connection.execute("SHOW unix_socket_permissions").fetchone() == ("0700",)
    finally:
        stop_embedded_database(data_dir)
