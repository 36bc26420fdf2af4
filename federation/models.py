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
