"""Accepting a client's compendium for the open round: validation, scrubbing, idempotency and
replacement of the client's earlier submission, all in one short transaction.

Concurrency: the client's row is locked for the transaction, so two requests of one client
(same or different idempotency keys) are serialized; the unique (client, idempotency_key)
constraint is the last line of defence. The open round is read `FOR SHARE`, so closing a round
waits for submissions in flight, and a submission that waited sees the round closed (409).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, connection, transaction

from compendium.models import CompendiumVersion, NumericField, Tool
from compendium.schema import Schema
from compendium.scrub import scrub_compendium
from compendium.services import current_schema, delete_client_versions, store_compendium
from compendium.validation import Violation, validate_compendium
from federation import ratelimit
from federation.errors import (
    FederationError,
    IdempotencyMismatch,
    InvalidRequest,
    NoOpenRound,
    PayloadTooLarge,
    RateLimited,
)
from federation.models import Client, FederationSettings, Round, Submission
from federation.services import cached_settings

MAX_KEY_LENGTH = 200


class SubmissionInvalid(FederationError):
    status_code = 400

    def __init__(self, violations: list[Violation]):
        super().__init__(f"the compendium is not valid under the schema: {len(violations)} violation(s)")
        self.violations = violations


@dataclass(frozen=True)
class Outcome:
    status_code: int
    body: dict
    replayed: bool


# --- the schema in force, cached per process and refreshed when the registry changes ----------

_schema_lock = threading.Lock()
_schema_cache: tuple[tuple, Schema] | None = None
_FINGERPRINT_SQL = (
    f"SELECT (SELECT count(*) FROM {Tool._meta.db_table} WHERE active), "
    f"(SELECT max(updated_at) FROM {Tool._meta.db_table}), "
    f"(SELECT count(*) FROM {Tool._meta.db_table}), "
    f"(SELECT md5(coalesce(string_agg(name || ':' || kind || ':' || min_value || ':' || "
    f"max_value || ':' || sensitivity, ',' ORDER BY name), '')) "
    f"FROM {NumericField._meta.db_table}), "
    f"EXISTS (SELECT 1 FROM {Round._meta.db_table} WHERE state = 'open')"
)


def schema_in_force() -> Schema:
    """`current_schema()`, rebuilt only when the registry or declared fields changed."""
    return _schema_and_open_round()[0]


def _schema_and_open_round() -> tuple[Schema, bool]:
    """The schema in force and whether a round is open, in one round trip to the database."""
    global _schema_cache
    with connection.cursor() as cursor:
        cursor.execute(_FINGERPRINT_SQL)
        *fingerprint, round_open = cursor.fetchone()
    fingerprint = tuple(fingerprint)
    cached = _schema_cache
    if cached is not None and cached[0] == fingerprint:
        return cached[1], bool(round_open)
    with _schema_lock:
        schema = current_schema()
        _schema_cache = (fingerprint, schema)
    return schema, bool(round_open)


# --- the limits -------------------------------------------------------------------------------

def federation_settings() -> FederationSettings:
    """The federation settings, re-read at most every 2 s per process on the hot path."""
    return cached_settings()


def max_submission_bytes() -> int:
    return min(federation_settings().max_submission_bytes, settings.SYNAPSE_MAX_SUBMISSION_BYTES)


def check_declared_length(content_length: str | None) -> None:
    """413 from the Content-Length header alone, before any of the body is read."""
    if not content_length:
        return
    try:
        declared = int(content_length)
    except ValueError as exc:
        raise InvalidRequest("Content-Length is not a number") from exc
    limit = max_submission_bytes()
    if declared > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {limit} bytes")


def check_rate(client: Client) -> None:
    limit = federation_settings().submissions_per_minute
    decision = ratelimit.hit(f"submit:client:{client.pk}", limit, 60)
    if not decision.allowed:
        raise RateLimited(
            f"a client may submit {limit} times per minute; retry in {decision.retry_after} s",
            decision.retry_after,
        )


def check_key(key: str | None) -> str:
    if key is None or not key.strip():
        raise InvalidRequest("the Idempotency-Key header is required (1 to 200 characters)")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidRequest(f"the Idempotency-Key is {len(key)} characters; at most 200")
    return key


# --- the submission -------------------------------------------------------------------------


def _replay(existing: Submission, request_sha256: str) -> Outcome:
    if existing.request_sha256 != request_sha256:
        raise IdempotencyMismatch(
            "this Idempotency-Key was already used with a different body; use a new key"
        )
    return Outcome(existing.status_code, {"id": existing.pk, **existing.response}, replayed=True)


# The hot path's reads are plain SQL: each ORM query costs about half a millisecond of CPU to
# build, several times what the database spends on it.
_STORED_SQL = (
    f"SELECT id, request_sha256, status_code, response FROM {Submission._meta.db_table} "
    "WHERE client_id = %s AND idempotency_key = %s"
)
_LOCK_CLIENT_SQL = f"SELECT id FROM {Client._meta.db_table} WHERE id = %s FOR UPDATE"


def _stored(client: Client, key: str) -> Submission | None:
    """The submission stored under this client's key (the fields a replay needs), or None."""
    with connection.cursor() as cursor:
        cursor.execute(_STORED_SQL, [client.pk, key])
        row = cursor.fetchone()
    if row is None:
        return None
    pk, request_sha256, status_code, response = row
    if isinstance(response, str | bytes):  # jsonb comes back as text through Django's cursor
        response = json.loads(response)
    return Submission(
        pk=pk, client=client, idempotency_key=key, request_sha256=request_sha256,
        status_code=status_code, response=response,
    )


