"""`manage.py erase_client --vacuum`: after the erasure commits, VACUUM FULL of the tables an
erasure deletes from (`federation.pipeline.ERASURE_TABLES`), so that the erased rows' bytes leave
PostgreSQL's table files. Read from the files themselves, on the real embedded PostgreSQL, outside
a test transaction (VACUUM cannot run in one)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, connections

from compendium.models import CompendiumVersion
from federation.models import Client
from federation.pipeline import ERASURE_TABLES, VacuumFailed, vacuum_erased_tables
from tests.merge_helpers import build_federation
from tests.merge_helpers import close_round as close

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ERASED = "17 multiplied"  # a2's scenario "What is 17 multiplied by 23?"
ROLE = "synapse_vacuum_test"


def _relation_files(table: str) -> list[Path]:
    """The main-fork files (every 1 GB segment) of `table`, of its TOAST table and of the
    indexes of both."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW data_directory")
        root = Path(cursor.fetchone()[0])
        cursor.execute(
            """WITH rel AS (
                   SELECT oid FROM pg_class WHERE oid = %s::regclass
                   UNION SELECT reltoastrelid FROM pg_class WHERE oid = %s::regclass AND reltoastrelid <> 0)
               SELECT pg_relation_filepath(oid) FROM rel
               UNION SELECT pg_relation_filepath(indexrelid) FROM pg_index
               WHERE indrelid IN (SELECT oid FROM rel)""",
            [table, table],
        )
        paths = [root / row[0] for row in cursor.fetchall() if row[0]]
    return [f for p in paths for f in [p, *p.parent.glob(p.name + ".*")] if f.is_file()]


def _tables_holding(needle: str) -> list[str]:
    data = needle.encode("utf-8")
    return [table for table in ERASURE_TABLES
            if any(data in f.read_bytes() for f in _relation_files(table))]


def _checkpoint() -> None:
    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")


def test_erase_client_vacuum_removes_the_erased_text_from_the_table_files(
    probes, django_capture_on_commit_callbacks
):
    round_, _ = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    assert round_.state == "published", round_.failure_reason
    _checkpoint()  # the pages are written to the files
    assert "compendium_scenarioentry" in _tables_holding(ERASED)  # live rows

    # Without --vacuum: the rows are deleted, their bytes stay in the files (dead rows).
    out = io.StringIO()
    call_command("erase_client", "acme/a2", stdout=out)
    assert "VACUUM" not in out.getvalue()
    assert not any(ERASED in str(v.content) for v in CompendiumVersion.objects.all())
    _checkpoint()
    held = _tables_holding(ERASED)
    assert "compendium_scenarioentry" in held, held

    # With it: the tables are rewritten, the text is in none of their files.
    out = io.StringIO()
    call_command("erase_client", "acme/a2", "--vacuum", stdout=out)
    lines = out.getvalue().splitlines()
    assert any("exclusive lock" in line and "routing API" in line for line in lines), lines
    assert [m.group(1) for line in lines if (m := re.match(r"vacuumed (\S+) in [\d.]+ s$", line))] \
        == list(ERASURE_TABLES)
    assert lines[-1].startswith(f"vacuumed {len(ERASURE_TABLES)} table(s) in ")
    assert lines[-1].endswith("; checkpoint done")
    assert _tables_holding(ERASED) == []
    # What the erasure kept is still there.
    glob = CompendiumVersion.objects.get(kind="global", round=round_)
    assert glob.content["scenarios"] and glob.routing_head


