"""Stop early, in one line, when the configured PostgreSQL cannot hold vectors."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.db.backends.signals import connection_created

_checked: set[str] = set()

FIX = (
    "install the pgvector extension on that server (https://github.com/pgvector/pgvector, "
    "or use the pgvector/pgvector Docker image), or unset DATABASE_URL to use the embedded "
    "PostgreSQL + pgvector"
)


def require_pgvector(sender, connection, **kwargs) -> None:
    if connection.vendor != "postgresql" or connection.alias in _checked:
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
        available = cursor.fetchone() is not None
    if not available:
        host = connection.settings_dict.get("HOST") or "localhost"
        port = connection.settings_dict.get("PORT") or "5432"
        raise ImproperlyConfigured(
            f"the database at {host}:{port} has no pgvector extension; {FIX}"
        )
    _checked.add(connection.alias)


def connect() -> None:
    connection_created.connect(require_pgvector, dispatch_uid="synapse-require-pgvector")
