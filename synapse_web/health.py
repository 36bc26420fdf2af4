"""What /healthz answers a load balancer or the compose healthcheck: whether this server can serve.

One query a probe: the migrations recorded in the database, which also proves the database answers.
A server whose code has migrations the database has not applied (a new release started before
`manage.py migrate` ran, or after it failed) is not ready: its queries would fail on missing
tables or columns, each request a 500. Migrations the database has and this code does not (a
newer release migrated while this one still serves) are no reason to take it out.
"""

from __future__ import annotations

from functools import cache

from django.db import DatabaseError, connection
from django.db.migrations.loader import MigrationLoader


@cache
def _migrations_of_this_code() -> frozenset[tuple[str, str]]:
    """Every migration this code holds, as (app, name): read from the files once a process."""
    return frozenset(MigrationLoader(None, ignore_no_migrations=True).graph.nodes)


def readiness() -> tuple[int, dict[str, str]]:
    """(HTTP status, body): 200 when the database answers and has every migration of this code
    applied, else 503 naming what is wrong (an error's class, never its text: no host, user or
    table name for an anonymous caller)."""
    expected = _migrations_of_this_code()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT app, name FROM django_migrations")
            applied = set(cursor.fetchall())
    except DatabaseError as exc:
        return 503, {"status": "unavailable", "database": type(exc).__name__}
    if expected - applied:
        return 503, {"status": "unavailable", "database": "ok", "migrations": "pending"}
    return 200, {"status": "ok", "database": "ok", "migrations": "ok"}
