"""Backing up the database to one file and restoring it into an empty database, with PostgreSQL's
own `pg_dump` and `pg_restore` (custom format: tables, pgvector columns and their HNSW indexes,
sequences, the `vector` extension).

The embedded server's programs come with it (the `pgserver` package's `pginstall/bin`); for an
external server (DATABASE_URL) the ones on PATH are used, else the embedded ones (PostgreSQL 16:
`pg_dump` reads servers up to its own major version). The password travels in PGPASSWORD, never
on a command line that `ps` shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import psycopg


class BackupError(Exception):
    """A backup or restore that could not be made, in one line saying why."""


def _bundled(name: str) -> str | None:
    try:
        from pgserver._commands import POSTGRES_BIN_PATH
    except ImportError:
        return None
    program = Path(POSTGRES_BIN_PATH) / name
    return str(program) if program.is_file() else None


def pg_program(name: str) -> str:
    """The path of PostgreSQL's program `name` (pg_dump, pg_restore): the embedded server's own
    when DATABASE_URL is unset (one of another major version on PATH refuses it); for an
    external server the one on PATH (of the server's version or later), else the embedded one's."""
    embedded = not os.environ.get("DATABASE_URL")
    found = (_bundled(name) or shutil.which(name)) if embedded else (shutil.which(name) or _bundled(name))
    if found:
        return found
    raise BackupError(f"{name} not found: install PostgreSQL's client programs (postgresql-client)")


def _environment(database: dict) -> dict[str, str]:
    """libpq's variables for Django's `database` settings (HOST may be a socket folder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    for variable, key in (("PGHOST", "HOST"), ("PGPORT", "PORT"), ("PGUSER", "USER"),
                          ("PGPASSWORD", "PASSWORD"), ("PGDATABASE", "NAME")):
        if database.get(key):
            env[variable] = str(database[key])
    return env


def _run(command: list[str], database: dict, what: str) -> None:
    proc = subprocess.run(command, env=_environment(database), capture_output=True, text=True)
    if proc.returncode != 0:
        said = " ".join(proc.stderr.split()) or f"exit status {proc.returncode}"
        raise BackupError(f"{what} failed: {said}")


def backup(database: dict, path: Path) -> int:
    """Write the whole of `database` to the new file `path` (pg_dump's custom format), readable
    by its owner only (it holds every login's password hash and every client's submissions); its
    size in bytes. A file already there is never overwritten; a failed backup leaves none."""
    path = Path(path)
    program = pg_program("pg_dump")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        raise BackupError(f"{path} exists: name a new file (a backup is never overwritten)") from None
    except OSError as exc:
        raise BackupError(f"{path} cannot be written: {exc.strerror or exc}") from None
    try:
        _run([program, "--format=custom", "--file", str(path)], database, "pg_dump")
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _tables(database: dict) -> int:
    env = _environment(database)
    params = {k: env[v] for k, v in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"),
                                     ("password", "PGPASSWORD"), ("dbname", "PGDATABASE"))
              if v in env}
    with psycopg.connect(**params, connect_timeout=10) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')"
        ).fetchone()[0]


def restore(database: dict, path: Path) -> None:
    """Restore a backup into `database`, which must hold no table (a new database: restoring over
    a federation's tables would mix two of them). One transaction: a failure leaves it empty."""
    path = Path(path)
    if not path.is_file():
        raise BackupError(f"{path}: no such file")
    tables = _tables(database)
    if tables:
        raise BackupError(
            f"database {database.get('NAME')!r} is not empty ({tables} tables): restore into a new "
            "database (createdb, a new DATABASE_URL, or a new SYNAPSE_DATA_DIR for the embedded one)"
        )
    _run([pg_program("pg_restore"), "--no-owner", "--no-privileges", "--exit-on-error",
          "--single-transaction", "--dbname", str(database.get("NAME")), str(path)],
         database, "pg_restore")
