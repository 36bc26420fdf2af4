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
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Exists, Max, OuterRef
from django.utils import timezone

from compendium import transport
from compendium.canonical import canonical_form, encode_document
from compendium.masking import TextMasker, expected_mask_strength
from compendium.models import CompendiumVersion, NumericField, Tool
from compendium.schema import Schema, exceeds_field_cap, field_cap_words
from compendium.scrub import masking_residue, scrub_compendium, submission_rules
from compendium.services import current_schema, versions_delete_sql
from compendium.validation import Violation, validate_compendium
from federation import ratelimit
from federation.errors import (
    FederationError,
    IdempotencyMismatch,
    InvalidRequest,
    LengthRequired,
    NoOpenRound,
    NotAllowed,
    PayloadTooLarge,
    RateLimited,
    Replaced,
    RoundChanged,
    SchemaChanged,
    UnknownDictionary,
    UnsupportedEncoding,
    UnsupportedMediaType,
)
from federation.models import (
    AuditLog,
    Client,
    ClientToken,
    FederationSettings,
    ProbeQuery,
    RateCounter,
    Round,
    Submission,
)
from federation.services import Actor, audit, cached_settings
from synapse_web.prepared import prepared_cursor

MAX_KEY_LENGTH = 200


class SubmissionInvalid(FederationError):
    status_code = 400

    def __init__(self, violations: list[Violation]):
        super().__init__(f"the compendium is not valid under the schema: {len(violations)} violation(s)")
        self.violations = violations


class UnmaskedText(SubmissionInvalid):
    """Text that still holds what masking at the round's λ removes from any text (names, numbers,
    identifiers, e-mail addresses, URLs, phone numbers): it was not masked as the round expects.
    Refused whole, so that none of it is stored."""

    code = "unmasked_text"

    def __init__(self, violations: list[Violation], strength: float):
        super().__init__(violations)
        self.detail = (
            f"{len(violations)} text(s) are not masked at this round's strength λ = {strength:g}: "
            "they hold names, numbers, identifiers or contact details that masking removes from "
            f"any text; mask them (synapse-client build --lambda {strength:g}) and submit again. "
            "Nothing was stored"
        )


class EmptySubmission(InvalidRequest):
    """A valid compendium with no entries at all: accepting it would replace the client's earlier
    submission to the round with nothing (a buggy client wiping its contribution)."""

    code = "empty_compendium"

    def __init__(self):
        super().__init__(
            "the compendium has no entries (metadata, scenarios, precautions, templates and annex "
            "are all empty): there is nothing to submit, and the client's earlier submission to "
            "this round, if any, is kept"
        )


class FieldCapExceeded(InvalidRequest):
    """Numeric statistics for a round with a field cap F* from a compendium that does not record
    a cap no larger than F*: the edge's noise is calibrated for 2·F* tools' fields per user, so
    statistics capped more loosely (or not at all) would be under-charged. Refused whole."""

    code = "field_cap_exceeded"

    def __init__(self, round_number: int, round_cap: int, recorded: int | None):
        says = (
            "records no field cap (built without one, or by tooling that does not record it)"
            if recorded is None
            else f"records {field_cap_words(recorded)}"
        )
        super().__init__(
            f"round {round_number} caps each user's numeric statistics at F* = {round_cap} "
            f"tool(s), but this compendium carries statistics and {says}: build it again "
            f"with synapse-client build --field-cap {round_cap} (or less) and submit; nothing "
            "was stored"
        )


class FieldsNotReleased(InvalidRequest):
    """Numeric statistics for fields the open round will not release: those of its
    `fields_not_released` (fixed when it opened), and `never`, declared fields of kind `other`
    that no edge releases (`Schema.releasable_fields`). The merge drops them, so storing them
    would only keep a client's un-noised numbers where the operator reads them. Refused whole."""

    code = "fields_not_released"

    def __init__(self, round_number: int, fields: list[str], never: list[str] = ()):
        parts = []
        if fields:
            parts.append(
                f"round {round_number} will not release the numeric field(s) {', '.join(fields)}, "
                f"but this compendium carries statistics for them: build it again with "
                f"synapse-client build --not-released {','.join(fields)} (participate does)"
            )
        if never:
            parts.append(
                f"no round releases the numeric field(s) {', '.join(never)}, of kind other (not "
                f"derived from a usage log: no edge noises or publishes one), but this compendium "
                f"carries statistics for them: leave them out"
            )
        super().__init__("; ".join(parts) + " and submit; nothing was stored")


@dataclass(frozen=True)
class Outcome:
    status_code: int
    body: dict
    replayed: bool


# --- the schema in force, cached per process and refreshed when the registry changes ----------