def _lock_client(client: Client) -> None:
    with connection.cursor() as cursor:
        cursor.execute(_LOCK_CLIENT_SQL, [client.pk])
        if cursor.fetchone() is None:
            raise Client.DoesNotExist(f"client {client.pk} no longer exists")


def _open_round_for_share() -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, number FROM {Round._meta.db_table} WHERE state = %s FOR SHARE",
            [Round.State.OPEN],
        )
        row = cursor.fetchone()
    if row is None:
        raise NoOpenRound()
    return row


def submit(client: Client, body: bytes, idempotency_key: str) -> Outcome:
    """Store a client's compendium for the open round (or replay the stored outcome of this
    idempotency key). Raises FederationError subclasses for every refusal."""
    key = check_key(idempotency_key)
    request_sha256 = hashlib.sha256(body).hexdigest()
    existing = _stored(client, key)
    if existing is not None:
        return _replay(existing, request_sha256)

    limit = max_submission_bytes()
    if len(body) > limit:
        raise PayloadTooLarge(f"the body is {len(body)} bytes; the limit is {limit} bytes")
    check_rate(client)
    schema, round_open = _schema_and_open_round()
    if not round_open:  # answered before the work of validation; re-checked under lock below
        raise NoOpenRound()

    result = validate_compendium(body, schema)
    if not result.ok:
        raise SubmissionInvalid(result.violations)
    compendium, scrubbed = scrub_compendium(result.compendium)

    try:
        with transaction.atomic():
            _lock_client(client)
            existing = _stored(client, key)
            if existing is not None:  # a concurrent request with this key won the race
                return _replay(existing, request_sha256)
            round_id, round_number = _open_round_for_share()
            replaced = delete_client_versions(round_id=round_id, client_id=client.pk)
            rnd = Round(pk=round_id, number=round_number)
            version = store_compendium(
                compendium,
                kind=CompendiumVersion.Kind.CLIENT,
                round=rnd,
                client=client,
                entry_rows=False,
            )
            response = {
                "round": round_number,
                "round_id": round_id,
                "client": client.pk,
                "version": version.pk,
                "sha256": version.sha256,
                "size_bytes": version.size_bytes,
                "gzip_bytes": version.gzip_bytes,
                "entry_counts": version.entry_counts,
                "scrubbed": scrubbed,
                "replaced": bool(replaced),
            }
            # The stored response lacks only the submission's own id, added when answering.
            submission = Submission.objects.create(
                client=client,
                round_id=round_id,
                idempotency_key=key,
                request_sha256=request_sha256,
                version=version,
                status_code=201,
                response=response,
                scrubbed=scrubbed,
            )
            response = {"id": submission.pk, **response}
    except IntegrityError:
        # Only reachable if the row lock was bypassed: the unique key decides, we replay.
        existing = _stored(client, key)
        if existing is None:
            raise
        return _replay(existing, request_sha256)
    return Outcome(201, response, replayed=False)
