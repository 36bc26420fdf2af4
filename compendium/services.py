"""Business logic of the compendium app: registry import, the schema in force, storing and reading
compendium versions, and vector search over stored entries."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, models, transaction
from django.db.models import ExpressionWrapper, F, FloatField, Value
from django.utils import timezone
from pgvector.django import CosineDistance
from pydantic import ValidationError

from compendium.canonical import canonical_form
from compendium.clipping import declaration_problem
from compendium.models import (
    EMBEDDING_DIM,
    AnnexEntry,
    CompendiumVersion,
    NumericField,
    PrecautionEntry,
    ScenarioEntry,
    StatEntry,
    TemplateEntry,
    Tool,
)
from compendium.schema import (
    DEFAULT_NUMERIC_FIELDS,
    Compendium,
    NumericFieldSpec,
    NumericKind,
    Schema,
    ToolSpec,
)
from compendium.validation import (
    TWIN_IDS,
    shown_id,
    tool_id_key,
    tool_id_problem,
    unpublishable_tools,
)


@dataclass(frozen=True)
class ImportResult:
    created: int
    updated: int
    unchanged: int
    # active tools of the registry the import did not name: left active (an import adds and
    # updates; a tool is taken out by deactivating it in the admin)
    not_named: int = 0

    @property
    def total(self) -> int:
        return self.created + self.updated + self.unchanged


class ToolIdRefused(ValueError):
    """A tool id new to the registry that may not join it (new_tool_id_problem), in words."""


class RegistryTooLarge(ValueError):
    """An import or edit that would leave more active tools than a global compendium can publish
    (an entry per tool, at most the schema's limits.metadata), in words."""


def _too_many_active(count: int) -> str | None:
    limit = Schema().limits.metadata
    if count > limit:
        return (f"the registry would hold {count} active tools; the limit is {limit} per "
                "compendium (every global publishes an entry per active tool: deactivate tools "
                "in the admin first)")
    return None


def new_tool_id_problem(tool_id: str, keys: dict[str, str] | None = None) -> str | None:
    """Why `tool_id`, not in the registry yet, may not be added to it (None when it may): it
    reads otherwise than it is stored (tool_id_problem), or as a tool id the registry holds
    (one with its tool_id_key; `keys` maps each key to a stored id, read from the database when
    None). A tool stored under a twin's id before this rule is kept, and imported again."""
    if problem := tool_id_problem(tool_id):
        return f"tool id {shown_id(tool_id)} holds {problem}"
    if keys is None:
        keys = {tool_id_key(t): t for t in Tool.objects.values_list("tool_id", flat=True)}
    twin = keys.get(tool_id_key(tool_id))
    if twin is not None and twin != tool_id:
        return (f"tool id {shown_id(tool_id)} reads as the registry's tool {shown_id(twin)} "
                f"(the two {TWIN_IDS})")
    return None


@transaction.atomic
def import_registry(tools: Iterable[ToolSpec]) -> ImportResult:
    """Create or update registry entries by tool id (idempotent). A tool id new to the registry
    that new_tool_id_problem refuses (the look-alike of a stored one) is ToolIdRefused, more active
    tools than a global can publish (with those the file leaves active) RegistryTooLarge; either
    way nothing is stored."""
    with connection.cursor() as cursor:
        # imports one after the other: of two adding twins at once, the second sees the first's
        # (select_for_update locks the rows there are, not the ones a concurrent import adds)
        cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ["compendium.import_registry"])
    existing = {t.tool_id: t for t in Tool.objects.select_for_update()}
    keys = {tool_id_key(tool_id): tool_id for tool_id in existing}
    now = timezone.now()
    created, updated, unchanged = [], [], 0
    named: set[str] = set()
    for spec in tools:
        named.add(spec.tool_id)
        if spec.tool_id not in existing:
            if problem := new_tool_id_problem(spec.tool_id, keys):
                raise ToolIdRefused(problem)
            keys.setdefault(tool_id_key(spec.tool_id), spec.tool_id)
        fields = {
            "name": spec.name,
            "description": spec.description,
            "category": spec.category,
            "spec": spec.spec,
        }
        current = existing.get(spec.tool_id)
        if current is None:
            created.append(Tool(tool_id=spec.tool_id, **fields))
        elif any(getattr(current, k) != v for k, v in fields.items()) or not current.active:
            for key, value in fields.items():
                setattr(current, key, value)
            current.active = True
            # bulk_update leaves auto_now alone; the schema's fingerprint (federation.submissions)
            # reads the latest updated_at, so a description changed here must move it
            current.updated_at = now
            updated.append(current)
        else:
            unchanged += 1
    active = sum(1 for t in existing.values() if t.active and t.tool_id not in named) + len(named)
    if problem := _too_many_active(active):  # each file under the limit, two together past it
        raise RegistryTooLarge(problem)
    Tool.objects.bulk_create(created, batch_size=500)
    if updated:
        Tool.objects.bulk_update(
            updated,
            ["name", "description", "category", "spec", "active", "updated_at"],
            batch_size=500,
        )
    not_named = sum(1 for t in existing.values() if t.active and t.tool_id not in named)
    return ImportResult(len(created), len(updated), unchanged, not_named)