_schema_lock = threading.Lock()
_schema_cache: tuple[tuple, Schema] | None = None
_TOOLS = Tool._meta.db_table
# What the schema in force is built from (the registry and the declared numeric fields), as four
# columns; the schema is rebuilt when they change.
_FINGERPRINT_COLUMNS = (
    "tools.active, tools.updated, tools.total, fields.digest "
    f"FROM (SELECT count(*) FILTER (WHERE active) AS active, max(updated_at) AS updated, "
    f"count(*) AS total FROM {_TOOLS}) AS tools, "
    f"(SELECT md5(coalesce(string_agg(name || ':' || kind || ':' || min_value || ':' || "
    f"max_value || ':' || sensitivity, ',' ORDER BY name), '')) AS digest "
    f"FROM {NumericField._meta.db_table}) AS fields"
)
# A round takes submissions while open and before its deadline (if it has one).
_TAKES_SUBMISSIONS = "state = 'open' AND (closes_at IS NULL OR closes_at > statement_timestamp())"
# The open round's number, expected masking strength and field cap F* (each -1 when its
# configuration names none; a mask_strength that is no JSON number names none, as the client
# toolkit reads it: `expected_mask_strength`); NULL when no round takes submissions. The
# configuration is written through RoundConfig: its mask_strength is a number or absent (written
# by hand), its field_cap an integer, null or absent.
_ROUND_OPEN = (
    f"(SELECT ARRAY[number::float8, CASE WHEN jsonb_typeof(config->'mask_strength') = 'number' "
    f"THEN (config->>'mask_strength')::float8 ELSE -1 END, "
    f"coalesce((config->>'field_cap')::float8, -1)] "
    f"FROM {Round._meta.db_table} WHERE {_TAKES_SUBMISSIONS} ORDER BY number DESC LIMIT 1)"
)
# The numeric fields the open round will not release (fixed when it opened), as JSON text.
_ROUND_NOT_RELEASED = (
    f"(SELECT fields_not_released::text FROM {Round._meta.db_table} WHERE {_TAKES_SUBMISSIONS} "
    "ORDER BY number DESC LIMIT 1)"
)
_FINGERPRINT_SQL = f"SELECT {_FINGERPRINT_COLUMNS}"


def schema_in_force() -> Schema:
    """`current_schema()`, rebuilt only when the registry or declared fields changed (the
    submission path reads the same fingerprint inside its look-ahead)."""
    with prepared_cursor() as cursor:
        cursor.execute(_FINGERPRINT_SQL)
        fingerprint = cursor.fetchone()
    return _schema_for(tuple(fingerprint))


def _schema_for(fingerprint: tuple) -> Schema:
    global _schema_cache
    cached = _schema_cache
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    with _schema_lock:
        schema = current_schema()
        _schema_cache = (fingerprint, schema)
    return schema


_masker_cache: tuple[tuple, TextMasker] | None = None


def _masker_for(fingerprint: tuple, schema: Schema, stored: float) -> TextMasker:
    """The masker whose residue a submission to the open round must not hold, protecting the
    registry in force: at the λ the round expects, `stored` read as the client toolkit reads it
    (`expected_mask_strength`: negative, the configuration names none, so the default)."""
    global _masker_cache
    strength = expected_mask_strength(stored)
    key = (fingerprint, strength)
    cached = _masker_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    masker = TextMasker.for_registry(schema.tools, strength=strength)
    _masker_cache = (key, masker)
    return masker


# --- the limits -------------------------------------------------------------------------------

def federation_settings() -> FederationSettings:
    """The federation settings, re-read at most every 2 s per process on the hot path."""
    return cached_settings()


def max_submission_bytes() -> int:
    return min(federation_settings().max_submission_bytes, settings.SYNAPSE_MAX_SUBMISSION_BYTES)


def encoding_name(content_encoding: str | None) -> str:
    """A Content-Encoding header as stored: lower case, "" for none or identity."""
    encoding = (content_encoding or "").strip().lower()
    return "" if encoding == "identity" else encoding


def decoded_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """The submitted JSON from a request body sent plain, with `Content-Encoding: gzip` (a client
    on a thin link sends about a quarter of the bytes) or `dcz` (zstd against a dictionary the
    server holds: `compendium.transport`). The decompressed body is held to the same `limit` as a
    plain one, without ever inflating more than limit + 1 bytes of it, so a small compressed bomb
    is a 413, not a memory spike."""
    encoding = encoding_name(content_encoding)
    if not encoding:
        return body
    if encoding == transport.CONTENT_ENCODING:
        return _dcz_body(body, limit)
    if encoding != "gzip":
        raise UnsupportedEncoding(
            f"Content-Encoding {content_encoding!r} is not supported; send gzip, dcz or no encoding"
        )
    # A gzip body may be several members one after the other (RFC 1952; pigz, cat a.gz b.gz):
    # their contents, concatenated.
    data, rest = b"", body
    while True:
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # the gzip container
        try:
            data += inflater.decompress(rest, limit + 1 - len(data))
        except zlib.error as exc:
            raise InvalidRequest(
                f"the body is not valid gzip ({exc})" if not data and rest is body
                else "the body has bytes after its gzip stream that are not another gzip member"
            ) from None
        if len(data) > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"the decompressed body exceeds the limit of {limit} bytes")
        if not inflater.eof:
            raise InvalidRequest("the gzip body is truncated")
        rest = inflater.unused_data
        if not rest:
            return data


