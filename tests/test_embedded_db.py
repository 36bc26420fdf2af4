"""The embedded default database (pgserver): started from a data folder of the project."""

from __future__ import annotations

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