def seed_default_numeric_fields() -> None:
    """Declare the default numeric fields (DEFAULT_NUMERIC_FIELDS) that are missing, leaving
    declared ones as they are: what the data migration seeded, back in a flushed database (a
    transactional test's, a simulation's scratch federation)."""
    for spec in DEFAULT_NUMERIC_FIELDS:
        NumericField.objects.get_or_create(
            name=spec.name,
            defaults={
                "kind": spec.kind.value,
                "min_value": spec.min,
                "max_value": spec.max,
                "sensitivity": spec.sensitivity,
                "unit": spec.unit,
                "description": spec.description,
            },
        )


def tool_spec(t: Tool) -> ToolSpec:
    return ToolSpec(
        tool_id=t.tool_id, name=t.name, description=t.description, category=t.category, spec=t.spec
    )


def numeric_field_spec(f: NumericField) -> NumericFieldSpec:
    return NumericFieldSpec(
        name=f.name,
        kind=NumericKind(f.kind),
        min=f.min_value,
        max=f.max_value,
        sensitivity=f.sensitivity,
        unit=f.unit,
        description=f.description,
    )


def registry_specs() -> list[ToolSpec]:
    return [tool_spec(t) for t in Tool.objects.filter(active=True).order_by("tool_id")]


def numeric_field_specs() -> list[NumericFieldSpec]:
    return [numeric_field_spec(f) for f in NumericField.objects.order_by("name")]


def schema_problem(changed: Tool | NumericField) -> str | None:
    """What would be wrong with the schema in force if `changed` (a registry row or numeric
    field, edited or new, not saved yet) replaced its stored row; None when it would load. A row
    the schema refuses would make every submission, schema download and merge fail."""
    tools = [t for t in Tool.objects.filter(active=True)
             if not (isinstance(changed, Tool) and t.pk == changed.pk)]
    fields = [f for f in NumericField.objects.all()
              if not (isinstance(changed, NumericField) and f.pk == changed.pk)]
    if isinstance(changed, Tool) and changed.active:
        tools.append(changed)
        if problem := _too_many_active(len(tools)):
            return problem
    elif isinstance(changed, NumericField):
        fields.append(changed)
    try:
        Schema(
            tools=[tool_spec(t) for t in sorted(tools, key=lambda t: t.tool_id)],
            numeric_fields=[numeric_field_spec(f) for f in sorted(fields, key=lambda f: f.name)],
        )
    except ValidationError as exc:
        return "; ".join(
            f"{e['loc'][-1] if e['loc'] else 'schema'}: {e['msg']}" for e in exc.errors()[:3]
        )
    except ValueError as exc:  # a kind NumericKind does not know
        return str(exc)
    if isinstance(changed, Tool) and changed.active:
        problems = unpublishable_tools([tool_spec(changed)])
        if problems:
            return f"{changed.tool_id}: {problems[0][1]} (every global compendium publishes it)"
    if isinstance(changed, NumericField):
        # Only the field being declared: one stored before this check must not stop the others'
        # edits (the schema in force still loads with it).
        problem = declaration_problem(numeric_field_spec(changed))
        if problem:
            return f"{changed.name}: {problem}"
    return None


