"""The round pipeline: edge merges, the server merge, publication, failure, retry and erasure.

Services called by thin Celery tasks (workers/tasks.py) and management commands. Every step is one
database transaction and idempotent: a retried edge merge recomputes the same result from the same
inputs and seed (an edge that comes out the same keeps its row; another replaces it); ledger rows
of the same release are written once. Each step reads again under its locks what it merged from,
and merges again if that changed meanwhile (see run_edge_merge, run_server_merge).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Count
from pydantic import ValidationError

from compendium.canonical import canonical_form
from compendium.models import (
    AnnexEntry,
    CompendiumVersion,
    PrecautionEntry,
    ScenarioEntry,
    StatEntry,
    TemplateEntry,
)
from compendium.schema import Compendium
from compendium.services import current_schema, load_compendium, store_compendium
from federation import accounting, caches, services
from federation.errors import Busy
from federation.merge import (
    BudgetExceeded,
    ConflictEntry,
    MergeInput,
    ProbeSet,
    drowned_fields,
    edge_merge,
    within_schema,
)
from federation.merge import server_merge as server_merge_operator
from federation.merge.llm import OpenAICompatibleLLM, merge_llm
from federation.models import (
    AuditLog,
    Client,
    ConflictDecision,
    ConflictLogEntry,
    FederationSettings,
    MergeRecord,
    Organization,
    PrivacyLedgerEntry,
    ProbeQuery,
    Round,
    Submission,
)
from federation.round_config import RoundConfig
from federation.signals import global_published
from federation.submissions import probe_labels
from routing.models import TunedRouter

log = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A round cannot proceed; the message is the failure reason shown to the operator."""


class StaleAttempt(Exception):
    """A task of an earlier run of the round's pipeline (the operator failed the round and
    retried it since, or failed it while this task ran): it changes nothing and fails nothing."""


def _check_attempt(
    round_: Round, attempt: int | None, *, states: tuple[str, ...] | None = None
) -> None:
    """Under the round's row lock: refuse (StaleAttempt) a step of another run than the round's
    current one (`attempt`; None: a direct call, not a task, which is always current) or of a
    round that is no longer in one of `states` (None: any state)."""
    if attempt is not None and attempt != round_.attempt:
        raise StaleAttempt(
            f"round {round_.number}: a task of run {attempt}, the round is on run {round_.attempt}"
        )
    if states is not None and round_.state not in states:
        raise StaleAttempt(f"round {round_.number} is {round_.state} now")


# --- shared inputs -------------------------------------------------------------------------------


def _embed():
    from routing.embeddings import get_engine

    return get_engine(settings.SYNAPSE_EMBEDDING_MODEL or None).embed


def configured_llm() -> OpenAICompatibleLLM | None:
    """The merge's LLM endpoint, each question bounded (`merge_llm`), or None without one."""
    if not settings.SYNAPSE_LLM_BASE_URL:
        return None
    return merge_llm(
        settings.SYNAPSE_LLM_BASE_URL,
        settings.SYNAPSE_LLM_MODEL or "default",
        settings.SYNAPSE_LLM_API_KEY,
    )


def probe_pairs() -> list[tuple[str, str]]:
    """The public probe set as (request, tool id), in the order every server step reads it:
    the requests labelled with a tool of the registry in force. A head or tuned router learns
    the probe's tools too, so a tool deactivated (or never registered) that the probe still
    labels would be routed to; and the probe's accuracy would count requests nobody can route."""
    return [(text, tool) for text, tool in probe_labels() if tool is not None]


def load_probe_set(embed=None) -> ProbeSet | None:
    rows = probe_pairs()
    if not rows:
        return None
    texts = [r[0] for r in rows]
    return ProbeSet(texts, [r[1] for r in rows], (embed or _embed())(texts))


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _noise_secret() -> int:
    """The server's secret part of every noise seed (SYNAPSE_NOISE_SECRET, else derived from
    SECRET_KEY), as a 256-bit integer."""
    from django.utils.crypto import salted_hmac

    secret = settings.SYNAPSE_NOISE_SECRET or settings.SECRET_KEY
    digest = salted_hmac("synapse.edge-noise", "seed", secret=secret, algorithm="sha256").digest()
    return int.from_bytes(digest, "big")


def noise_key_id() -> str:
    """A one-way name of the noise secret in force (`_noise_secret`): an edge's merge record
    keeps it, so that a release is replayed only under the secret it was drawn with. A secret
    rotated since (SECRET_KEY, when SYNAPSE_NOISE_SECRET is not set) would draw other noise over
    the same inputs under the same release number, with its ε charged once."""
    secret = _noise_secret().to_bytes(32, "big")
    return hashlib.sha256(b"synapse.noise-key-id\x00" + secret).hexdigest()[:16]


def edge_seed(config: RoundConfig, round_: Round, organization: Organization, release: int):
    """The noise seed of one edge release: fixed by the round's seed, so a replay (or a retry after
    a worker died) on this server draws the same noise. The round's seed, its number and the slug
    are known to every client (the rounds API shows the configuration), so the server's secret is
    mixed in: without it anyone could redraw the noise and remove it from the published figures."""
    return np.random.SeedSequence(
        [config.seed, round_.number, _stable_int(organization.slug), release, _noise_secret()]
    )


def _config(round_: Round) -> RoundConfig:
    return RoundConfig(**(round_.config or {}))


# --- round state ---------------------------------------------------------------------------------


# Every change of a round's state goes through the audited services (services.mark_merging,
# mark_published, mark_failed: the state machine's checks and one audit entry each, by the system
# actor "merge pipeline"), inside the pipeline step's own transaction and under its row lock, so a
# step that fails leaves neither the state nor its audit entry behind.

FAILABLE = (Round.State.CLOSING, Round.State.MERGING)


def fail_round(round_id: int, reason: str, attempt: int | None = None, *,
               briefly: bool = False) -> None:
    """A closing or merging round -> failed, with the reason (audited as round.fail). A round in
    another state is left as it is: a published round stays published, a failed one keeps the
    reason it failed with first (the one its audit entry records); so is a round on another run
    of the pipeline than `attempt` (a late failure of an earlier run does not fail the retry).
    `briefly`: the round's lock is waited for SYNAPSE_LOCK_WAIT_SECONDS at most, and a round
    still locked then is left as it is, logged (a worker's main process failing the round of a
    task it is about to kill, which may hold that lock: waiting for it would hang the worker)."""
    try:
        with transaction.atomic(), (
            services.waiting_briefly("fail the round") if briefly else contextlib.nullcontext()
        ):
            failed = _fail_locked(round_id, reason, attempt)
    except Busy as busy:
        log.warning("round %s not failed (%s): %s", round_id, busy, reason)
        return
    if failed:
        log.warning("round %s failed: %s", round_id, reason)


def _fail_locked(round_id: int, reason: str, attempt: int | None) -> bool:
    round_ = Round.objects.select_for_update().get(pk=round_id)
    if attempt is not None and attempt != round_.attempt:
        log.warning("round %s is on run %s, not failed by run %s: %s",
                    round_id, round_.attempt, attempt, reason)
        return False
    if round_.state not in FAILABLE:
        log.warning("round %s is %s, not failed again: %s", round_id, round_.state, reason)
        return False
    services.mark_failed(round_, reason[:2000])
    return True


