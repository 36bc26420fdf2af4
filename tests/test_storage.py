"""Compendium versions stored in PostgreSQL, and vectors found back through pgvector."""

from __future__ import annotations

import numpy as np
import pytest
from django.db import connection, transaction

from compendium.canonical import canonical_bytes
from compendium.models import CompendiumVersion, ScenarioEntry, StatEntry
from compendium.schema import Compendium, Scenario
from compendium.services import (
    current_schema,
    import_registry,
    load_compendium,
    nearest_scenarios,
    store_compendium,
)
from compendium.validation import load_valid_compendium
from federation.models import Client, Organization, Round

pytestmark = pytest.mark.django_db


@pytest.fixture
def stored_registry(small_schema):
    import_registry(small_schema.tools)
    return current_schema()


@pytest.fixture
def round1():
    return Round.objects.create(number=1)


def test_database_is_postgresql_with_pgvector():
    with connection.cursor() as cursor:
        cursor.execute("SELECT extversion FROM pg_extension WHERE extname = 'vector'")
        assert cursor.fetchone() is not None
    assert connection.vendor == "postgresql"


def test_current_schema_reflects_registry_and_declared_fields(stored_registry):
    assert stored_registry.tool_ids == {"weather", "flights", "calculator"}
    assert {"calls", "success_rate", "frequency", "latency_ms"} <= set(stored_registry.fields_by_name)


def test_client_submission_round_trip(stored_registry, valid_doc, round1):
    org = Organization.objects.create(name="Acme", slug="acme")
    client = Client.objects.create(organization=org, name="c1")
    valid_doc["metadata"][0]["stats"].update({"calls": 12, "success_rate": 0.9, "latency_ms": 320})
    valid_doc["metadata"][1]["stats"]["calls"] = 3
    compendium = load_valid_compendium(valid_doc, stored_registry)
    version = store_compendium(compendium, kind="client", round=round1, client=client)
    version.refresh_from_db()
    assert canonical_bytes(load_compendium(version)) == canonical_bytes(compendium)
    assert version.size_bytes == len(canonical_bytes(compendium))
    assert version.entry_counts["scenarios"] == 2
    assert StatEntry.objects.filter(version=version).count() == 4
    assert ScenarioEntry.objects.filter(version=version, tool__tool_id="weather").count() == 1


def test_owner_must_match_kind(stored_registry, round1):
    from django.db import IntegrityError

    with pytest.raises(IntegrityError):
        store_compendium(Compendium(), kind="client", round=round1)


def test_embeddings_found_back_in_cosine_order(stored_registry, round1):
    rng = np.random.default_rng(0)
    dim = ScenarioEntry._meta.get_field("embedding").dimensions
    vectors = rng.normal(size=(40, dim)).astype(np.float32)
    compendium = Compendium(
        scenarios=[Scenario(tool_id="weather", text=f"scenario {i}") for i in range(40)]
    )
    version = store_compendium(compendium, kind="global", round=round1, scenario_embeddings=vectors)
    query = rng.normal(size=dim).astype(np.float32)

    found = nearest_scenarios(version, query, k=5)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit @ (query / np.linalg.norm(query))
    expected = [f"scenario {i}" for i in np.argsort(-cosine)[:5]]
    assert [s.text for s in found] == expected
    assert np.allclose([1 - s.distance for s in found], np.sort(cosine)[::-1][:5], atol=1e-5)
    # From the HNSW index: approximate (dead entries left by other tests' rolled-back rows can
    # even crowd this version out), but only this version's rows, with true distances.
    approximate = nearest_scenarios(version, query, k=5, exact=False)
    assert len(approximate) <= 5
    for row in approximate:
        assert row.version_id == version.pk
        index = int(row.text.split()[1])
        assert abs((1 - row.distance) - cosine[index]) < 1e-5


def test_embeddings_of_another_dimension_are_refused_before_anything_is_stored(
    stored_registry, round1
):
    from django.core.exceptions import ImproperlyConfigured

    dim = ScenarioEntry._meta.get_field("embedding").dimensions
    compendium = Compendium(scenarios=[Scenario(tool_id="weather", text="rain in Oslo")])
    wrong = np.ones((1, dim * 2), dtype=np.float32)  # e.g. a 768-dimensional model on a 384 column
    with pytest.raises(ImproperlyConfigured, match=f"{dim * 2}-dimensional.*stores {dim}"):
        with transaction.atomic():  # the caller's transaction, as in the merge pipeline
            store_compendium(compendium, kind="global", round=round1, scenario_embeddings=wrong)
    assert not CompendiumVersion.objects.exists()
    assert not ScenarioEntry.objects.exists()


def test_hnsw_index_exists():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname IN "
            "('scenario_embedding_hnsw', 'precaution_embedding_hnsw')"
        )
        defs = [row[0] for row in cursor.fetchall()]
    assert len(defs) == 2 and all("hnsw" in d and "vector_cosine_ops" in d for d in defs)


def test_global_kind_versions_listed_per_round(stored_registry, round1):
    store_compendium(Compendium(), kind="global", round=round1)
    assert CompendiumVersion.objects.filter(kind="global", round=round1).count() == 1


def test_deleting_client_versions_cascades_as_the_orm_would(stored_registry, valid_doc, round1):
    from compendium.models import AnnexEntry, PrecautionEntry, TemplateEntry
    from compendium.services import delete_client_versions
    from federation.models import Submission

    org = Organization.objects.create(name="Acme", slug="acme")
    client, other = (Client.objects.create(organization=org, name=n) for n in ("c1", "c2"))
    valid_doc["metadata"][0]["stats"]["calls"] = 12  # a statistic, to cascade
    compendium = load_valid_compendium(valid_doc, stored_registry)
    # With entry rows and a source link both ways: everything hanging on the version goes.
    gone = store_compendium(compendium, kind="client", round=round1, client=client)
    kept = store_compendium(compendium, kind="client", round=round1, client=other)
    edge = store_compendium(compendium, kind="edge", round=round1, organization=org, sources=[gone, kept])
    gone.sources.add(kept)
    submission = Submission.objects.create(
        client=client, round=round1, idempotency_key="k", request_sha256="x", version=gone, response={}
    )
    later_round = Round.objects.create(number=2, state=Round.State.PUBLISHED)
    assert delete_client_versions(round_id=later_round.pk, client_id=client.pk) == 0
    assert delete_client_versions(round_id=round1.pk, client_id=client.pk) == 1

    assert not CompendiumVersion.objects.filter(pk=gone.pk).exists()
    for model in (ScenarioEntry, PrecautionEntry, TemplateEntry, StatEntry, AnnexEntry):
        assert not model.objects.filter(version_id=gone.pk).exists()
        assert model.objects.filter(version=kept).exists()
    submission.refresh_from_db()
    assert submission.version is None
    assert list(edge.sources.all()) == [kept]
    assert not kept.derived.filter(pk=gone.pk).exists()
    assert CompendiumVersion.objects.filter(pk__in=[kept.pk, edge.pk]).count() == 2


def test_every_model_change_has_its_migration():
    """A model changed without its migration (a field, its default, its help text) leaves the
    database behind the code: `makemigrations --check` finds nothing to write."""
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exit_:
        pytest.fail(f"models changed without a migration (exit {exit_.code}):\n{out.getvalue()}")