def _dcz_body(body: bytes, limit: int) -> bytes:
    try:
        wanted = transport.body_dictionary_hash(body)
        dictionary = submission_dictionary(wanted)
        if dictionary is None:
            raise UnknownDictionary(
                f"the body was compressed against dictionary {wanted[:12]}…, which is neither the "
                "schema in force (alone or after the public probe set's requests) nor a published "
                "global compendium: pull the global again, or send gzip"
            )
        return transport.decompress(body, dictionary, limit)
    except transport.DczTooLarge as exc:
        raise PayloadTooLarge(str(exc)) from None
    except transport.DczError as exc:
        raise InvalidRequest(str(exc)) from None


def submission_dictionary(sha256: str) -> bytes | None:
    """The dictionary a dcz submission names by its SHA-256: a published global compendium's
    canonical bytes or (before any global is published) the schema in force, alone or after the
    public probe set's requests; None if none of these."""
    try:
        return _published_global_bytes(sha256)
    except LookupError:
        pass
    schema = schema_in_force()
    data, data_hash = _schema_dictionary(schema)
    if data_hash == sha256:
        return data
    data, data_hash = _probe_dictionary(schema)
    return data if data_hash == sha256 else None


def probe_texts() -> list[str]:
    """The public probe set's requests, in the order its dictionary and its endpoint use."""
    return list(ProbeQuery.objects.order_by("dataset", "qid").values_list("text", flat=True))


def probe_labels() -> list[tuple[str, str | None]]:
    """The public probe set as (request, tool id), in the order its dictionary and its endpoint
    use, the tool None where the registry in force does not offer the label's tool (deactivated,
    or never imported): nobody is to route to it (`pipeline.probe_pairs` keeps the others), but
    the request stays, as the dictionary holds every request whatever its label."""
    offered = Exists(Tool.objects.filter(active=True, tool_id=OuterRef("tool_id")))
    rows = (ProbeQuery.objects.annotate(offered=offered).order_by("dataset", "qid")
            .values_list("text", "tool_id", "offered"))
    return [(text, tool if is_offered else None) for text, tool, is_offered in rows]


def probe_set() -> dict:
    """What `GET /api/v1/compendium/probe/` serves: the probe requests, the SHA-256 naming them
    (`transport.probe_bytes`, the dcz dictionary's first part) and each request's tool in
    `labels` (public too: before any global a client routes with them, `build --probe`), null
    for a tool the registry does not offer (`probe_labels`). `tools`, the labels as clients
    before `labels` read them (strings only), is served only when no label is null: such a
    client reads a set without it as one without labels and routes with none of them, where it
    would reject a null and fail."""
    pairs = probe_labels()
    texts = [text for text, _ in pairs]
    labels = [tool for _, tool in pairs]
    sha256 = transport.dictionary_hash(transport.probe_bytes(texts))
    probe = {"count": len(texts), "sha256": sha256, "texts": texts, "labels": labels}
    if None not in labels:
        probe["tools"] = labels
    return probe


def probe_etag(probe: dict) -> str:
    """The probe endpoint's ETag: names the requests and their labels, so a tool deactivated or
    reactivated is a new probe set to a client that routes with it (`sha256` names only the
    requests, as the dictionary holds them)."""
    return transport.dictionary_hash(
        encode_document({"texts": probe["texts"], "labels": probe["labels"]})
    )


_schema_dictionary_cache: tuple[Schema, bytes, str] | None = None


def _schema_dictionary(schema: Schema) -> tuple[bytes, str]:
    """The schema's dictionary and its hash, made again only when the schema in force is new."""
    global _schema_dictionary_cache
    cached = _schema_dictionary_cache
    if cached is None or cached[0] is not schema:
        data = transport.schema_dictionary(schema)
        cached = _schema_dictionary_cache = (schema, data, transport.dictionary_hash(data))
    return cached[1], cached[2]


_probe_dictionary_cache: tuple[Schema, tuple, bytes, str] | None = None


def _probe_dictionary(schema: Schema) -> tuple[bytes, str]:
    """The probe set's dictionary and its hash, made again only when the schema in force or the
    probe set changed: `import_probe_set` replaces the rows, so their count and last id tell."""
    global _probe_dictionary_cache
    fingerprint = tuple(ProbeQuery.objects.aggregate(n=Count("id"), last=Max("id")).values())
    cached = _probe_dictionary_cache
    if cached is None or cached[0] is not schema or cached[1] != fingerprint:
        data = transport.probe_dictionary(schema, probe_texts())
        cached = _probe_dictionary_cache = (
            schema, fingerprint, data, transport.dictionary_hash(data)
        )
    return cached[2], cached[3]