def organizations_with_submissions(round_: Round) -> list[int]:
    return sorted(
        set(services.submissions_to_merge(round=round_).values_list(
            "client__organization_id", flat=True))
    )


def start_round(round_id: int, attempt: int | None = None) -> list[int]:
    """closing -> merging; the organizations whose edges merge. A round that would exceed the
    privacy budget fails here, before any merge runs or any noise is drawn. A start of an earlier
    run than the round's (`attempt`), or of a round no longer closing or merging (the operator
    failed it first, or a chord an earlier delivery dispatched published it), raises
    StaleAttempt, as the edge and server merges of such a run do."""
    with transaction.atomic():
        # The publication lock first, then the round's, as every merge's write and an erasure
        # take them: the start deletes edges (with their provenance links) that an erasure may
        # be rewriting. An erasure deletes its client's submissions, and their links to the
        # edges, before it locks the rounds it merges again; a start that locked the round and
        # then waited for those links while the erasure waited for the round was a deadlock,
        # which PostgreSQL broke by failing the round or the erasure.
        services.lock_publication()
        round_ = Round.objects.select_for_update().get(pk=round_id)
        if attempt is not None:  # a task: its run over, it writes nothing and fails nothing
            _check_attempt(round_, attempt, states=(Round.State.CLOSING, Round.State.MERGING))
        if round_.state not in (Round.State.CLOSING, Round.State.MERGING):
            raise PipelineError(f"round {round_.number} is {round_.state}, not closing")
        config = _config(round_)
        organizations = organizations_with_submissions(round_)
        if not organizations:
            reason = f"round {round_.number} has no submissions to merge"
        else:
            # The round is already part of the committed composition (its reservation, or its
            # ledger rows after a partial merge): check that figure, without adding it again.
            exceeded, projected = accounting.would_exceed()
            reason = (
                f"privacy budget exceeded: round {round_.number} (ε = {config.epsilon:g}) would "
                f"bring the federation's committed ε′ to {projected.epsilon:.6g} "
                f"({projected.tighter} composition), above its epsilon budget of "
                f"{accounting.epsilon_budget():.6g}"
                if exceeded
                else ""
            )
        if reason:
            services.mark_failed(round_, reason)
            return []
        # An edge of an earlier run of the pipeline (a retry) for an organization whose clients
        # have all been revoked since: no edge merge replaces it, and the server merge reads
        # every edge of the round, so it would publish what those clients sent.
        for model, kind in ((CompendiumVersion, {"kind": "edge"}), (ConflictLogEntry, {}),
                            (MergeRecord, {})):
            model.objects.filter(round=round_, organization__isnull=False, **kind).exclude(
                organization_id__in=organizations).delete()
        if round_.state == Round.State.CLOSING:  # a re-delivered start finds it merging already
            services.mark_merging(round_)
    return organizations


# --- the edge merge ------------------------------------------------------------------------------


def _conflict_source(round_: Round, organization) -> Round | None:
    """The round whose conflict log of this edge (the server's when `organization` is None) the
    merge of `round_` reads (`_previous_conflicts`): the latest published round before `round_`
    that it merged in. Not simply the round before: an organization that sat a round out, or a
    round that failed, would otherwise lose the log (and the reviewers' decisions) for good. A
    merge that accepted no source (every submission rejected, or erased since) published nothing
    of the precautions it composed, so the log it read is still the one to read."""
    record = (
        MergeRecord.objects.filter(round__number__lt=round_.number,
                                   round__state=Round.State.PUBLISHED, organization=organization)
        .exclude(stats__contains={"accepted": 0})
        .select_related("round")
        .order_by("-round__number")
        .first()
    )
    return record.round if record is not None else None


def merged_under_flag_rule(round_: Round | int | None, organization) -> bool:
    """Whether the merge of `round_` for `organization`'s edge (the server's when None) held the
    precondition flag names to the operator's source rule (`operator.FLAG_MIN_SOURCES`): its
    record counts the names it held back (`flags_held_back`). A compendium or conflict log merged
    before the rule may hold one client's flag name; the merge that reads it holds those names to
    its own sources (`server_merge(previous_flags_released=...)`, `conflicts_flags_released`),
    and a review composes its precautions with its own entries' sources
    (`conflicts.composed_precaution`). `round_` and `organization` may be ids. True without a
    round: nothing is read."""
    if round_ is None:
        return True
    return MergeRecord.objects.filter(
        round=round_, organization=organization, stats__has_key="flags_held_back"
    ).exists()


def merged_under_flag_rule_each(pairs) -> set[tuple]:
    """Of `pairs` of (round id, organization id), those whose merge `merged_under_flag_rule`:
    one query for all of them."""
    pairs = set(pairs)
    if not pairs:
        return set()
    return set(
        MergeRecord.objects.filter(
            round_id__in={r for r, _ in pairs}, stats__has_key="flags_held_back"
        ).values_list("round_id", "organization_id")
    ) & pairs


def _previous_conflicts(round_: Round, organization) -> list[ConflictEntry]:
    """The conflict log the merge of `round_` turns into precautions (`_conflict_source`), with
    its reviewers' decisions: dismissed conflicts left out."""
    return _conflicts_of(_conflict_source(round_, organization), organization)


def _conflicts_of(previous: Round | None, organization) -> list[ConflictEntry]:
    """The conflict log of `previous`'s merge of this edge (the server's when `organization` is
    None; nothing without a round), with its reviewers' decisions: dismissed conflicts left out.
    An accepted precaution that is no longer the one composed (`conflicts.accept_out_of_date`:
    accepted before the review held a log merged before the flag rule to its sources, it may
    name one client's flag) counts as no decision: the merge composes it as it is now."""
    from federation.conflicts import accept_out_of_date, composed_precaution

    if previous is None:
        return []
    decisions = {
        (d.tool_id, d.centroid_id): d
        for d in ConflictDecision.objects.filter(round=previous, organization=organization)
    }
    schema = (current_schema() if any(d.action == ConflictDecision.Action.ACCEPT
                                       for d in decisions.values()) else None)
    released = merged_under_flag_rule(previous, organization)
    entries = []
    for c in ConflictLogEntry.objects.filter(round=previous, organization=organization):
        decision = decisions.get((c.tool_id, c.centroid_id))
        resolution, text, winner_tool = "", "", ""
        if decision is not None and not (
            decision.action == ConflictDecision.Action.ACCEPT
            and accept_out_of_date(decision, composed_precaution(c, schema, flags_released=released))
        ):
            if decision.action == ConflictDecision.Action.DISMISS:
                continue
            resolution = "scenario" if decision.action == ConflictDecision.Action.SCENARIO else "precaution"
            text = decision.text
            if resolution == "scenario":
                winner_tool = decision.winner_tool_id
        entries.append(
            ConflictEntry(c.tool_id, c.centroid_id, c.centroid, c.dissenters, c.reason, resolution,
                          text, winner_tool)
        )
    return entries


def _schema_digest(schema) -> str:
    """The whole schema in force: an edge merge that finds it changed under its locks merges
    again (the edge carries the registry's descriptions and specs too). Merge records made
    before 2026-12-03 name a release's schema by it."""
    return hashlib.sha256(schema.model_dump_json().encode("utf-8")).hexdigest()[:16]