def current_schema() -> Schema:
    """The schema S in force: the active registry and the declared numeric fields."""
    return Schema(tools=registry_specs(), numeric_fields=numeric_field_specs())


@transaction.atomic(savepoint=False)  # nested in a caller's transaction: all or nothing with it
def store_compendium(
    compendium: Compendium,
    *,
    kind: str,
    round,
    client=None,
    organization=None,
    sources: Sequence[CompendiumVersion] = (),
    scenario_embeddings: np.ndarray | None = None,
    precaution_embeddings: np.ndarray | None = None,
    entry_rows: bool = True,
    routing_head: bytes | None = None,
) -> CompendiumVersion:
    """Store a (validated) compendium and its entries in one transaction.

    Embeddings, when given, are row-aligned with `compendium.scenarios` / `.precautions`.
    With `entry_rows=False` only the canonical content is stored: client submissions are read
    whole by the merge, and writing a row per entry was most of a submission's cost.
    `routing_head`: a global's serialized linear head (see `federation.pipeline.routing_head`).
    Embeddings of another dimension than the database's vector columns are refused before
    anything is written (ImproperlyConfigured, naming both and the setting).
    """
    for matrix in (scenario_embeddings, precaution_embeddings):
        dim = np.shape(matrix)[-1] if matrix is not None and len(matrix) else EMBEDDING_DIM
        if dim != EMBEDDING_DIM:
            raise ImproperlyConfigured(
                f"the embedding model gives {dim}-dimensional vectors but the database stores "
                f"{EMBEDDING_DIM} (SYNAPSE_EMBEDDING_DIM): set SYNAPSE_EMBEDDING_DIM={dim} before "
                f"`migrate` on a new database, or use a {EMBEDDING_DIM}-dimensional model"
            )
    form = canonical_form(compendium)
    version = CompendiumVersion.objects.create(
        kind=kind,
        round=round,
        client=client,
        organization=organization,
        schema_version=compendium.schema_version,
        content=form.document,
        sha256=form.sha256,
        size_bytes=form.size_bytes,
        gzip_bytes=form.gzip_bytes,
        entry_counts=compendium.entry_counts(),
        routing_head=routing_head,
    )
    if sources:
        version.sources.set(sources)
    if not entry_rows:
        return version
    tool_pk = dict(
        Tool.objects.filter(tool_id__in=compendium.tools_referenced()).values_list("tool_id", "pk")
    )

    def vector(matrix: np.ndarray | None, index: int):
        return None if matrix is None else matrix[index]

    def store(model, rows: list) -> None:
        model.objects.bulk_create(rows, batch_size=1000)

    store(ScenarioEntry, [
        ScenarioEntry(
            version=version,
            tool_id=tool_pk[s.tool_id],
            text=s.text,
            preconditions=s.preconditions,
            support=s.support,
            embedding=vector(scenario_embeddings, i),
        )
        for i, s in enumerate(compendium.scenarios)
    ])
    store(PrecautionEntry, [
        PrecautionEntry(
            version=version,
            tool_id=tool_pk[p.tool_id],
            text=p.text,
            support=p.support,
            embedding=vector(precaution_embeddings, i),
        )
        for i, p in enumerate(compendium.precautions)
    ])
    store(TemplateEntry, [
        TemplateEntry(
            version=version, tool_id=tool_pk[t.tool_id], signature=t.signature, template=t.template
        )
        for t in compendium.templates
    ])
    store(StatEntry, [
        StatEntry(version=version, tool_id=tool_pk[m.tool_id], field=name, value=value)
        for m in compendium.metadata
        for name, value in m.stats.items()
    ])
    store(AnnexEntry, [
        AnnexEntry(version=version, subject=a.subject, relation=a.relation, object=a.object)
        for a in compendium.annex
    ])
    return version