_GLOBAL_BYTES_KEPT = 4
_global_bytes_cache: OrderedDict[str, bytes] = OrderedDict()
_global_bytes_lock = threading.Lock()


def _published_global_bytes(sha256: str) -> bytes:
    """Canonical bytes of the published global with this SHA-256, checked against it, kept per
    process for the last few hashes. LookupError when there is none: a global published later is
    found, and one an erasure deleted or replaced is forgotten here too, at the next lookup of any
    hash, its bytes (the erased text among them) and its use as a dictionary (every other process
    already refused it: an erased global is no dictionary a body may name)."""
    globals_ = CompendiumVersion.objects.filter(
        kind=CompendiumVersion.Kind.GLOBAL, round__state=Round.State.PUBLISHED)
    published = globals_.filter(sha256=sha256)
    with _global_bytes_lock:
        kept = _global_bytes_cache.get(sha256)
        held = list(_global_bytes_cache)
    if held:
        # Every kept global that is no longer published goes now, not only this one: a global an
        # erasure deleted is forgotten at this process's next lookup, whichever body names it.
        still = set(globals_.filter(sha256__in=held).values_list("sha256", flat=True))
        with _global_bytes_lock:
            for gone in set(held) - still:
                _global_bytes_cache.pop(gone, None)
            if kept is not None:
                if sha256 not in still:
                    raise LookupError(sha256)
                if sha256 in _global_bytes_cache:
                    _global_bytes_cache.move_to_end(sha256)
                return kept
    content = published.values_list("content", flat=True).first()
    data = encode_document(content) if content is not None else None
    if data is None or transport.dictionary_hash(data) != sha256:
        raise LookupError(sha256)
    with _global_bytes_lock:
        _global_bytes_cache[sha256] = data
        while len(_global_bytes_cache) > _GLOBAL_BYTES_KEPT:
            _global_bytes_cache.popitem(last=False)
    return data


def clear_dictionary_cache() -> None:
    """Forget the dictionaries kept per process: the published globals' bytes, the schema's and
    the probe set's (tests, and a simulation's scratch federations, start from empty ones; a
    flushed database numbers its new probe rows from 1 again, which the probe dictionary's
    fingerprint would not tell from the rows before)."""
    global _schema_dictionary_cache, _probe_dictionary_cache
    with _global_bytes_lock:
        _global_bytes_cache.clear()
    _schema_dictionary_cache = _probe_dictionary_cache = None


def check_content_type(content_type: str | None) -> None:
    """415 for a body declared as anything but JSON (a form, text): it would otherwise be read as
    JSON anyway. No Content-Type is taken as JSON."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media and media != "application/json":
        raise UnsupportedMediaType(
            f"a submission is JSON: send it with Content-Type: application/json, not "
            f"{media[:60]!r} (compress it with Content-Encoding: gzip)"
        )


def check_declared_length(content_length: str | None, transfer_encoding: str | None = None) -> None:
    """413 from the Content-Length header alone, before any of the body is read; 411 for a body
    sent with a Transfer-Encoding (chunked) instead of a length: Django reads no further than the
    declared length, so it would read an empty body and answer that it is not JSON. Without
    either header the body is empty (RFC 9110, 6.3)."""
    if not content_length:
        if transfer_encoding:
            raise LengthRequired(
                f"a submission needs a Content-Length header, not Transfer-Encoding: "
                f"{transfer_encoding[:40]}: send the body with its length"
            )
        return
    try:
        declared = int(content_length)
    except ValueError as exc:
        raise InvalidRequest("Content-Length is not a number") from exc
    limit = max_submission_bytes()
    if declared > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes; the limit is {limit} bytes")


def _rate_limited(limit: int, window: ratelimit.Window) -> RateLimited:
    return RateLimited(
        f"a client may submit {limit} times per minute; retry in {window.retry_after} s",
        window.retry_after,
    )


def _unreleased_stats(compendium, not_released, schema: Schema) -> tuple[list[str], list[str]]:
    """The fields the compendium carries statistics for that no edge of the open round releases,
    sorted: those of the round's `fields_not_released` (its JSON, as text or decoded), and the
    declared fields of the schema in force that no edge ever releases (kind `other`: not
    `Schema.releasable_fields`)."""
    sent = {name for entry in compendium.metadata for name in entry.stats}
    if not sent:
        return [], []
    if isinstance(not_released, str | bytes):
        not_released = json.loads(not_released)
    names = frozenset(n for n in not_released or () if isinstance(n, str))
    never = sent - {f.name for f in schema.releasable_fields}
    return sorted((sent & names) - never), sorted(never)


def _count_refusal(client: Client, window_s: int = 60) -> None:
    """One hit on the client's rate counter for a request past the look-ahead that stores nothing
    (invalid, no round open, a replay): such requests count, as accepted ones do in their
    transaction."""
    ratelimit.hit(f"submit:client:{client.pk}", 1, window_s)


def _audit_unmasked(client: Client, round_number: int, strength: float, residue: list[Violation]):
    """The refusal of unmasked text in the audit log, for the operator and the client's
    organization: the round, λ and each text's path and reason (kinds and offsets, never words)."""
    audit(
        Actor.system(f"client {client.name}"),
        AuditLog.Action.SUBMISSION_UNMASKED,
        target=client,
        organization=client.organization,
        details={
            "round": round_number,
            "mask_strength": strength,
            "texts": len(residue),
            "violations": [v.as_dict() for v in residue[:20]],
        },
    )