def _release_digest(schema) -> str:
    """What the numeric release of an edge depends on besides its inputs: the tools and the
    declared fields (which statistics are drawn, in which order, at which scale) and the limits
    its inputs are validated with. Not a tool's name, description, category or spec, nor a
    field's unit or description, which change no statistic: until 2026-12-03 the whole schema
    was compared, and an edit of a tool's description (the admin, `import_tools` with an updated
    catalogue) made the next replay of a release (a redelivered or retried edge task, an
    erasure's replay of a later edge) a new release, with fresh noise and its ε charged again."""
    drawn = {
        "version": schema.version,
        "tools": [t.tool_id for t in schema.tools],
        "numeric_fields": [f.model_dump(mode="json", exclude={"unit", "description"})
                           for f in schema.numeric_fields],
        "strings": schema.strings.model_dump(mode="json"),
        "limits": schema.limits.model_dump(mode="json"),
    }
    return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def _release_number(
    round_: Round, organization: Organization, rematerialize: bool, inputs: list[int],
    schema_digest: str = "", noise_key: str = "", legacy_digest: str | None = None,
) -> tuple[int, bool]:
    """The release this edge merge makes, and whether it is one beyond the round's first (ε the
    round did not reserve). 0 for the first; the last one again for a replay of it (a retry, a
    task delivered twice) over exactly the inputs and schema that release was made from, which
    redraws the same noise and so tells nothing new; a new one, with fresh noise and its own ε,
    for a re-materialization or when the inputs (`inputs`: the client versions merged) or the
    schema (`schema_digest`, `_release_digest`: a tool or numeric field added, removed or
    changed; a record made before it was kept names `_schema_digest`, `legacy_digest`) differ from the
    last release's (a client revoked meanwhile): the same noise over other inputs, or drawn for
    other statistics in another order, would let anyone who saw both releases difference it away.
    So for the noise secret (`noise_key`, `noise_key_id`): under another one a replay would draw
    other noise over the same inputs, a second release charged as none. A record from before
    the key was recorded is taken as made under the secret in force.

    The last release is the larger of the ledger's last and the edge's merge record's: a release
    whose numeric statistics were withheld (an erasure past the budget) writes no ledger rows but
    takes its number all the same, and what it was made from is in the record (`release`,
    `inputs`, `schema`), which always describes the edge's latest merge. Only that release is
    ever replayed, and only when the record names it: an earlier release's noise is never drawn
    again over what a later release was made from."""
    last = (
        PrivacyLedgerEntry.objects.filter(round=round_, organization=organization)
        .order_by("-release")
        .values_list("release", flat=True)
        .first()
    )
    record = MergeRecord.objects.filter(round=round_, organization=organization).first()
    made = record.stats if record is not None else {}
    recorded = made.get("release")
    if last is None and recorded is None:
        return 0, False
    top = max(r for r in (last, recorded) if r is not None)
    if rematerialize:
        return top + 1, True
    if (recorded == top and made.get("inputs") == inputs
            and made.get("schema") in (schema_digest, legacy_digest or schema_digest)
            and made.get("noise_key", noise_key) == noise_key):
        return top, top > 0  # a replay; beyond release 0 it is ε the round did not reserve
    return top + 1, True


@dataclass(frozen=True)
class EdgeOutcome:
    version_id: int | None
    sha256: str | None
    accepted: int
    rejected: int


def _drowned(round_: Round, schema, config: RoundConfig) -> frozenset[str]:
    """The numeric fields no edge of the round releases: those the round named when it opened
    (clients left them out), and `drowned_fields` from its submissions: the most any
    organization has (an upper bound on an edge's accepted K) and how many organizations
    submitted (at most the edges the server averages)."""
    per_organization = list(
        services.submissions_to_merge(round=round_)
        .order_by()
        .values("client__organization")
        .annotate(n=Count("id"))
        .values_list("n", flat=True)
    )
    drowned = drowned_fields(schema, config, max(per_organization, default=0), len(per_organization))
    return drowned | frozenset(round_.fields_not_released or ())


# How many times a merge is computed again when what it read changed before it could write (an
# edge replaced or an erasure committed meanwhile) before it gives up with a PipelineError.
MERGE_TRIES = 3


def _edge_sources(round_: Round, organization: Organization) -> list[CompendiumVersion]:
    """The client submissions this edge merge reads (`services.submissions_to_merge`). Of a
    published round (merged again only by an erasure: of its edge, or as a replay of a later
    one) also those of clients revoked since that its last merge read (its record's `inputs`):
    a revocation takes nothing out of a published round, and erasing another client must not
    either (nor turn the replay of a release into a new one, with fresh noise and its own ε)."""
    versions = services.submissions_to_merge(round=round_, client__organization=organization)
    if round_.state == Round.State.PUBLISHED:
        made = (MergeRecord.objects.filter(round=round_, organization=organization)
                .values_list("stats", flat=True).first()) or {}
        read = made.get("inputs")
        if isinstance(read, list) and read:
            versions = versions | CompendiumVersion.objects.filter(
                kind=CompendiumVersion.Kind.CLIENT, round=round_,
                client__organization=organization, pk__in=read)
    return list(versions.select_related("client").order_by("client_id"))


def _as_schema_reads(content: dict, schema) -> Compendium | dict:
    """A stored client submission as the schema in force reads it (`within_schema`). It was
    checked against the schema when it arrived; a tool deactivated, or a numeric field removed or
    narrowed, while the round was open made it invalid at the merge, and the edge rejected the
    honest client's every entry with it. Statistics are clipped into the range in force before
    the noise, whose scale that range sets. Content that does not parse is left as stored: the
    merge rejects it, naming why."""
    try:
        return within_schema(Compendium.model_validate(content), schema)
    except ValidationError:
        return content


