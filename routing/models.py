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

    @classmethod
    def issue(cls, name: str) -> tuple[RoutingToken, str]:
        """A new token; the raw value is returned once and never stored."""
        raw = "rt_" + secrets.token_urlsafe(32)
        return cls.objects.create(name=name, token_hash=hash_token(raw)), raw


class RoutingCall(models.Model):
    """One routing call's latency, inserted in batches from an in-memory buffer."""

    at = models.DateTimeField(db_index=True)
    latency_ms = models.FloatField()
    queries = models.PositiveIntegerField(default=1)
    reranker = models.CharField(max_length=16)
    compendium_round = models.PositiveIntegerField(null=True)

    class Meta:
        ordering = ["-at"]