def _audit_policy(client: Client, round_number: int, refusal: InvalidRequest) -> None:
    """A refusal by the round's release policy (field cap, fields not released) in the audit log,
    for the operator and the client's organization: a client built against another configuration
    than the round's, which its people should hear of."""
    audit(
        Actor.system(f"client {client.name}"),
        AuditLog.Action.SUBMISSION_POLICY,
        target=client,
        organization=client.organization,
        details={"round": round_number, "code": refusal.code, "detail": str(refusal)},
    )


def expected_round(header: str | None) -> int | None:
    """The `X-Synapse-Round` header: the round the client built and checked its body for (None
    when it sends none: other tooling need not)."""
    if header is None or not header.strip():
        return None
    text = header.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < 1:
        raise InvalidRequest(
            f"X-Synapse-Round must be a round number (a whole number >= 1), not {header[:40]!r}"
        )
    return int(text)


def check_key(key: str | None) -> str:
    if key is None or not key.strip():
        raise InvalidRequest("the Idempotency-Key header is required (1 to 200 characters)")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidRequest(f"the Idempotency-Key is {len(key)} characters; at most 200")
    if not all(" " <= char <= "~" for char in key):
        # HTTP carries other bytes as Latin-1: "é" would be stored, and listed back, as "Ã©"
        raise InvalidRequest(
            "the Idempotency-Key must be printable ASCII (letters, digits, punctuation), "
            "e.g. a UUID"
        )
    return key


# --- the submission -------------------------------------------------------------------------


def _replay(stored: tuple, request_sha256: str, expected_round: int | None) -> Outcome:
    pk, stored_sha256, status_code, response, superseded, takes_submissions, same = stored
    if stored_sha256 != request_sha256:
        raise IdempotencyMismatch(
            "this Idempotency-Key was already used with a different body; use a new key"
        )
    if isinstance(response, str | bytes):  # jsonb may come back as text
        response = json.loads(response)
    if expected_round is not None and response.get("round") not in (None, expected_round):
        # A 201 of another round would tell a client that names its round that it entered it.
        raise IdempotencyMismatch(
            f"this Idempotency-Key was already used for the submission to round "
            f"{response.get('round')}, and this request is for round {expected_round} "
            "(X-Synapse-Round): nothing was stored; use a new key for this round"
        )
    if superseded:
        # Replaying the 201 would tell the client that this submission is in effect: it is not,
        # whether or not its round still takes submissions.
        number = response.get("round")
        if takes_submissions:
            raise Replaced(
                "this Idempotency-Key's submission was replaced by a later submission of this "
                "client in the open round, which is in effect: nothing was stored. Submit it "
                "again under a new Idempotency-Key to put it back in effect (synapse-client does)"
            )
        if same:
            raise Replaced(
                f"this Idempotency-Key's submission was replaced by a later submission of this "
                f"client in round {number}, which is in effect and holds the same compendium "
                f"(sent again under another Idempotency-Key; that key replays its answer): "
                f"nothing was stored, and round {number} no longer takes submissions"
            )
        raise Replaced(
            f"this Idempotency-Key's submission was replaced by a later submission of this "
            f"client in round {number}, and the later one is in effect: nothing was stored, and "
            f"round {number} no longer takes submissions, so nothing can put it back in effect"
        )
    return Outcome(status_code, {"id": pk, **response}, replayed=True)


