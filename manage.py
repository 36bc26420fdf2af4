#!/usr/bin/env python
"""Django's command-line utility for SYNAPSE."""

import os
import sys


def main():
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "synapse_web.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import OperationalError, connections

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


if __name__ == "__main__":
    main()