def run_edge_merge(
    round_id: int, organization_id: int, *, rematerialize: bool = False, embed=None,
    attempt: int | None = None,
) -> EdgeOutcome:
    """Merge one organization's submissions of a round into its edge compendium (one
    transaction). Without client submissions left, the edge version is removed. A task of the
    pipeline passes its run (`attempt`): a task of another run than the round's, or of a round
    that is no longer merging, raises StaleAttempt and writes nothing (None: a direct call, an
    erasure's re-materialization or a replay, which any state allows).

    A replay whose edge comes out the same (sha256 and sources) keeps the stored edge row, so a
    server merge that read it meanwhile still finds it. The inputs, the release, the round whose
    conflict log it read and what that log holds are read again under the publication lock and
    the round's: changed meanwhile (a client revoked or erased, another merge of this edge
    committed, an earlier round published, an erasure that merged the log again), the merge is
    computed again (MERGE_TRIES times at most)."""
    round_ = Round.objects.get(pk=round_id)
    if attempt is not None:
        # A task of a run that is over (the round failed, or was retried since) stops here: the
        # check under the lock would refuse its write only after the whole merge (the LLM's
        # summaries included) had been computed for nothing.
        _check_attempt(round_, attempt, states=(Round.State.MERGING,))
    organization = Organization.objects.get(pk=organization_id)
    config = _config(round_)
    embed = embed or _embed()
    probe = load_probe_set(embed)
    llm = configured_llm()
    for _ in range(MERGE_TRIES):
        schema = current_schema()
        digest, drawn = _schema_digest(schema), _release_digest(schema)
        key = noise_key_id()
        sources = _edge_sources(round_, organization)
        source_ids = [v.pk for v in sources]
        # A release beyond the round's first (`extra`) is ε the round did not reserve: an
        # erasure's, or a retry's over changed inputs. Over the budget it is made without numeric
        # statistics.
        release, extra = _release_number(round_, organization, rematerialize, source_ids, drawn,
                                         key, digest)
        remaining = accounting.remaining_for_release(round_.pk, organization.pk, release)
        inputs = [MergeInput(f"client:{v.client_id}", _as_schema_reads(v.content, schema))
                  for v in sources]
        # The round whose conflict log this merge turns into precautions, and what that log
        # holds, read once: under the locks below both are read again and compared (an earlier
        # round published, or an erasure merged the log again, meanwhile).
        log_from = _conflict_source(round_, organization)
        log_read = _conflicts_of(log_from, organization)
        common = dict(
            embed=embed,
            probe_set=probe,
            llm=llm,
            seed=edge_seed(config, round_, organization, release),
            drowned=_drowned(round_, schema, config),
            conflicts_flags_released=merged_under_flag_rule(log_from, organization),
        )

        def merge(remaining: float, inputs=inputs, schema=schema, common=common, extra=extra,
                  log_read=log_read):
            """The edge merge within `remaining` ε, and why its numeric releases were withheld."""
            try:
                return edge_merge(inputs, schema, config, log_read,
                                  epsilon_remaining=remaining, **common), ""
            except BudgetExceeded as exc:
                if not extra:
                    raise
                # An erasure (or a retry over changed inputs) must not be blocked by the budget:
                # merge without numeric releases.
                return edge_merge(inputs, schema, config, log_read,
                                  epsilon_remaining=remaining, release_numeric=False,
                                  **common), str(exc)

        result, withheld = merge(remaining)
        by_source = {f"client:{v.client_id}": v for v in sources}
        with transaction.atomic():
            # The publication lock first (as the server merge and an erasure take it): no earlier
            # round publishes between the check of the conflict log read below and the commit.
            services.lock_publication()
            locked = Round.objects.select_for_update().get(pk=round_id)
            if attempt is not None:  # a task of the pipeline: its run, and the round still merging
                _check_attempt(locked, attempt, states=(Round.State.MERGING,))
            now_ids = [v.pk for v in _edge_sources(round_, organization)]
            now_digest = _schema_digest(current_schema())
            if (now_ids, now_digest) != (source_ids, digest) or _release_number(
                round_, organization, rematerialize, source_ids, drawn, key, digest
            ) != (release, extra) or _conflict_source(round_, organization) != log_from or (
                _conflicts_of(log_from, organization) != log_read
            ) or merged_under_flag_rule(log_from, organization) != common["conflicts_flags_released"]:
                # An earlier round published meanwhile (a retried round merging beside this
                # one) changes the conflict log this edge turns into precautions: the next
                # round reads this round's log, so the earlier one's would be lost for good. An
                # erasure that merged that log again meanwhile changes what it holds: this edge
                # had no merge record yet, so the erasure could not reach it as a reader, and it
                # would write the erased client's dissent as a precaution. Merged again, that log
                # may also be held to the flag rule now, or no longer.
                log.warning("round %s, organization %s: the edge's inputs, release or previous "
                            "conflict log changed while it merged; merged again", round_.number,
                            organization.slug)
                continue
            outcome = _write_edge(round_, organization, result, withheld, release, extra,
                                  remaining, merge, by_source, source_ids, drawn, key)
        return outcome
    raise PipelineError(
        f"round {round_.number}: the edge merge of organization {organization.slug} found its "
        f"inputs changed (clients revoked or erased, or another merge of the edge) each of the "
        f"{MERGE_TRIES} times it ran; retry the round"
    )


def _write_edge(round_, organization, result, withheld, release, extra, remaining, merge,
                by_source, source_ids, digest, key) -> EdgeOutcome:
    """Write one edge merge, in the caller's transaction and under its round's lock."""
    if extra and result.ledger:
        # A new release, beyond what the round reserved: checked again under the lock that
        # opening a round, retrying one and changing the budget take, so that none of them
        # commits ε the release takes meanwhile (or the release ε they take).
        FederationSettings.objects.select_for_update().get(pk=services.get_settings().pk)
        now_remaining = accounting.remaining_for_release(round_.pk, organization.pk, release)
        if now_remaining < remaining:
            result, withheld = merge(now_remaining)
    stored = CompendiumVersion.objects.filter(kind="edge", round=round_, organization=organization)
    sources = [by_source[s] for s in result.accepted_sources]
    version = None
    if result.accepted_sources:
        same = stored.filter(sha256=canonical_form(result.compendium).sha256).first()
        if same is not None and {v.pk for v in same.sources.all()} == {v.pk for v in sources}:
            # A replay that comes out the same keeps the row: a server merge may have read it.
            version = same
    stored.exclude(pk=version.pk if version else None).delete()
    ConflictLogEntry.objects.filter(round=round_, organization=organization).delete()
    MergeRecord.objects.filter(round=round_, organization=organization).delete()
    if result.accepted_sources and version is None:
        version = store_compendium(
            result.compendium,
            kind="edge",
            round=round_,
            organization=organization,
            sources=sources,
            scenario_embeddings=result.scenario_embeddings,
            precaution_embeddings=result.precaution_embeddings,
        )
    PrivacyLedgerEntry.objects.bulk_create(
        [
            PrivacyLedgerEntry(round=round_, organization=organization, release=release,
                               **entry.as_dict())
            for entry in result.ledger
        ],
        ignore_conflicts=True,  # a replay of the same release records it once
    )
    ConflictLogEntry.objects.bulk_create(
        [
            ConflictLogEntry(round=round_, organization=organization, tool_id=c.tool_id,
                             centroid_id=c.centroid_id, centroid=c.centroid,
                             dissenters=c.dissenters, reason=c.reason)
            for c in result.conflicts
        ]
    )
    stats = result.stats.as_dict()
    stats["release"] = release
    stats["inputs"] = source_ids
    stats["schema"] = digest
    stats["noise_key"] = key
    if withheld:
        stats["numeric_withheld"] = withheld
    MergeRecord.objects.create(
        round=round_,
        organization=organization,
        stats=stats,
        rejected=[{"source": r.source, "reasons": r.reasons[:20]} for r in result.rejected],
        flagged=[f.__dict__ for f in result.flagged],
    )
    return EdgeOutcome(
        version.pk if version else None,
        version.sha256 if version else None,
        len(result.accepted_sources),
        len(result.rejected),
    )


# --- the server merge and publication ------------------------------------------------------------


def probe_accuracy(probe: ProbeSet | None, scenario_tools: list[str], vectors) -> float | None:
    """Top-1 accuracy of cosine routing over the compendium's scenarios on the probe set."""
    if probe is None or vectors is None or not len(scenario_tools):
        return None
    best = np.argmax(probe.vectors @ np.asarray(vectors).T, axis=1)
    predicted = np.asarray(scenario_tools, dtype=object)[best]
    return float(np.mean(predicted == np.asarray(probe.labels, dtype=object)))


def routing_head(
    compendium, scenario_embeddings, embed, probe: ProbeSet | None = None, *,
    precaution_embeddings=None,
) -> bytes | None:
    """The serialized linear head the routing API uses with this global (None: fewer than two
    tools, or no embeddings); clients download it with the global
    (`GET /api/v1/compendium/global/head/`). With the public probe set it also learns the
    probe's tools and carries the fusion weights fitted with it (`routing.router
    .fit_published_head`, queries embedded by the routing API's query engine)."""
    from routing.router import fit_published_head
    from routing.services import query_engine

    if scenario_embeddings is None or not len(compendium.scenarios):
        return None
    pairs = list(zip(probe.texts, probe.labels, strict=True)) if probe is not None else []
    head = fit_published_head(
        compendium, scenario_embeddings, embed, query_engine() if pairs else None, pairs,
        probe_vectors=probe.vectors if pairs else None,
        precaution_embeddings=precaution_embeddings,
    )
    return head.to_bytes() if head is not None else None