# The hot path is plain SQL, prepared on the server (synapse_web/prepared.py): an ORM query costs
# about half a millisecond of CPU to build, several times what the database spends on it, and
# planning the larger statements cost PostgreSQL more than running them. Five statements for a
# first submission: the token (authentication), the look-ahead, then in one transaction the
# client's lock, the claim and the insert; a replacing one adds the deletion of its earlier version.
_SUBMISSIONS = Submission._meta.db_table
_VERSIONS = CompendiumVersion._meta.db_table
_RATES = RateCounter._meta.db_table
# The key's stored answer; whether its submission was replaced by a later one of the client in
# its round (its version gone: a replay would tell the client it is in effect, whether or not the
# round still takes submissions); whether that round still takes submissions (a new key can put
# it back in effect); and whether the client's compendium in effect is this one's content all the
# same (sent again under another key).
_STORED = (
    f"SELECT s.id, s.request_sha256, s.status_code, s.response, "
    f"s.version_id IS NULL "
    f"AND EXISTS (SELECT 1 FROM {_SUBMISSIONS} later WHERE later.client_id = s.client_id "
    f"AND later.round_id = s.round_id AND later.id > s.id) AS superseded, "
    f"s.round_id IN (SELECT id FROM {Round._meta.db_table} WHERE {_TAKES_SUBMISSIONS}) "
    f"AS takes_submissions, "
    f"EXISTS (SELECT 1 FROM {_VERSIONS} v WHERE v.kind = 'client' AND v.client_id = s.client_id "
    f"AND v.round_id = s.round_id AND v.sha256 = s.response->>'sha256') AS same_in_effect "
    f"FROM {_SUBMISSIONS} s WHERE s.client_id = %(client)s AND s.idempotency_key = %(key)s"
)
_STORED_COLUMNS = 7

# Before the transaction, reading only: the stored answer of this key (a replay needs nothing
# else), the client's count in the current rate-limit window, whether a round is open and the
# schema's fingerprint.
_LOOK_AHEAD_SQL = f"""
WITH stored AS ({_STORED})
SELECT stored.*,
       (SELECT count FROM {_RATES} WHERE key = %(rate_key)s AND window_start = %(window_start)s),
       {_ROUND_OPEN}, {_ROUND_NOT_RELEASED}, {_FINGERPRINT_COLUMNS}
LEFT JOIN stored ON TRUE
"""

# The client's status under its lock: revoked (or otherwise no longer approved) while its
# request was being checked, it stores nothing.
_LOCK_CLIENT_SQL = f"SELECT status FROM {Client._meta.db_table} WHERE id = %(client)s FOR UPDATE"

# Under the client's lock: the stored answer of this key again (a concurrent request with it may
# have committed meanwhile), the open round read FOR SHARE (closing it waits for us), the client's
# current version of that round, if any, the request's hit on the client's rate counter
# (committed with the submission or the replay: one commit, one WAL flush, per request), the
# hash of the client's live token (a rotation, which locks the client too, committed while the
# body was checked: the token that sent it stopped; read here, not in the lock's statement, whose
# snapshot predates the wait), and the schema's fingerprint again (a tool deactivated or a numeric field changed while the body
# was checked: it was checked against another schema than the merge will use).
_CLAIM_SQL = f"""
WITH stored AS ({_STORED}),
open_round AS (SELECT id, number FROM {Round._meta.db_table} WHERE {_TAKES_SUBMISSIONS} FOR SHARE),
hit AS (
    INSERT INTO {_RATES} (key, window_start, count)
    VALUES (%(rate_key)s, %(window_start)s, 1)
    ON CONFLICT (key, window_start) DO UPDATE SET count = {_RATES}.count + 1
    RETURNING count
)
SELECT stored.*,
       open_round.id, open_round.number,
       (SELECT id FROM {_VERSIONS}
        WHERE kind = 'client' AND client_id = %(client)s AND round_id = open_round.id),
       (SELECT count FROM hit),
       (SELECT token_hash FROM {ClientToken._meta.db_table}
        WHERE client_id = %(client)s AND revoked_at IS NULL),
       schema.*
FROM (SELECT 1) AS one LEFT JOIN stored ON TRUE LEFT JOIN open_round ON TRUE,
     (SELECT {_FINGERPRINT_COLUMNS}) AS schema
"""

# A replacing submission's earlier version, with what the ORM's cascade would delete or null (one
# statement; only run when there is one: a first submission does not pay for its eight parts).
_REPLACE_SQL = versions_delete_sql("id = %(replaced)s")


def _columns(model, names: list[str]) -> str:
    return ", ".join(model._meta.get_field(name).column for name in names)


# The version and the submission in one statement. The stored response gets the version's id from
# the database; the answer adds the submission's own id.
_INSERT_SQL = f"""
WITH version AS (
    INSERT INTO {_VERSIONS} ({_columns(CompendiumVersion, [
        "kind", "round", "client", "organization", "schema_version", "content", "sha256",
        "size_bytes", "gzip_bytes", "entry_counts", "routing_head", "created_at"])})
    VALUES ('client', %(round)s, %(client)s, NULL, %(schema_version)s, %(content)s::jsonb,
            %(sha256)s, %(size_bytes)s, %(gzip_bytes)s, %(entry_counts)s::jsonb, NULL, %(now)s)
    RETURNING id
)
INSERT INTO {_SUBMISSIONS} ({_columns(Submission, [
    "client", "round", "idempotency_key", "request_sha256", "version", "status_code", "response",
    "scrubbed", "wire_bytes", "content_encoding", "created_at"])})
SELECT %(client)s, %(round)s, %(key)s, %(request_sha256)s, version.id, 201,
       %(response)s::jsonb || jsonb_build_object('version', version.id), %(scrubbed)s,
       %(wire_bytes)s, %(content_encoding)s, %(now)s
FROM version
RETURNING id, version_id
"""


