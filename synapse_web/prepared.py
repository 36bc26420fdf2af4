"""A cursor for the request hot paths whose statements PostgreSQL plans once per connection.

Django's PostgreSQL backend binds parameters on the client (psycopg's ClientCursor): every
statement reaches the server as new text and is parsed and planned again. For the submission
path, planning cost PostgreSQL more than running the statements (0.5-0.7 ms of planning against
0.1-0.3 ms of execution for the largest ones). This cursor binds on the server instead
(psycopg's Cursor), and psycopg prepares a statement the fifth time a connection runs it
(`prepare_threshold`, set in the settings; Django leaves it off, and its own cursors bind on the
client and never prepare); the server reuses the plan from then on. It goes through Django's cursor wrapper: the same transaction,
error translation, execute wrappers and query logging. `SYNAPSE_DB_PREPARE=0` turns preparing off
(for a connection pooler in transaction mode that does not track prepared statements); the
parameters are still bound on the server.

Write the SQL for it with constants inlined where a partial index or a constant filter should be
used (a prepared plan may be generic) and `%s` / `%(name)s` placeholders for the rest.
"""

from __future__ import annotations

from django.db import connection


def prepared_cursor():
    """A Django cursor (use it as a context manager) whose statements are bound on the server and
    prepared there once the connection has run them a few times."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.close_if_health_check_failed()
    connection.ensure_connection()
    with connection.wrap_database_errors:
        cursor = ServerBindingCursor(connection.connection)
    return connection._prepare_cursor(cursor)