def previous_global(round_: Round) -> CompendiumVersion | None:
    """The global compendium of the latest published round before `round_` (what its clients
    pulled), or None."""
    return (
        CompendiumVersion.objects.filter(
            kind="global",
            round__number__lt=round_.number,
            round__state=Round.State.PUBLISHED,
        )
        .order_by("-round__number")
        .first()
    )


def _edge_source(slug: str) -> str:
    """The name an organization's edge compendium goes by as a server-merge input."""
    return f"org:{slug}"


def _edge_noise_scales(round_: Round) -> dict[str, dict[tuple[str, str], float]]:
    """Per edge (`_edge_source`, its server-merge input) and (tool, field), the scale of the
    Laplace noise of its latest release in `round_` (an erasure's re-release replaces the
    earlier): the server publishes the average without the digits below its noise."""
    scales: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
    for slug, tool, field, scale in (
        PrivacyLedgerEntry.objects.filter(round=round_)
        .order_by("organization__slug", "release")
        .values_list("organization__slug", "tool_id", "field", "noise_scale")
    ):
        scales[_edge_source(slug)][(tool, field)] = scale  # a later release overwrites
    return dict(scales)


def _server_inputs(round_: Round, config: RoundConfig, *, lock: bool = False):
    """The edges of a round's server merge and the previous global it carries forward (None
    without carry-forward, or before any published global); with `lock`, the edges are locked
    (to the end of the calling transaction)."""
    edges = CompendiumVersion.objects.filter(kind="edge", round=round_)
    if lock:
        edges = edges.select_for_update(of=("self",))
    edges = list(edges.select_related("organization").order_by("organization__slug"))
    previous = previous_global(round_) if config.carry_forward else None
    return edges, previous


def _edges_with_revoked_clients(round_: Round) -> list[int]:
    """The organizations whose edge of `round_` holds a submission of a client revoked since
    that edge was merged (the edge merge leaves out the clients revoked when it runs)."""
    return sorted(set(
        CompendiumVersion.objects.filter(
            kind="edge", round=round_, sources__client__status=Client.Status.REVOKED
        ).values_list("organization_id", flat=True)
    ))


def _fingerprint(round_: Round, edges, previous) -> tuple:
    """What a server merge read: its edges, the global it carries forward, the latest published
    round before it, whether the server conflict log it turns into precautions was merged under
    the flag rule, and that log (the last element: an erasure may merge that log again while the
    round carries no global forward, and so change both)."""
    latest = (
        Round.objects.filter(number__lt=round_.number, state=Round.State.PUBLISHED)
        .order_by("-number").values_list("pk", flat=True).first()
    )
    log_from = _conflict_source(round_, None)
    return (
        [(e.pk, e.sha256) for e in edges],
        (previous.pk, previous.sha256) if previous is not None else None,
        latest,
        merged_under_flag_rule(log_from, None),
        _conflicts_of(log_from, None),
    )


def run_server_merge(round_id: int, *, embed=None, attempt: int | None = None) -> str:
    """Merge the round's edge compendiums into the global one and publish it (one transaction:
    a merging round becomes published, audited; a published round's global is merged again, as an
    erasure does; a round in another state is refused). Returns the global compendium's sha256.
    A task of another pipeline run than the round's (`attempt`) raises StaleAttempt and writes
    nothing.

    The merge is computed outside the transaction; the write takes the publication lock
    (`services.lock_publication`, which an erasure holds throughout) and the round's, and reads
    the edges (locked) and the previous global again: if either changed meanwhile (an edge merged
    again over other inputs, an erasure that re-merged or deleted the previous global, an earlier
    round published since), the merge is computed again over what is there now, MERGE_TRIES
    times at most, then fails with a PipelineError that says so. A global is thus never written
    over edges that are gone, nor carries forward a global that is not the latest published.

    Of a merging round, an edge that holds a submission of a client revoked since it was merged
    is merged again first (`run_edge_merge`: a new release without that client), and so is one
    whose client is revoked while the server merge computes (seen under the locks). A published
    round's global, merged again by an erasure, is not re-merged for revocations."""
    round_ = Round.objects.get(pk=round_id)
    if attempt is not None:
        # A task of a run that is over (the round failed, or was retried since) stops here: the
        # check under the lock would refuse its write only after the whole merge (the LLM's
        # summaries included) had been computed for nothing.
        _check_attempt(round_, attempt, states=(Round.State.MERGING,))
    config = _config(round_)
    embed = embed or _embed()
    probe = load_probe_set(embed)
    for _ in range(MERGE_TRIES):
        if round_.state == Round.State.MERGING:
            # A client revoked after its organization's edge was merged: that edge is merged
            # again without it (a new release) before the round publishes. (A published round's
            # global, merged again by an erasure, keeps what it published.)
            for organization_id in _edges_with_revoked_clients(round_):
                run_edge_merge(round_.pk, organization_id, embed=embed, attempt=attempt)
        edges, previous = _server_inputs(round_, config)
        read = _fingerprint(round_, edges, previous)
        if not edges:
            raise PipelineError(f"round {round_.number}: no edge accepted any submission")
        schema = current_schema()
        digest = _schema_digest(schema)
        result = server_merge_operator(
            [MergeInput(_edge_source(e.organization.slug), load_compendium(e)) for e in edges],
            schema,
            config,
            embed=embed,
            probe_set=probe,
            llm=configured_llm(),
            previous=load_compendium(previous) if previous is not None else None,
            previous_conflicts=read[-1],
            noise_scales=_edge_noise_scales(round_),
            previous_flags_released=(previous is None
                                     or merged_under_flag_rule(previous.round, None)),
            conflicts_flags_released=read[-2],
        )
        accuracy = probe_accuracy(
            probe, [s.tool_id for s in result.compendium.scenarios], result.scenario_embeddings
        )
        head = routing_head(
            result.compendium, result.scenario_embeddings, embed, probe,
            precaution_embeddings=result.precaution_embeddings,
        )
        with transaction.atomic():
            # The publication lock first, then the round's: the order an erasure takes them in.
            services.lock_publication()
            locked = Round.objects.select_for_update().get(pk=round_id)
            if attempt is not None:
                _check_attempt(locked, attempt, states=(Round.State.MERGING,))
            if locked.state not in (Round.State.MERGING, Round.State.PUBLISHED):
                # a published round's global is re-merged (an erasure); nothing else is merged
                raise PipelineError(f"round {locked.number} is {locked.state}, not merging")
            # The schema too, as the edge merge checks it: a tool deactivated (or deleted, a
            # KeyError at the write) in the admin while the merge computed was published.
            if _fingerprint(locked, *_server_inputs(locked, config, lock=True)) != read or (
                locked.state == Round.State.MERGING and _edges_with_revoked_clients(locked)
            ) or _schema_digest(current_schema()) != digest:
                log.warning("round %s: its edges, the previous global or the schema changed, or a "
                            "client of an edge was revoked, while its server merge ran; merged "
                            "again", round_.number)
                continue
            return _write_global(locked, result, edges, previous, accuracy, probe, head)
    raise PipelineError(
        f"round {round_.number}: its edges, the previous global it carries forward or the schema "
        f"changed (an edge merged again, a client revoked, an erasure, an earlier round "
        f"published, a tool or numeric field changed) each "
        f"of the {MERGE_TRIES} times its server merge ran; retry the round"
    )