def _no_open_round() -> NoOpenRound:
    """The refusal when no round takes submissions: past the open round's deadline, it says so
    (the round closes at the next `close_due_rounds`)."""
    late = Round.objects.filter(state=Round.State.OPEN, closes_at__lte=timezone.now()).first()
    if late is None:
        return NoOpenRound()
    return NoOpenRound(
        f"round {late.number} stopped taking submissions at its deadline "
        f"({late.closes_at.isoformat()}); it closes shortly"
    )


def submit(
    client: Client,
    wire: bytes,
    idempotency_key: str,
    *,
    content_encoding: str | None = None,
    expected_round: int | None = None,
    token_hash: str | None = None,
) -> Outcome:
    """Store a client's compendium for the open round (or replay the stored outcome of this
    idempotency key). `wire` is the body as it came and `content_encoding` its Content-Encoding
    header (None: plain); it is decoded only once the look-ahead has found the request within
    the client's rate, so a client past its rate costs no decompression. Raises FederationError
    subclasses for every refusal; a compendium without a single entry is one
    (EmptySubmission), so it never replaces the client's earlier submission, and so are numeric
    statistics for a round with a field cap from a compendium that records no cap or a larger
    one (FieldCapExceeded), and statistics for fields the open round will not release, or no
    round releases (kind `other`) (FieldsNotReleased), checked before anything is stored. `expected_round` (the request's
    `X-Synapse-Round` header; None: not sent) is the round the client built and checked the body
    for: another round open is a RoundChanged, nothing stored. A key whose submission a later one
    of the client replaced is not replayed but refused (Replaced): while its round takes
    submissions a new key puts it back in effect; after, nothing can. `token_hash` (None: called by the server itself, not over the API)
    is the hash of the token that authenticated the request: a rotation that committed while the
    body was checked stops it, and nothing is stored (NotAllowed), as for a revocation."""
    key = check_key(idempotency_key)
    limit = max_submission_bytes()
    rate_limit = federation_settings().submissions_per_minute
    window = ratelimit.window(60)
    params = {
        "client": client.pk,
        "key": key,
        "rate_key": f"submit:client:{client.pk}",
        "window_start": window.start,
    }
    with prepared_cursor() as cursor:
        cursor.execute(_LOOK_AHEAD_SQL, params)
        row = cursor.fetchone()
    stored, (count, open_round, not_released, *fingerprint) = (
        row[:_STORED_COLUMNS], row[_STORED_COLUMNS:])
    # This request would be hit number count + 1 of the window: refused past the limit, before
    # any work (a refused request needs no hit: the window stays over the limit). A replay too:
    # its body is decoded to compare it with the key's, which a stored key must not make free.
    if (count or 0) >= rate_limit:
        raise _rate_limited(rate_limit, window)
    if stored[0] is not None:
        _count_refusal(client)  # a hit, as any request past the look-ahead
        body = decoded_body(wire, content_encoding, limit)
        return _replay(stored, hashlib.sha256(body).hexdigest(), expected_round)
    if open_round is None:  # answered before the work of validation; re-checked under lock below
        _count_refusal(client)
        raise _no_open_round()
    if expected_round is not None and expected_round != int(open_round[0]):
        _count_refusal(client)
        raise RoundChanged(
            f"this submission was built and checked for round {expected_round} "
            f"(X-Synapse-Round), but round {int(open_round[0])} is open: build against its "
            "configuration and submit again (nothing was stored)"
        )
    try:
        body = decoded_body(wire, content_encoding, limit)
        if len(body) > limit:
            raise PayloadTooLarge(f"the body is {len(body)} bytes; the limit is {limit} bytes")
    except FederationError:  # not gzip, an unknown dictionary, a bomb: work done, counted
        _count_refusal(client)
        raise
    request_sha256 = hashlib.sha256(body).hexdigest()
    schema = _schema_for(tuple(fingerprint))

    result = validate_compendium(body, schema)
    violations = result.violations if not result.ok else submission_rules(result.compendium)
    if violations:
        _count_refusal(client)
        raise SubmissionInvalid(violations)
    round_cap = int(open_round[2]) if open_round[2] >= 1 else None
    policy = None
    if exceeds_field_cap(result.compendium, round_cap):
        policy = FieldCapExceeded(int(open_round[0]), round_cap, result.compendium.field_cap)
    elif any(withheld := _unreleased_stats(result.compendium, not_released, schema)):
        policy = FieldsNotReleased(int(open_round[0]), *withheld)
    if policy is not None:
        _count_refusal(client)
        _audit_policy(client, int(open_round[0]), policy)
        raise policy
    masker = _masker_for(tuple(fingerprint), schema, open_round[1])
    residue = masking_residue(result.compendium, masker)
    if residue:
        _count_refusal(client)
        _audit_unmasked(client, int(open_round[0]), masker.strength, residue)
        raise UnmaskedText(residue, masker.strength)
    compendium, scrubbed = scrub_compendium(result.compendium)
    if scrubbed:  # a scrubbed text can grow past its limit, merged entries' supports past theirs
        after = validate_compendium(compendium, schema)
        if not after.ok:
            _count_refusal(client)
            raise SubmissionInvalid([
                Violation(v.path, f"after the server's scrub of what looked like personal data: "
                                  f"{v.reason}") for v in after.violations])
    entry_counts = compendium.entry_counts()
    if not any(entry_counts.values()):
        _count_refusal(client)
        raise EmptySubmission()
    form = canonical_form(compendium)

    try:
        with transaction.atomic(), prepared_cursor() as cursor:
            cursor.execute(_LOCK_CLIENT_SQL, params)
            locked = cursor.fetchone()
            if locked is None:
                raise NotAllowed("this client was deleted while its submission was being checked")
            if locked[0] != Client.Status.APPROVED:
                raise NotAllowed(
                    f"this client was {locked[0]} while its submission was being checked; "
                    "nothing was stored"
                )
            cursor.execute(_CLAIM_SQL, params)
            row = cursor.fetchone()
            stored, (round_id, round_number, replaced, count, live_token, *claimed_schema) = (
                row[:_STORED_COLUMNS], row[_STORED_COLUMNS:])
            if token_hash is not None and live_token != token_hash:
                raise NotAllowed(
                    "this client's token was rotated while its submission was being checked: "
                    "the token that sent it no longer works; nothing was stored (submit with "
                    "the new token)"
                )
            if count > rate_limit:  # requests of this client that passed the look-ahead together
                raise _rate_limited(rate_limit, window)
            if stored[0] is not None:  # a concurrent request with this key won the race
                # its hit commits with the answer
                return _replay(stored, request_sha256, expected_round)
            if round_id is None:
                raise _no_open_round()
            if round_number != int(open_round[0]):
                raise RoundChanged(
                    f"round {int(open_round[0])}, which this submission was checked against, "
                    f"stopped taking submissions meanwhile and round {round_number} is open: "
                    "build against its configuration and submit again (nothing was stored)"
                )
            if claimed_schema != fingerprint:
                raise SchemaChanged(
                    "the tool registry or the declared numeric fields changed while this "
                    "submission was being checked: pull the schema, build again and submit "
                    "(nothing was stored)"
                )
            if replaced is not None:
                cursor.execute(_REPLACE_SQL, {"replaced": replaced})
            head = {"round": round_number, "round_id": round_id, "client": client.pk}
            tail = {
                "sha256": form.sha256,
                "size_bytes": form.size_bytes,
                "gzip_bytes": form.gzip_bytes,
                "entry_counts": entry_counts,
                "scrubbed": scrubbed,
                "replaced": replaced is not None,
            }
            cursor.execute(
                _INSERT_SQL,
                {
                    **params,
                    "round": round_id,
                    "schema_version": compendium.schema_version,
                    # The canonical bytes are the stored content's JSON text as they are.
                    "content": form.data.decode("utf-8"),
                    "sha256": form.sha256,
                    "size_bytes": form.size_bytes,
                    "gzip_bytes": form.gzip_bytes,
                    "entry_counts": json.dumps(entry_counts),
                    "now": timezone.now(),
                    "request_sha256": request_sha256,
                    "response": json.dumps({**head, **tail}),
                    "scrubbed": scrubbed,
                    "wire_bytes": len(wire),
                    "content_encoding": encoding_name(content_encoding),
                },
            )
            submission_id, version_id = cursor.fetchone()
    except (NoOpenRound, RoundChanged, SchemaChanged, IdempotencyMismatch, Replaced):
        # The round or schema changed meanwhile, or a concurrent request stored this key (with
        # another body, or since replaced): refused after the work, counted; the hit was rolled
        # back.
        _count_refusal(client)
        raise
    except IntegrityError:
        # Only reachable if the row lock was bypassed: the unique key decides, we replay.
        with prepared_cursor() as cursor:
            cursor.execute(_STORED, params)
            stored = cursor.fetchone()
        if stored is None:
            raise
        return _replay(stored, request_sha256, expected_round)
    response = {"id": submission_id, **head, "version": version_id, **tail}
    return Outcome(201, response, replayed=False)
