"""The embedded default database: real PostgreSQL 16 with pgvector, shipped by the PyPI package
`pgserver`, running from a data folder of the project.

It is started on first use and left running (so that the web server, workers, tests and management
commands share one server); `python manage.py embedded_db stop` stops it.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

DB_NAME = "synapse"


def _server(data_dir: Path):
    """pgserver's handle on the data folder's server (under `_start_lock`, which makes the
    folder's parent)."""
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    import pgserver  # imported lazily: only the embedded default needs it

    return pgserver.get_server(data_dir, cleanup_mode=None)


@contextmanager
def _start_lock(data_dir: Path):
    """One process at a time creates and starts the server of a data folder: two commands started
    together on a new checkout (two `simulate` runs, a server and a worker) both ran initdb on
    the same folder, and one failed with FileExistsError."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(data_dir.parent / f".{data_dir.name}.start-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_embedded_database(data_dir: Path, conn_max_age: int = 60) -> dict:
    """Start (if needed) the embedded server and return Django DATABASES settings for it
    (`conn_max_age`: SYNAPSE_CONN_MAX_AGE, which the settings read and check)."""
    data_dir = Path(data_dir).resolve()
    marker = data_dir / ".synapse_db_created"
    with _start_lock(data_dir):
        server = _server(data_dir)
        if not marker.exists():
            exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}';")
            if "1 row" not in exists:
                server.psql(f"CREATE DATABASE {DB_NAME};")
            # The test database is created from template1; pgvector goes there too so that
            # every database of this server can hold vectors.
            server.psql("\\c template1\nCREATE EXTENSION IF NOT EXISTS vector;")
            marker.touch()
        _keep_socket_private(server, data_dir)
    # Where the server put its socket: the data folder, or, when that path would be too long
    # for a Unix socket (a checkout deeper than about 80 characters), a runtime folder.
    return _settings(_socket_dir(server, data_dir), conn_max_age)


def _keep_socket_private(server, data_dir: Path) -> None:
    """Make the server's socket its owner's alone (and root's), restarting it once to do so.

    The server trusts every local connection (pgserver's initdb), as superuser, and PostgreSQL
    makes its socket 0777. In the data folder (0700) only its owner reaches it; but where the
    folder's path is too long for a socket, pgserver puts it in a runtime folder that any local
    user can enter (as root, one it makes 0777), so anyone on the machine could read and change
    the federation's data, or run programs as the server's user. `unix_socket_permissions` is
    read at start only."""
    socket = server.get_postmaster_info().socket_path
    if socket is None or not socket.stat().st_mode & 0o077:
        return
    server.psql("ALTER SYSTEM SET unix_socket_permissions = '0700';")
    stop_embedded_database(data_dir)
    server.ensure_postgres_running()  # as pgserver started it: same socket folder, same options


def embedded_database_settings(data_dir: Path, conn_max_age: int = 60) -> dict:
    """Django DATABASES settings for the embedded server, without starting it: for
    `manage.py embedded_db`, which looks at the server (status, stop) and must not start it."""
    return _settings(Path(data_dir).resolve(), conn_max_age)


def _settings(host: Path, conn_max_age: int) -> dict:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DB_NAME,
        "USER": "postgres",
        "PASSWORD": "",
        "HOST": str(host),
        "PORT": "",
        "CONN_MAX_AGE": conn_max_age,
        "CONN_HEALTH_CHECKS": True,
    }


def _socket_dir(server, data_dir: Path) -> Path:
    info = server.get_postmaster_info()
    return Path(info.socket_dir) if info is not None and info.socket_dir else data_dir


def embedded_database_pid(data_dir: Path) -> int | None:
    """The process id of the embedded server running from `data_dir`, or None: no pid file, or
    one a server killed left behind (its process gone)."""
    try:
        pid = int(((Path(data_dir).resolve() / "postmaster.pid").read_text().splitlines() or [""])[0])
        os.kill(pid, 0)
    except (OSError, ValueError):  # no file, no such process, not ours, not a pid
        return None
    return pid


def stop_embedded_database(data_dir: Path, wait_seconds: float = 60.0) -> bool:
    """Fast shutdown of the embedded server (SIGINT to the postmaster), waited for (at most
    `wait_seconds`) so that a command right after it starts a new server instead of finding the
    old one shutting down. False if none was running."""
    pid = embedded_database_pid(data_dir)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGINT)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + wait_seconds
    while embedded_database_pid(data_dir) == pid and time.monotonic() < deadline:
        time.sleep(0.05)
    return True
