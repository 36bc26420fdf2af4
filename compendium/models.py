"""Storage of the tool registry, the declared numeric fields, and compendium versions.

A compendium version is one stored compendium: a client's submission, an edge result or the global
result, each tied to a round. Its entries are rows of their own so that scenarios and precautions
can be searched by cosine similarity in pgvector (HNSW index).
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from pgvector.django import HnswIndex, VectorField

from compendium.registry import CATEGORY_MAX_LENGTH, TOOL_ID_MAX_LENGTH, TOOL_NAME_MAX_LENGTH

EMBEDDING_DIM = settings.SYNAPSE_EMBEDDING_DIM


class Tool(models.Model):
    """A registry entry: the canonical (id, description, spec) of the compendium's M."""

    tool_id = models.CharField(max_length=TOOL_ID_MAX_LENGTH, unique=True)
    name = models.CharField(max_length=TOOL_NAME_MAX_LENGTH, blank=True)
    description = models.TextField()
    category = models.CharField(max_length=CATEGORY_MAX_LENGTH, blank=True, db_index=True)
    spec = models.JSONField(default=dict, blank=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tool_id"]

    def __str__(self) -> str:
        return self.tool_id


class NumericField(models.Model):
    """A declared numeric subfield of m_t with range and per-user sensitivity."""

    class Kind(models.TextChoices):
        COUNT = "count"
        RATE = "rate"
        FREQUENCY = "frequency"
        LATENCY = "latency"
        OTHER = "other"

    name = models.CharField(max_length=64, unique=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    min_value = models.FloatField()
    max_value = models.FloatField()
    sensitivity = models.FloatField(help_text="per-user sensitivity Δ (clipping bound)")
    unit = models.CharField(max_length=32, blank=True)
    description = models.TextField(blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(min_value__lt=models.F("max_value")), name="numeric_range_ordered"
            ),
            models.CheckConstraint(condition=models.Q(sensitivity__gt=0), name="sensitivity_positive"),
        ]

    def __str__(self) -> str:
        return self.name


class CompendiumVersion(models.Model):
    """One stored compendium, tied to a round, with its canonical bytes' figures."""

    class Kind(models.TextChoices):
        CLIENT = "client", "client submission"
        EDGE = "edge", "edge result"
        GLOBAL = "global", "global result"

    kind = models.CharField(max_length=8, choices=Kind.choices)
    round = models.ForeignKey("federation.Round", on_delete=models.CASCADE, related_name="compendiums")
    client = models.ForeignKey(
        "federation.Client", null=True, blank=True, on_delete=models.CASCADE, related_name="compendiums"
    )
    organization = models.ForeignKey(
        "federation.Organization",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="compendiums",
    )
    schema_version = models.CharField(max_length=16)
    content = models.JSONField(help_text="the canonical form of the compendium")
    sha256 = models.CharField(max_length=64, db_index=True)
    size_bytes = models.PositiveIntegerField()
    gzip_bytes = models.PositiveIntegerField()
    entry_counts = models.JSONField(default=dict)
    # Provenance: the versions this one was merged from (edge <- clients, global <- edges).
    sources = models.ManyToManyField("self", symmetrical=False, related_name="derived", blank=True)
    # A global's routing head (`routing.router.LinearHead.to_bytes`), fitted when it is published;
    # derived from the published scenarios and descriptions only, served by the routing API.
    routing_head = models.BinaryField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["kind", "round"])]
        constraints = [
            models.CheckConstraint(
                condition=(
                    models.Q(kind="client", client__isnull=False)
                    | models.Q(kind="edge", organization__isnull=False)
                    | models.Q(kind="global", client__isnull=True, organization__isnull=True)
                ),
                name="compendium_owner_matches_kind",
            ),
            # One current version per owner and round: a client's replacement submission, or a
            # re-materialized edge/global result, replaces the row in the same transaction.
            models.UniqueConstraint(
                fields=["round", "client"],
                condition=models.Q(kind="client"),
                name="one_client_compendium_per_round",
            ),
            models.UniqueConstraint(
                fields=["round", "organization"],
                condition=models.Q(kind="edge"),
                name="one_edge_compendium_per_round",
            ),
            models.UniqueConstraint(
                fields=["round"], condition=models.Q(kind="global"), name="one_global_compendium_per_round"
            ),
        ]

    def __str__(self) -> str:
        owner = self.client or self.organization or "global"
        return f"{self.kind} compendium of {owner} for round {self.round_id}"


def _embedding_index(name: str) -> HnswIndex:
    """The HNSW index of an entry's embedding, for nearest neighbours by cosine distance."""
    return HnswIndex(
        name=name, fields=["embedding"], m=16, ef_construction=64, opclasses=["vector_cosine_ops"]
    )


class _Entry(models.Model):
    version = models.ForeignKey(CompendiumVersion, on_delete=models.CASCADE)
    tool = models.ForeignKey(Tool, on_delete=models.PROTECT)

    class Meta:
        abstract = True


class ScenarioEntry(_Entry):
    """A usage scenario (U) with its embedding."""

    text = models.TextField()
    preconditions = models.JSONField(default=dict, blank=True)
    support = models.PositiveIntegerField(default=1)
    embedding = VectorField(dimensions=EMBEDDING_DIM, null=True, blank=True)

    class Meta:
        default_related_name = "scenarios"
        indexes = [_embedding_index("scenario_embedding_hnsw")]

    def __str__(self) -> str:
        return f"{self.tool_id}: {self.text[:60]}"


class PrecautionEntry(_Entry):
    """A precaution (P) with its embedding."""

    text = models.TextField()
    support = models.PositiveIntegerField(default=1)
    embedding = VectorField(dimensions=EMBEDDING_DIM, null=True, blank=True)

    class Meta:
        default_related_name = "precautions"
        indexes = [_embedding_index("precaution_embedding_hnsw")]

    def __str__(self) -> str:
        return f"{self.tool_id}: {self.text[:60]}"


class TemplateEntry(_Entry):
    """A prompt template (T), keyed by (tool, signature)."""

    signature = models.CharField(max_length=200)
    template = models.TextField()

    class Meta:
        default_related_name = "templates"


class StatEntry(_Entry):
    """A numeric statistic of M: a client's clipped value, or a noised release at edge/global."""

    field = models.CharField(max_length=64)
    value = models.FloatField()

    class Meta:
        default_related_name = "stats"


class AnnexEntry(models.Model):
    """A typed triple of the annex (A)."""

    version = models.ForeignKey(CompendiumVersion, on_delete=models.CASCADE, related_name="annex")
    subject = models.CharField(max_length=300)
    relation = models.CharField(max_length=300)
    object = models.CharField(max_length=300)