def _write_global(locked: Round, result, edges, previous, accuracy, probe, head) -> str:
    """Write and publish a server merge, in the caller's transaction under its locks."""
    CompendiumVersion.objects.filter(kind="global", round=locked).delete()
    ConflictLogEntry.objects.filter(round=locked, organization__isnull=True).delete()
    MergeRecord.objects.filter(round=locked, organization__isnull=True).delete()
    version = store_compendium(
        result.compendium,
        kind="global",
        round=locked,
        sources=edges + ([previous] if previous is not None else []),
        scenario_embeddings=result.scenario_embeddings,
        precaution_embeddings=result.precaution_embeddings,
        routing_head=head,
    )
    ConflictLogEntry.objects.bulk_create(
        [
            ConflictLogEntry(round=locked, organization=None, tool_id=c.tool_id,
                             centroid_id=c.centroid_id, centroid=c.centroid,
                             dissenters=c.dissenters, reason=c.reason)
            for c in result.conflicts
        ]
    )
    MergeRecord.objects.create(
        round=locked,
        organization=None,
        stats=result.stats.as_dict(),
        rejected=[{"source": r.source, "reasons": r.reasons[:20]} for r in result.rejected],
        flagged=[f.__dict__ for f in result.flagged],
        accuracy=accuracy,
        probe_queries=len(probe) if probe else 0,
    )
    if locked.state == Round.State.MERGING:
        locked = services.mark_published(locked)
    # robust: the global is published once this commits; a receiver that fails after (the
    # broker down when the router's tuning is queued) is logged, and neither turns the
    # publication into a failure nor keeps the other hooks of the transaction (an erasure
    # re-publishes several globals in one) from running.
    transaction.on_commit(
        lambda: global_published.send(sender=Round, round=locked, version=version), robust=True
    )
    return version.sha256


# --- right to erasure ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ErasureReport:
    client: str
    submissions_removed: int
    edges_rematerialized: list[tuple[int, int]]  # (round number, organization id)
    globals_rematerialized: list[int]  # round numbers
    decisions_removed: int = 0  # reviewers' decisions that no longer fit a re-merged log
    # edges of failed rounds that can never be retried, deleted rather than re-merged
    edges_deleted: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # edges merged again without a submission left, and so removed (not in edges_rematerialized)
    edges_removed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # published rounds left without an edge, whose global was removed (not in
    # globals_rematerialized)
    globals_removed: list[int] = dataclasses.field(default_factory=list)
    # the client's Submission rows (idempotency keys, request hashes, wire sizes, stored answers),
    # of its submissions in effect and of those it replaced
    submission_records_removed: int = 0


