#!/usr/bin/env python
"""Django's command-line utility for SYNAPSE."""

import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import OperationalError, ProgrammingError, connections

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # Configuration problems (no pgvector, missing secret...) are one line, not a traceback.
        print(f"synapse: {exc}", file=sys.stderr)
        sys.exit(2)
    except OperationalError as exc:
        if any(connections[alias].connection is not None for alias in connections):
            raise  # a statement failed on a connection that was made: not the configuration
        # No connection could be made (a DATABASE_URL naming the wrong host or port, a wrong
        # password, the server down): psycopg's reason in one line, which names no password.
        where = "the database DATABASE_URL names" if os.environ.get("DATABASE_URL") else (
            "the embedded database"
        )
        print(f"synapse: cannot connect to {where}: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
    except ProgrammingError:
        # A command run on a database that was never migrated (or is behind the code) failed on
        # a missing table with a traceback: say what to run instead.
        if sys.argv[1:2] == ["migrate"]:
            raise  # a migration that failed: its own error, not "run migrate"
        pending = _unapplied_migrations()
        if not pending:
            raise
        print(
            f"synapse: the database is not migrated ({pending} migration"
            f"{'s' if pending != 1 else ''} not applied): run `python manage.py migrate` first",
            file=sys.stderr,
        )
        sys.exit(2)


def _unapplied_migrations() -> int:
    """How many of the code's migrations the database lacks; 0 when that cannot be told."""
    from django.db import DatabaseError, connections
    from django.db.migrations.executor import MigrationExecutor

    try:
        connections["default"].close()  # a failed statement may have left it in a transaction
        executor = MigrationExecutor(connections["default"])
        return len(executor.migration_plan(executor.loader.graph.leaf_nodes()))
    except DatabaseError:
        return 0


if __name__ == "__main__":
    main()
