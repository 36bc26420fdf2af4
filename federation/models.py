"""Organizations, their clients, and federated rounds."""

from __future__ import annotations

from django.db import models


class Organization(models.Model):
    """A member organization; it runs one edge aggregator over its clients."""

    name = models.CharField(max_length=200, unique=True)
    slug = models.SlugField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Client(models.Model):
    """A machine identity of an organization that submits compendiums."""

    class Status(models.TextChoices):
        PENDING = "pending", "pending approval"
        APPROVED = "approved", "approved"
        REVOKED = "revoked", "revoked"

    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="clients")
    name = models.CharField(max_length=200)
    description = models.TextField(blank=True)
    contact = models.CharField(max_length=254, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["organization__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organization", "name"], name="client_name_unique_in_org")
        ]

    def __str__(self) -> str:
        return f"{self.organization.slug}/{self.name}"


class Round(models.Model):
    """One federated round: open -> closing -> merging -> published (or failed)."""

    class State(models.TextChoices):
        OPEN = "open", "open"
        CLOSING = "closing", "closing"
        MERGING = "merging", "merging"
        PUBLISHED = "published", "published"
        FAILED = "failed", "failed"

    number = models.PositiveIntegerField(unique=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.OPEN)
    # tau, epsilon per field, lambda expected, summarizer, robust rule, seed: enough to replay it.
    config = models.JSONField(default=dict, blank=True)
    failure_reason = models.TextField(blank=True)
    opened_at = models.DateTimeField(auto_now_add=True)
    closed_at = models.DateTimeField(null=True, blank=True)
    published_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-number"]

    def __str__(self) -> str:
        return f"round {self.number} ({self.state})"


class PrivacyLedgerEntry(models.Model):
    """One numeric release (append-only): the accountant composes these per organization and for
    the federation. Rows are never updated or deleted, so spent budget is never forgotten, also
    not when a client's data is erased and the compendiums are re-materialized."""

    round = models.ForeignKey(Round, on_delete=models.PROTECT, related_name="ledger")
    organization = models.ForeignKey(
        Organization, on_delete=models.PROTECT, related_name="ledger"
    )
    # 0 for the round's first materialization, n for the n-th re-materialization (erasure).
    release = models.PositiveIntegerField(default=0)
    tool_id = models.CharField(max_length=128)
    field = models.CharField(max_length=64)
    sensitivity = models.FloatField()
    contributors = models.PositiveIntegerField()
    epsilon = models.FloatField()
    noise_scale = models.FloatField()
    mechanism = models.CharField(max_length=32, default="laplace")
    field_cap = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["round__number", "organization_id", "release", "tool_id", "field"]
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization", "release", "tool_id", "field"],
                name="one_ledger_row_per_release",
            )
        ]

    def save(self, *args, **kwargs):
        if self.pk is not None and not self._state.adding:
            raise PermissionError("the privacy ledger is append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise PermissionError("the privacy ledger is append-only")

    def __str__(self) -> str:
        return f"round {self.round_id} {self.organization_id} {self.tool_id}.{self.field} ε={self.epsilon:g}"


class ConflictLogEntry(models.Model):
    """An entry of an edge's conflict log L(r), keyed by (tool, centroid id). It stays at its
    edge (organization) and becomes next round's precautions there."""

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="conflicts")
    organization = models.ForeignKey(
        Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="conflicts"
    )
    tool_id = models.CharField(max_length=128)
    centroid_id = models.CharField(max_length=64)
    centroid = models.JSONField()
    dissenters = models.JSONField(default=list)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["round__number", "tool_id", "centroid_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization", "tool_id", "centroid_id"],
                name="one_conflict_per_centroid",
            )
        ]


class MergeRecord(models.Model):
    """Merge statistics of one edge (organization set) or of the server merge (organization
    null) for a round; the global record also holds the probe-set accuracy."""

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="merge_records")
    organization = models.ForeignKey(
        Organization, null=True, blank=True, on_delete=models.CASCADE, related_name="merge_records"
    )
    stats = models.JSONField(default=dict)
    rejected = models.JSONField(default=list)
    flagged = models.JSONField(default=list)
    accuracy = models.FloatField(null=True, blank=True)
    probe_queries = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["round", "organization"], name="one_merge_record_per_edge"
            ),
            models.UniqueConstraint(
                fields=["round"],
                condition=models.Q(organization__isnull=True),
                name="one_global_merge_record",
            ),
        ]


class ProbeQuery(models.Model):
    """A public labelled query (from a routing benchmark, never client data) used by the
    summarizers and to measure a global compendium's routing accuracy."""

    dataset = models.CharField(max_length=100)
    qid = models.CharField(max_length=200)
    text = models.TextField()
    tool_id = models.CharField(max_length=128, db_index=True)

    class Meta:
        ordering = ["dataset", "qid"]
        constraints = [
            models.UniqueConstraint(fields=["dataset", "qid"], name="probe_query_unique")
        ]