def erase_client(client: Client, *, actor: services.Actor | None = None, embed=None) -> ErasureReport:
    """Remove every submission of one client (its compendium versions, and its Submission rows:
    request hashes, sizes and the answers stored for replays) and merge again, in round order,
    every compendium that held what it sent:
    - each edge built from its submissions (found through the provenance links), as a new
      release; the ledger keeps the budget already spent. Except an edge of a failed round that
      can never be retried (a later round is published: `services.published_after`): nothing
      reads it (no global, no later merge's conflict log), so a new release would only spend ε
      on a compendium nobody reads; it is deleted with its conflict log and merge record;
    - each later merge that read a re-merged conflict log and now reads another
      (`_previous_conflicts`: the next rounds' merges of that edge, or of the server, turn the
      log's dissenters into precautions): edges as a replay of their release, no new ε;
    - the global of every published round with a re-merged edge or server log, and of every
      later round that carried a re-merged global forward; a round left without edges loses its
      global, its server conflict log and its server merge record.
    Reviewers' decisions on a re-merged log that no longer fit it are removed, audited
    (`federation.conflicts.remove_unfit_decisions`).

    All or nothing: the submissions are deleted in the same transaction as the re-materialized
    compendiums are written, so a re-merge that fails leaves everything as it was (the client's
    submissions and the provenance that finds the affected compendiums included) and the erasure
    can simply be run again. Audited (`client.erase`, by `actor`, the system by default) in the
    same transaction, under the client's organization.

    Serialized with the client's submissions: after the publication lock the erasure locks the
    client's row, which the submission path (`federation.submissions.submit`) holds for its whole
    transaction and takes before any other lock (it never takes the publication lock, so the two
    cannot deadlock). A submission that commits first is erased whole (its compendium, the one
    it replaced and its record); one that arrives during the erasure waits for its commit and is
    then stored whole, as a new submission: an erasure does not revoke the client (revoke it
    first to stop its submissions). Without the lock, a submission committing between the
    listing of the compendiums and the deletion of the records kept its compendium in effect
    while its record was deleted."""
    from federation.conflicts import remove_quoting_edits, remove_unfit_decisions

    embed = embed or _embed()
    with transaction.atomic():
        # Serialized with every publication: a server merge that read a global this erasure
        # merges again or deletes sees it changed under this lock and merges again.
        services.lock_publication()
        # Then the client's row, as the submission path locks it (first, and it never takes the
        # publication lock: no cycle): a submission in flight commits before the listing below,
        # so its compendium and its record go together; one arriving now waits for the commit.
        list(Client.objects.select_for_update().filter(pk=client.pk).values_list("pk"))
        submissions = list(CompendiumVersion.objects.filter(kind="client", client=client))
        # Its requests and precautions, which an edited precaution may still quote (the edit
        # field starts from the composed one, which quotes the dissenters' requests).
        erased_texts = {entry["text"] for sub in submissions for part in ("scenarios", "precautions")
                        for entry in (sub.content or {}).get(part) or ()
                        if isinstance(entry, dict) and isinstance(entry.get("text"), str)}
        # The globals as they are now: the folders of the tunings of those this erasure deletes
        # (merged again or removed) go once it commits.
        globals_before = _global_folder_prefixes()
        built_from = {
            (edge.round_id, edge.organization_id)
            for sub in submissions
            for edge in sub.derived.filter(kind="edge")
        }
        # The edges whose merge read one of them without taking it (rejected at the merge: no
        # provenance link): their merge records name it (`rejected`: its source and why, and the
        # versions read, `inputs`). Merged again as a replay of their release: a rejected
        # submission changed nothing the merge made (neither its noise nor its inputs), so without
        # it in the inputs the release is the same one, with no new ε, and the edge row stays.
        erased_ids = {s.pk for s in submissions}
        rejected_by = set()
        for record in MergeRecord.objects.filter(organization_id=client.organization_id):
            inputs = record.stats.get("inputs")
            named = any(isinstance(r, dict) and r.get("source") == f"client:{client.pk}"
                        for r in record.rejected)
            if not (named or (isinstance(inputs, list) and erased_ids.intersection(inputs))):
                continue
            key = (record.round_id, record.organization_id)
            if key not in built_from:
                rejected_by.add(key)
                if isinstance(inputs, list):
                    record.stats["inputs"] = [pk for pk in inputs if pk not in erased_ids]
                    record.save(update_fields=["stats"])
        CompendiumVersion.objects.filter(pk__in=erased_ids).delete()
        # What each request was (its sha256, sizes, idempotency key) and the answer stored for a
        # replay, which would answer 201 for a compendium that no longer exists.
        records = Submission.objects.filter(client=client).delete()[1].get(
            Submission._meta.label, 0)
        # The merges to do again: (round id, organization id; None for the server's).
        stale = set(built_from)
        edges_done, globals_done, merged_again = [], [], set()
        edges_deleted, edges_removed, globals_removed = [], [], []
        removed = 0

        def redo(round_: Round, organization_id, rewrite):
            """Rewrite one merge of `round_` and remove the decisions that no longer fit its
            log; the later merges that read that log and now read another become stale too.
            Returns what `rewrite` returned."""
            nonlocal removed
            readers = _conflict_readers(round_, organization_id)
            result = rewrite()
            removed += remove_unfit_decisions(round_, organization_id, f"erasure of {client}")
            removed += remove_quoting_edits(round_, organization_id, erased_texts,
                                            f"erasure of {client}")
            stale.update((reader.pk, organization_id) for reader, read in readers
                         if _previous_conflicts(reader, organization_id) != read)
            return result

        first = min(Round.objects.filter(pk__in={r for r, _ in stale | rejected_by}).values_list(
            "number", flat=True), default=None)
        rounds = (Round.objects.filter(number__gte=first).order_by("number")
                  if stale or rejected_by else [])
        carried = False  # the previous published round's global was merged again or deleted
        for round_ in rounds:
            # A failed round past retrying: its edges feed nothing (only published rounds' logs
            # are read, `_conflict_source`), so they go rather than spend ε on a new release.
            dead = round_.state == Round.State.FAILED and services.published_after(round_)
            # (of a failed round past retrying, deleted with the others below: nothing reads it,
            # and a merge over inputs changed since, a client revoked, would spend ε)
            replayed = [] if dead else sorted(o for r, o in rejected_by - stale if r == round_.pk)
            for organization_id in replayed:
                # A replay of the release (no new ε); an edge that comes out otherwise (the
                # schema changed since) makes what read it stale, as any edge merged again.
                before = CompendiumVersion.objects.filter(
                    kind="edge", round=round_, organization_id=organization_id
                ).values_list("pk", flat=True).first()
                outcome = redo(round_, organization_id,
                               lambda o=organization_id, r=round_: run_edge_merge(
                                   r.pk, o, embed=embed))
                if outcome.version_id != before:
                    stale.add((round_.pk, organization_id))
                    (edges_done if outcome.version_id is not None else edges_removed).append(
                        (round_.number, organization_id))
            for organization_id in sorted(o for r, o in stale | (rejected_by if dead else set())
                                          if r == round_.pk and o is not None
                                          and o not in replayed):
                if dead:
                    redo(round_, organization_id,
                         lambda o=organization_id, r=round_: _delete_merge(r, o))
                    edges_deleted.append((round_.number, organization_id))
                    continue
                outcome = redo(round_, organization_id,
                               lambda o=organization_id, r=round_: run_edge_merge(
                                   r.pk, o, rematerialize=(r.pk, o) in built_from, embed=embed))
                # without a submission left the edge is removed, not merged again
                (edges_done if outcome.version_id is not None else edges_removed).append(
                    (round_.number, organization_id))
            if round_.state != Round.State.PUBLISHED:
                # No global is published yet: the pipeline merges it from the re-materialized
                # edges when it publishes the round (a failed round: after a retry).
                continue
            carried = any(r == round_.pk for r, _ in stale) or (carried and _config(round_).carry_forward)
            if not carried:
                continue
            if CompendiumVersion.objects.filter(kind="edge", round=round_).exists():
                # sends global_published for it
                redo(round_, None, lambda r=round_: run_server_merge(r.pk, embed=embed))
                merged_again.add(round_.number)
                globals_done.append(round_.number)
            else:
                redo(round_, None, lambda r=round_: _delete_merge(r, None))
                globals_removed.append(round_.number)
        if globals_removed:
            # A global was deleted: if that was the served one, an earlier global is served
            # again, whose tuned router was retired. It is announced as published again, so that
            # its router is tuned again instead of the routing API serving the frozen model.
            from routing.services import published_global_version

            served = published_global_version()
            if served is not None and served.round.number not in merged_again:
                transaction.on_commit(
                    lambda: global_published.send(sender=Round, round=served.round, version=served),
                    robust=True,
                )
        # The tuned routers of the deleted globals (each an encoder fine-tuned on their texts,
        # with their vectors): a ready or retired one's folder goes with its row (routing.apps);
        # this also removes what a tuning of one killed mid-way left (`.partial`), which no row
        # names. After the commit: a rollback leaves the globals, and their routers, served.
        globals_after = _global_folder_prefixes()
        gone = [prefix for pk, prefix in globals_before.items() if pk not in globals_after]
        if gone:
            from federation.tuning import remove_router_folders

            transaction.on_commit(lambda: remove_router_folders(gone), robust=True)
        report = ErasureReport(
            str(client), len(submissions), edges_done, globals_done, removed,
            edges_deleted=edges_deleted, submission_records_removed=records,
            edges_removed=edges_removed, globals_removed=globals_removed,
        )
        services.audit(
            actor or services.Actor.system("erasure"),
            AuditLog.Action.CLIENT_ERASE,
            target=client,
            organization=client.organization,
            details={
                "submissions_removed": report.submissions_removed,
                "edges_rematerialized": [list(edge) for edge in report.edges_rematerialized],
                "globals_rematerialized": report.globals_rematerialized,
                "decisions_removed": report.decisions_removed,
                "edges_deleted": [list(edge) for edge in report.edges_deleted],
                "edges_removed": [list(edge) for edge in report.edges_removed],
                "globals_removed": report.globals_removed,
                "submission_records_removed": report.submission_records_removed,
            },
        )
        # Every server process forgets what it keeps in memory of clients' texts (embedding
        # vectors, the served global and its routers, masking's words) at its next request or
        # task, or its watcher's next check; this one once the erasure commits.
        caches.bump()
    return report


def _global_folder_prefixes() -> dict[int, str]:
    """Each global's id, with the start of its tuned routers' folder names
    (`federation.tuning.folder_prefix`)."""
    from federation.tuning import folder_prefix

    return {pk: folder_prefix(number, pk, sha256) for pk, number, sha256 in
            CompendiumVersion.objects.filter(kind="global").values_list("pk", "round__number", "sha256")}


def _conflict_readers(round_: Round, organization) -> list[tuple[Round, list[ConflictEntry]]]:
    """The later merges of this edge (the server's when `organization` is None) that read
    `round_`'s conflict log (`_conflict_source`), each with what it reads now."""
    readers = []
    for record in (MergeRecord.objects.filter(organization=organization, round__number__gt=round_.number)
                   .select_related("round").order_by("round__number")):
        if _conflict_source(record.round, organization) != round_:
            break  # this one reads a later round's log, and so does every one after it
        readers.append((record.round, _previous_conflicts(record.round, organization)))
    return readers