def versions_delete_sql(where: str) -> str:
    """One statement deleting the compendium versions `WHERE <where>` with what the ORM's cascade
    would delete or null, built from the model's relations (a relation this does not know how to
    follow fails at import, not silently); it answers the number of versions deleted.

    The ORM's `delete()` first reads the versions and then runs a statement per relation (about
    ten queries, most of a replacing submission's CPU). Differences: no per-object signals are
    sent (the only receiver, routing's cache of the published version, is about globals)."""
    parts = [f"DELETE FROM {CompendiumVersion._meta.db_table} WHERE {where} RETURNING id"]
    for relation in CompendiumVersion._meta.related_objects:
        model, column = relation.related_model, relation.field.column
        if relation.many_to_many:
            continue  # the through table of `sources`, handled below with both directions
        if relation.related_model._meta.related_objects:
            raise NotImplementedError(f"{model.__name__} has relations of its own")
        if relation.on_delete is models.CASCADE:
            statement = f"DELETE FROM {model._meta.db_table}"
        elif relation.on_delete is models.SET_NULL:
            statement = f"UPDATE {model._meta.db_table} SET {column} = NULL"
        else:
            raise NotImplementedError(f"{model.__name__}.{relation.field.name}: {relation.on_delete}")
        parts.append(f"{statement} WHERE {column} IN (SELECT id FROM gone)")
    for field in CompendiumVersion._meta.many_to_many:
        through = field.remote_field.through._meta
        columns = [f.column for f in through.fields if f.is_relation]
        parts.append(
            f"DELETE FROM {through.db_table} WHERE "
            + " OR ".join(f"{c} IN (SELECT id FROM gone)" for c in columns)
        )
    ctes = ",\n".join([f"gone AS ({parts[0]})"] + [f"r{i} AS ({p})" for i, p in enumerate(parts[1:])])
    return f"WITH {ctes}\nSELECT count(*) FROM gone"


_DELETE_VERSIONS = versions_delete_sql("kind = %s AND round_id = %s AND client_id = %s")


def delete_client_versions(*, round_id: int, client_id: int) -> int:
    """Delete a client's compendium versions of a round (with their entries, source links, and
    the submissions' references to them) in one statement; the number of versions deleted."""
    with connection.cursor() as cursor:
        cursor.execute(_DELETE_VERSIONS, [CompendiumVersion.Kind.CLIENT, round_id, client_id])
        (deleted,) = cursor.fetchone()
    return deleted


def load_compendium(version: CompendiumVersion) -> Compendium:
    return Compendium.model_validate(version.content)


def nearest_scenarios(version: CompendiumVersion, query_vector, k: int = 5, *, exact: bool = True):
    """The k scenarios of a version closest to the query by cosine distance, in exact order (a
    scan of the version's rows), or with `exact=False` from pgvector's HNSW index (approximate:
    the index is shared by every version and filtered after the fact)."""
    rows = (
        ScenarioEntry.objects.filter(version=version, embedding__isnull=False)
        .select_related("tool")
        .annotate(distance=CosineDistance("embedding", query_vector))
    )
    if not exact:  # the index serves only a bare ORDER BY distance
        return list(rows.order_by("distance")[:k])
    # "+ 0" keeps the planner off the HNSW index; ties go to the earlier row.
    exact_distance = ExpressionWrapper(F("distance") + Value(0.0), output_field=FloatField())
    return list(rows.order_by(exact_distance, "id")[:k])