def test_a_vacuum_that_fails_leaves_the_erasure_standing_and_names_the_tables_not_vacuumed(
    probes, django_capture_on_commit_callbacks
):
    """A lock another transaction holds (here: a reader of the submissions table) makes the
    VACUUM FULL of that table give up after --lock-timeout: one line, exit non-zero, the erasure
    committed, the tables from that one on named as not vacuumed."""
    round_, clients = build_federation()
    close(round_, django_capture_on_commit_callbacks)
    other = connections.create_connection("default")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("LOCK TABLE federation_submission IN ACCESS SHARE MODE")
        with pytest.raises(CommandError) as failed:
            call_command("erase_client", "acme/a2", "--vacuum", "--lock-timeout", "0.3",
                         stdout=io.StringIO())
    finally:
        other.rollback()
        other.close()
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("the erasure of ") and "stands (committed)" in message
    assert "VACUUM FULL federation_submission failed: canceling statement due to lock timeout" in message
    rest = list(ERASURE_TABLES[ERASURE_TABLES.index("federation_submission"):])
    assert f"not vacuumed: {', '.join(rest)} (" in message
    assert not CompendiumVersion.objects.filter(kind="client", client=clients[("acme", "a2")]).exists()
    with connection.cursor() as cursor:  # the session's lock_timeout is put back
        cursor.execute("SHOW lock_timeout")
        assert cursor.fetchone()[0] == "0"


@pytest.fixture
def role():
    """A role that is not a superuser, made the connection's current role by the test."""
    with connection.cursor() as cursor:
        cursor.execute(f"DROP ROLE IF EXISTS {ROLE}")
        cursor.execute(f"CREATE ROLE {ROLE} NOLOGIN")
    yield ROLE
    with connection.cursor() as cursor:
        cursor.execute("RESET ROLE")
        cursor.execute(f"DROP ROLE {ROLE}")


def test_tables_the_role_may_not_vacuum_are_reported_not_skipped_silently(role):
    """PostgreSQL skips, with a warning only, a table the role may not vacuum."""
    with connection.cursor() as cursor:
        cursor.execute(f"SET ROLE {role}")
    with pytest.raises(VacuumFailed) as failed:
        vacuum_erased_tables()
    assert failed.value.table == ERASURE_TABLES[0] and "not rewritten" in failed.value.reason
    assert failed.value.vacuumed == [] and failed.value.not_vacuumed == list(ERASURE_TABLES)


def test_a_role_that_may_not_checkpoint_gets_a_note_not_a_failure(role):
    """Owner of the tables (a member of the role that owns them), so it may vacuum them, but not
    a superuser nor in pg_checkpoint: CHECKPOINT is refused, and the vacuum says so."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user")
        owner = cursor.fetchone()[0]
        cursor.execute(f"GRANT {connection.ops.quote_name(owner)} TO {role}")
        cursor.execute(f"SET ROLE {role}")
    report = vacuum_erased_tables()
    assert [table for table, _ in report.vacuumed] == list(ERASURE_TABLES)
    assert report.checkpoint is not None and "\n" not in report.checkpoint
    assert "permission denied" in report.checkpoint and "next checkpoint" in report.checkpoint
    assert Client.objects.count() == 0  # the role reads what the owner may


@pytest.mark.django_db(transaction=False)
def test_readme_names_the_tables_the_vacuum_rewrites():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("(`federation.pipeline.ERASURE_TABLES`:")
    named = re.findall(r"`(\w+)`", readme[start:readme.index(";", start)])
    assert named == list(ERASURE_TABLES)


@pytest.mark.django_db(transaction=False)  # inside the test's transaction, as under atomic()
def test_vacuum_refused_before_erasing_inside_a_transaction_or_with_a_bad_lock_timeout(probes):
    _, clients = build_federation()
    for argv, says in ((["--vacuum"], "cannot run inside a transaction"),
                       (["--vacuum", "--lock-timeout", "nan"], "--lock-timeout"),
                       (["--vacuum", "--lock-timeout", "0"], "--lock-timeout")):
        with pytest.raises(CommandError, match=re.escape(says)):
            call_command("erase_client", "acme/a2", *argv, stdout=io.StringIO())
    assert CompendiumVersion.objects.filter(kind="client", client=clients[("acme", "a2")]).exists()
