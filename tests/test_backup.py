"""Backing the database up and restoring it into a new one (manage.py backup_db / restore_db)."""

from __future__ import annotations

import os

import numpy as np
import psycopg
import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from compendium.models import CompendiumVersion, ScenarioEntry, Tool
from federation.models import Organization, Round

DIM = settings.SYNAPSE_EMBEDDING_DIM


def _connect(database: dict, name: str) -> psycopg.Connection:
    return psycopg.connect(host=database["HOST"], port=database["PORT"] or None,
                           user=database["USER"], password=database["PASSWORD"] or None,
                           dbname=name, autocommit=True)


@pytest.mark.django_db(transaction=True)
def test_a_backup_restored_into_a_new_database_holds_the_federation_and_its_vectors(tmp_path):
    """Found by the operations audit: nothing said how to back up or restore the federation's
    database (the embedded one's server is in .data/pgdata, with pg_dump in pgserver's folder,
    and the machine's own pg_dump of another major version refuses it)."""
    rng = np.random.default_rng(0)
    tool = Tool.objects.create(tool_id="search", description="web search")
    Organization.objects.create(name="Org A", slug="org-a")
    rnd = Round.objects.create(number=1, state=Round.State.PUBLISHED)
    version = CompendiumVersion.objects.create(
        kind=CompendiumVersion.Kind.GLOBAL, round=rnd, schema_version="1", content={"M": []},
        sha256="a" * 64, size_bytes=10, gzip_bytes=10)
    vectors = rng.standard_normal((3, DIM)).astype(np.float32)
    for i, vector in enumerate(vectors):
        ScenarioEntry.objects.create(version=version, tool=tool, text=f"scenario {i}", embedding=vector)
    ScenarioEntry.objects.create(version=version, tool=tool, text="no vector", embedding=None)

    dump = tmp_path / "synapse.dump"
    call_command("backup_db", str(dump))
    assert dump.stat().st_mode & 0o777 == 0o600  # every password hash and submission is in it
    with pytest.raises(CommandError, match="exists: name a new file"):
        call_command("backup_db", str(dump))

    with pytest.raises(CommandError, match="is not empty"):  # this one holds the federation
        call_command("restore_db", str(dump))

    database = settings.DATABASES["default"]
    restored = f"restored_{os.getpid()}"
    with connection.cursor() as cursor:
        # template0: a new database as an external server makes it, without the vector extension
        cursor.execute(f"CREATE DATABASE {restored} TEMPLATE template0")
    try:
        from synapse_web.backup import BackupError, restore

        restore({**database, "NAME": restored}, dump)
        with _connect(database, restored) as conn:
            rows = conn.execute("SELECT text, embedding::text FROM compendium_scenarioentry "
                                "ORDER BY text").fetchall()
            assert [text for text, _ in rows] == ["no vector", "scenario 0", "scenario 1", "scenario 2"]
            assert rows[0][1] is None
            for (_, text), vector in zip(rows[1:], vectors, strict=True):
                assert np.array_equal(np.array(text.strip("[]").split(","), dtype=np.float32), vector)
            indexes = {name for (name,) in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'compendium_scenarioentry'")}
            assert "scenario_embedding_hnsw" in indexes
            conn.execute("SET enable_seqscan = off")  # the nearest neighbour through that index
            nearest = conn.execute(
                "SELECT text FROM compendium_scenarioentry WHERE embedding IS NOT NULL "
                "ORDER BY embedding <=> %s::vector LIMIT 1",
                ["[" + ",".join(map(str, vectors[1].tolist())) + "]"]).fetchone()[0]
            assert nearest == "scenario 1"
            assert conn.execute("SELECT slug FROM federation_organization").fetchall() == [("org-a",)]
            assert conn.execute("SELECT number, state FROM federation_round").fetchall() == [
                (1, "published")]
            with connection.cursor() as cursor:
                cursor.execute("SELECT app, name FROM django_migrations ORDER BY app, name")
                assert conn.execute("SELECT app, name FROM django_migrations "
                                    "ORDER BY app, name").fetchall() == cursor.fetchall()
        # a second restore would mix two federations: refused, naming why
        with pytest.raises(BackupError, match=f"database '{restored}' is not empty"):
            restore({**database, "NAME": restored}, dump)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {restored} WITH (FORCE)")
