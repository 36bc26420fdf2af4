"""Routing tokens (who may call the routing API) and routing-call latencies (for dashboards)."""

from __future__ import annotations

import hashlib
import secrets

from django.db import models


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


class RoutingToken(models.Model):
    """A bearer token for an application that calls the routing API; only its hash is stored."""

    name = models.CharField(max_length=200, unique=True)
    token_hash = models.CharField(max_length=64, unique=True)
    revoked = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"routing token {self.name}{' (revoked)' if self.revoked else ''}"

    PREFIX = "rt_"

    @classmethod
    def live(cls, raw: str) -> RoutingToken | None:
        """The unrevoked token whose secret is `raw`, or None."""
        if not raw.startswith(cls.PREFIX):
            return None
        return cls.objects.filter(token_hash=hash_token(raw), revoked=False).first()

    @classmethod
    def issue(cls, name: str) -> tuple[RoutingToken, str]:
        """A new token; the raw value is returned once and never stored."""
        raw = cls.PREFIX + secrets.token_urlsafe(32)
        return cls.objects.create(name=name, token_hash=hash_token(raw)), raw

    def reissue(self) -> str:
        """A new secret for this (revoked) token's name, in force at once; the old one stays
        refused. Returned once and never stored."""
        raw = self.PREFIX + secrets.token_urlsafe(32)
        self.token_hash, self.revoked = hash_token(raw), False
        self.save(update_fields=["token_hash", "revoked"])
        return raw


class RoutingCall(models.Model):
    """One routing call's latency, inserted in batches from an in-memory buffer."""

    at = models.DateTimeField(db_index=True)
    latency_ms = models.FloatField()
    queries = models.PositiveIntegerField(default=1)
    # POST /api/v1/route/batch/ (whatever its number of queries), not /route/
    batch = models.BooleanField(default=False)
    reranker = models.CharField(max_length=16)  # the one that decided (most of a batch)
    compendium_round = models.PositiveIntegerField(null=True)

    class Meta:
        ordering = ["-at"]


class TunedRouter(models.Model):
    """The routing encoder fine-tuned on one published global (`federation.tuning`): its state and
    the folder that holds the model, the global re-embedded by it, its head and fusion weights.
    The routing API routes with it once it is ready; until then, and when it fails, with the
    frozen MiniLM."""

    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        READY = "ready"
        FAILED = "failed"
        SKIPPED = "skipped"  # a newer global was published before it ran
        RETIRED = "retired"  # a newer global's router is ready; its folder is removed

    version = models.OneToOneField(
        "compendium.CompendiumVersion", on_delete=models.CASCADE, related_name="tuned_router"
    )
    state = models.CharField(max_length=8, choices=State.choices, default=State.QUEUED)
    epochs = models.PositiveSmallIntegerField()
    directory = models.CharField(max_length=500, blank=True)
    rows = models.PositiveIntegerField(null=True)  # texts the encoder learnt from
    seconds = models.FloatField(null=True)  # fine-tuning, re-embedding and refitting
    fine_tune_seconds = models.FloatField(null=True)  # of which the fine-tuning itself
    device = models.CharField(max_length=200, blank=True)  # where it was fine-tuned: "cpu", "cuda:0 (…)"
    probe_accuracy = models.FloatField(null=True)  # top-1 on the probe half it did not learn from
    frozen_probe_accuracy = models.FloatField(null=True)  # the frozen router's, same half
    detail = models.TextField(blank=True)  # why it failed or was skipped
    created_at = models.DateTimeField(auto_now_add=True)
    # when its task was last queued (a lost message is queued again an hour later:
    # federation.tuning.requeue_lost_tuning); null for rows queued before the field
    queued_at = models.DateTimeField(null=True)
    # times that check queued it again since it last finished (past SYNAPSE_TASK_MAX_DELIVERIES
    # it fails instead: a tuning that kills its worker is not queued again every hour)
    requeues = models.PositiveSmallIntegerField(default=0)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"tuned router of {self.version} ({self.state})"