def _delete_merge(round_: Round, organization_id: int | None) -> None:
    """What one merge of `round_` wrote, with what it logged (its conflicts and merge record
    hold its inputs' texts): an edge (`organization_id`) of a failed round that can never be
    retried, or the global (None) of a published round left without edges. Ledger rows stay:
    that ε was spent."""
    kind = "global" if organization_id is None else "edge"
    CompendiumVersion.objects.filter(kind=kind, round=round_, organization_id=organization_id).delete()
    ConflictLogEntry.objects.filter(round=round_, organization_id=organization_id).delete()
    MergeRecord.objects.filter(round=round_, organization_id=organization_id).delete()


# The tables whose rows an erasure deletes or rewrites, and so the tables whose files keep the
# erased rows' bytes (dead rows) until they are rewritten: the compendiums (their canonical
# content and routing head) with their provenance and entries (texts, embeddings, clipped
# values, annex triples), the Submission records (request hashes, sizes, stored answers), the
# conflict logs and merge records (their inputs' texts), reviewers' decisions (a picked scenario
# can be the erased client's text) and the tuned routers of the deleted globals. What
# `vacuum_erased_tables` rewrites; the README's "Erasure" section names the same list.
ERASURE_TABLES: tuple[str, ...] = tuple(model._meta.db_table for model in (
    CompendiumVersion,
    CompendiumVersion.sources.through,
    ScenarioEntry,
    PrecautionEntry,
    TemplateEntry,
    StatEntry,
    AnnexEntry,
    Submission,
    ConflictLogEntry,
    MergeRecord,
    ConflictDecision,
    TunedRouter,
))


@dataclass(frozen=True)
class VacuumReport:
    vacuumed: list[tuple[str, float]]  # (table, seconds), in ERASURE_TABLES order
    seconds: float  # in all, the CHECKPOINT included
    checkpoint: str | None  # None: done; else why it was not (one line)


class VacuumFailed(Exception):
    """`VACUUM FULL` of one table failed (or skipped it), or the CHECKPOINT after them failed
    (`table` None); the tables in `vacuumed` were rewritten, those in `not_vacuumed` were not."""

    def __init__(self, table: str | None, reason: str, vacuumed: list[str], not_vacuumed: list[str]):
        self.table, self.reason = table, reason
        self.vacuumed, self.not_vacuumed = vacuumed, not_vacuumed
        step = f"VACUUM FULL {table}" if table else "CHECKPOINT"
        super().__init__(f"{step} failed: {reason}")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def vacuum_erased_tables(*, lock_timeout_s: float = 10.0) -> VacuumReport:
    """Rewrite the tables of `ERASURE_TABLES` with `VACUUM FULL` (one at a time, each under an
    ACCESS EXCLUSIVE lock: the routing API and submissions that read or write it wait until it
    is rewritten), so that the bytes of the rows an erasure deleted leave the table files (a plain
    VACUUM only marks their space free), then `CHECKPOINT` so that the old files are removed
    now rather than at the next checkpoint. Not the WAL segments already written, nor backups.

    Outside any transaction (VACUUM cannot run in one): after an erasure has committed. Waits at
    most `lock_timeout_s` for each table's lock (a VACUUM FULL queued behind a long transaction
    would make every later reader of the table wait too). A table that fails raises
    `VacuumFailed`, naming the tables done and not done. PostgreSQL skips, with a warning only, a
    table the role may not vacuum (neither its owner nor a superuser): a table whose file was not
    replaced is reported as failed. A CHECKPOINT the role may not run (PostgreSQL 15+: superuser
    or `pg_checkpoint`) is not an error: the report says so."""
    if connection.in_atomic_block:
        raise RuntimeError("VACUUM cannot run inside a transaction: call it after the erasure commits")
    started = time.monotonic()
    done: list[tuple[str, float]] = []
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('lock_timeout')")
        previous = cursor.fetchone()[0]
        cursor.execute("SELECT set_config('lock_timeout', %s, false)", [f"{max(1, round(lock_timeout_s * 1000))}ms"])  # 0 would wait forever
        try:
            for index, table in enumerate(ERASURE_TABLES):
                try:
                    cursor.execute("SELECT pg_relation_filenode(%s::regclass)", [table])
                    before = cursor.fetchone()[0]
                    begun = time.monotonic()
                    cursor.execute(f"VACUUM FULL {quote(table)}")
                    cursor.execute("SELECT pg_relation_filenode(%s::regclass)", [table])
                    if cursor.fetchone()[0] == before:
                        raise VacuumFailed(table, "not rewritten (the database role may not vacuum "
                                           "it: it must own the table or be a superuser)", [], [])
                except (DatabaseError, VacuumFailed) as exc:
                    reason = exc.reason if isinstance(exc, VacuumFailed) else first_line(exc)
                    raise VacuumFailed(table, reason, [t for t, _ in done],
                                       list(ERASURE_TABLES[index:])) from exc
                done.append((table, time.monotonic() - begun))
            note = None
            try:
                cursor.execute("CHECKPOINT")
            except DatabaseError as exc:
                if getattr(exc.__cause__, "sqlstate", None) != "42501":  # insufficient_privilege
                    raise VacuumFailed(None, first_line(exc), [t for t, _ in done], []) from exc
                note = (f"{first_line(exc)}: the old files go at the next checkpoint "
                        "(superuser or pg_checkpoint may run CHECKPOINT now)")
        finally:
            with contextlib.suppress(DatabaseError):  # a lost connection: its session went too
                cursor.execute("SELECT set_config('lock_timeout', %s, false)", [previous])
    return VacuumReport(done, time.monotonic() - started, note)


# --- the public probe set ------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeImport:
    dataset: str
    imported: int
    tools: int
    others: dict[str, int]  # the probe set's other datasets (name -> queries), kept beside it


def import_probe_set(path, *, per_tool: int | None = None, seed: int = 0,
                     only: bool = False) -> ProbeImport:
    """Replace the probe queries of a dataset (named after its folder) by up to `per_tool`
    labelled queries per tool (a seeded sample) from a routing-benchmark dataset folder; the
    probe set is every dataset's queries, so `only` drops the other datasets' (a new release of
    a benchmark in a folder of another name)."""
    from compendium.registry import load_dataset

    dataset = load_dataset(path)
    by_tool: dict[str, list] = {}
    for query in dataset.queries:
        by_tool.setdefault(query.tool_id, []).append(query)
    rng = np.random.default_rng(seed)
    chosen = []
    for tool_id in sorted(by_tool):
        queries = sorted(by_tool[tool_id], key=lambda q: q.qid)
        if per_tool is not None and len(queries) > per_tool:
            picks = sorted(rng.choice(len(queries), size=per_tool, replace=False))
            queries = [queries[i] for i in picks]
        chosen.extend(queries)
    others = store_probe_queries(dataset.name, chosen, only=only)
    return ProbeImport(dataset.name, len(chosen), len(by_tool), others)


@transaction.atomic
def store_probe_queries(dataset: str, queries, *, only: bool = False) -> dict[str, int]:
    """Replace the probe queries of `dataset` by these labelled queries (`only`: and drop every
    other dataset's). Returns the other datasets the probe set keeps, with their query counts."""
    stale = ProbeQuery.objects.all() if only else ProbeQuery.objects.filter(dataset=dataset)
    stale.delete()
    ProbeQuery.objects.bulk_create(
        [ProbeQuery(dataset=dataset, qid=q.qid, text=q.query, tool_id=q.tool_id) for q in queries],
        batch_size=1000,
    )
    return dict(ProbeQuery.objects.exclude(dataset=dataset).values("dataset")
                .annotate(n=Count("id")).order_by("dataset").values_list("dataset", "n"))
