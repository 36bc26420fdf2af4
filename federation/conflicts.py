"""Conflict review: the precaution composed from a logged conflict, and reviewers' decisions.

A decision (federation.models.ConflictDecision) takes effect in the next round's edge merge of the
same organization, or for a conflict of the server merge (organization None: between edges) in
the next server merge (federation.pipeline._previous_conflicts). Once a later round's merge of
that edge has been published, no merge reads the log again: deciding is refused then (`closed_by`),
and while a later round is merging, whose merges read the logs as they start, and on a failed
round's log, which no merge reads unless the round is retried and published (`failed_round`). An erasure that
merges a log again removes the decisions that no longer fit it (`remove_unfit_decisions`).
"""

from __future__ import annotations

import json

from django.db import transaction
from django.db.models import Q

from compendium.scrub import scrub_text
from compendium.services import current_schema
from compendium.validation import _FORBIDDEN_CHARS
from federation.errors import Conflict, InvalidRequest, NotAllowed
from federation.merge import ConflictEntry
from federation.merge.operator import (
    conflict_within_own_sources,
    conflicts_to_precautions,
    losing_tool,
)
from federation.models import AuditLog, ConflictDecision, ConflictLogEntry, MergeRecord, Round
from federation.services import Actor, audit, can_admin, require_admin_now, waiting_briefly


def visible_conflicts(organizations, actor: Actor):
    """The conflict log entries `actor` may see: those of the edges of `organizations` (the
    organizations the actor sees) and, for the operator, the server merge's."""
    visible = Q(organization__in=organizations)
    if actor.is_operator:
        visible |= Q(organization__isnull=True)
    return ConflictLogEntry.objects.filter(visible)


def can_decide(actor: Actor, organization_id) -> bool:
    """Whether `actor` may decide conflicts of the edge of `organization_id`: the operator or that
    organization's admin; a conflict of the server merge (organization None: between edges, its
    texts from several organizations) is the operator's alone."""
    if organization_id is None:
        return actor.is_operator
    return can_admin(actor, organization_id)


def entry_of(conflict: ConflictLogEntry) -> ConflictEntry:
    return ConflictEntry(
        conflict.tool_id, conflict.centroid_id, conflict.centroid, conflict.dissenters, conflict.reason
    )


def composed_precaution(
    conflict: ConflictLogEntry, schema=None, *, flags_released: bool | None = None
) -> str:
    """The precaution the merge composes from this conflict when nobody decides ("" if none),
    as a reviewer is shown it and an accept stores it. Of a log merged before the flag rule
    (`flags_released` False; None: `pipeline.merged_under_flag_rule` is asked) the flag names
    left off are those fewer than FLAG_MIN_SOURCES of the conflict's own sources carried
    (`operator.conflict_within_own_sources`): a precaution as stored would name one client's
    flag, which the merge that reads the log does not publish."""
    if flags_released is None:
        from federation.pipeline import merged_under_flag_rule  # the pipeline reads decisions here

        flags_released = merged_under_flag_rule(conflict.round_id, conflict.organization_id)
    entry = entry_of(conflict)
    if not flags_released:
        entry = conflict_within_own_sources(entry)
    composed = conflicts_to_precautions([entry], schema or current_schema())
    return composed[0].text if composed else ""


def accept_out_of_date(decision: ConflictDecision | None, composed: str) -> bool:
    """Whether `decision` accepted a precaution that is no longer the one composed from its
    conflict (`composed`): accepted before the review held a log merged before the flag rule to
    its sources, or before the schema renamed its tool. An accept means "publish the precaution
    composed": the merge publishes it as composed now, not the old text, which may name one
    client's flag (`pipeline._conflicts_of`)."""
    return (decision is not None and decision.action == ConflictDecision.Action.ACCEPT
            and decision.text != composed)


def scenario_candidates(conflict: ConflictLogEntry) -> list[tuple[str, str]]:
    """The (tool, text) pairs that may win: the centroid's and each dissenter's (masked, as
    submitted), each with the tool it was claimed for. Across tools the centroid and a dissenter
    often hold the same text: which tool wins is the decision."""
    pairs = []
    for candidate in [conflict.centroid, *conflict.dissenters]:
        text = " ".join(str(candidate.get("text", "")).split())
        pair = (str(candidate.get("tool_id") or conflict.tool_id), text)
        if text and pair not in pairs:
            pairs.append(pair)
    return pairs


def pick_value(tool: str, text: str) -> str:
    """A (tool, text) candidate as one form value: the pick list of a conflict across tools offers
    each text with the tool it was claimed for, so that no text can be picked for a tool it was
    not claimed for (two lists, one of texts and one of tools, offered every pairing)."""
    return json.dumps([tool, text], ensure_ascii=False)


def read_pick(value: str) -> tuple[str, str]:
    """(tool, text) from `pick_value`'s form value; InvalidRequest (400) naming the field when it
    is not one."""
    try:
        pair = json.loads(value)
    except (TypeError, ValueError, RecursionError):
        pair = None
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, str) for v in pair)):
        raise InvalidRequest("pick must be one of the conflict's scenarios with its tool, as the "
                             "page offers them")
    return pair[0], pair[1]


def scenario_choices(conflict: ConflictLogEntry) -> list[str]:
    """The texts that may win: the centroid's and each dissenter's (masked, as submitted)."""
    return list(dict.fromkeys(text for _, text in scenario_candidates(conflict)))


def candidate_tools(conflict: ConflictLogEntry) -> list[str]:
    """The tools the conflict's candidates were claimed for, the centroid's first: more than one
    for a conflict across tools, where a picked scenario names the tool it wins for."""
    return list(dict.fromkeys(tool for tool, _ in scenario_candidates(conflict)))


def picked_still_fits(decision: ConflictDecision, conflict: ConflictLogEntry) -> bool:
    """Whether a picked scenario is still one of the conflict's candidates, for the tool it was
    picked for (a decision from before the tool was recorded: the text alone)."""
    if not decision.winner_tool_id:
        return decision.text in scenario_choices(conflict)
    return (decision.winner_tool_id, decision.text) in scenario_candidates(conflict)


def out_of_registry(conflict: ConflictLogEntry, schema, action: str, winner: str = "") -> list[str]:
    """The tools a decision `action` on `conflict` needs that the registry in force (`schema`)
    does not list (deactivated, or never imported): the conflict's own, for the merge to read it
    at all, and the one the decision publishes for (an accepted or edited precaution: across
    tools the losing tool's; a picked scenario: `winner`). No merge publishes a precaution or a
    scenario for such a tool (`operator.conflicts_to_precautions`, `conflict_winners`): the
    decision would never apply while it is out. A dismissal needs none."""
    if action == ConflictDecision.Action.DISMISS:
        return []
    needed = [conflict.tool_id]
    if action == ConflictDecision.Action.SCENARIO:
        needed.append(winner or conflict.tool_id)
    else:
        needed.append(losing_tool(entry_of(conflict)) or conflict.tool_id)
    return [t for t in dict.fromkeys(needed) if t not in schema.tools_by_id]


def _refuse_out_of_registry(conflict: ConflictLogEntry, schema, action: str, winner: str = "") -> None:
    missing = out_of_registry(conflict, schema, action, winner)
    if missing:
        tools = " and ".join(t[:128] for t in missing)
        refers = "it" if len(missing) == 1 else "them"
        raise Conflict(
            f"{tools} {'is' if len(missing) == 1 else 'are'} not in the registry in force "
            f"(deactivated, or never imported): no merge publishes a precaution or a scenario "
            f"for {refers}, so this decision would never apply; reactivate {refers} first, or "
            "dismiss the conflict"
        )


def closed_by(conflict: ConflictLogEntry) -> Round | None:
    """The later published round whose merge of this conflict's edge (the server merge's, for a
    conflict between edges) read the log after the conflict's round, or a later one: no merge will
    read this conflict again, so a decision on it would never apply. None while one still may. A
    merge that accepted no source does not count (`pipeline._conflict_source`: the next merge
    reads the log before it)."""
    return (
        Round.objects.filter(
            number__gt=conflict.round.number,
            state=Round.State.PUBLISHED,
            pk__in=MergeRecord.objects.filter(organization_id=conflict.organization_id)
            .exclude(stats__contains={"accepted": 0})
            .values("round_id"),
        )
        .order_by("number")
        .first()
    )


def closed_by_each(conflicts) -> dict[tuple, Round | None]:
    """`closed_by` of each of `conflicts`, keyed by (organization id, round id): one query for
    all of them (a review page's)."""
    conflicts = list(conflicts)
    if not conflicts:
        return {}
    organization_ids = {c.organization_id for c in conflicts}
    edges = Q(organization_id__in={o for o in organization_ids if o is not None})
    if None in organization_ids:
        edges |= Q(organization__isnull=True)
    later: dict = {}
    for record in (
        MergeRecord.objects.filter(edges, round__state=Round.State.PUBLISHED,
                                   round__number__gt=min(c.round.number for c in conflicts))
        .exclude(stats__contains={"accepted": 0})
        .select_related("round")
        .order_by("round__number")
    ):
        later.setdefault(record.organization_id, []).append(record.round)
    return {
        (c.organization_id, c.round_id): next(
            (r for r in later.get(c.organization_id, []) if r.number > c.round.number), None
        )
        for c in conflicts
    }


MERGING_STATES = (Round.State.CLOSING, Round.State.MERGING)


def paused_by(conflict: ConflictLogEntry, merging) -> Round | None:
    """The first of `merging` (rounds closing or merging, in number order) from the conflict's
    round on: a later one's merges read the conflict logs as they start, and the round's own
    (a retry) rewrite its log, so a decision waits until it is done."""
    return next((r for r in merging if r.number >= conflict.round.number), None)


def failed_round(conflict: ConflictLogEntry) -> Round | None:
    """The conflict's round when it has failed: no merge reads a failed round's log (the next
    round reads the latest published round's, `pipeline._conflict_source`) unless it is retried
    and published, and a retry merges its edges again, their logs with them."""
    return conflict.round if conflict.round.state == Round.State.FAILED else None


def _still_decidable(conflict: ConflictLogEntry) -> None:
    """Refuse (409) a decision that could never apply, or that a merge running now may miss. The
    later rounds are locked until the decision commits, so none starts merging (closes) in
    between and reads the log without it."""
    # Read afresh (not locked: a merge of the round holds its lock while it rewrites the log rows
    # this request holds). A retry that began meanwhile may still publish the round.
    conflict.round.refresh_from_db(fields=["state"])
    if failed_round(conflict) is not None:
        raise Conflict(
            f"round {conflict.round.number} failed: no merge reads its conflict log (the next "
            "round reads the latest published round's) unless it is retried and published; "
            "decide once it has been, or decide the conflicts of the published round before it"
        )
    if conflict.round.state in MERGING_STATES:
        # A retry of the round (or its server merge) merges its edges again and rewrites their
        # logs: a dismissal or an edit would apply to a conflict the reviewer never saw.
        raise Conflict(
            f"round {conflict.round.number} is merging: its merges rewrite this conflict log; "
            "decide once it has been published or has failed"
        )
    later = list(
        Round.objects.select_for_update().filter(number__gt=conflict.round.number).order_by("number")
    )
    paused = paused_by(conflict, [r for r in later if r.state in MERGING_STATES])
    if paused is not None:
        raise Conflict(
            f"round {paused.number} is merging: its merges read the conflict logs as they "
            "start, so a decision now may miss it; decide once it has been published or has "
            "failed"
        )
    closed = closed_by(conflict)
    if closed is not None:
        where = (f"merge of {conflict.organization}" if conflict.organization_id is not None
                 else "server merge")
        raise Conflict(
            f"round {closed.number}'s {where} has been published since round "
            f"{conflict.round.number}, so no merge reads round {conflict.round.number}'s conflict "
            f"log again and a decision on it would never apply; review round {closed.number}'s "
            "conflicts instead"
        )


def decision_seen(decision: ConflictDecision | None) -> str:
    """What a review page records of the decision it showed ("" for none), sent back with a
    decision (`decide_conflict(seen=...)`): another reviewer's decision since then refuses it."""
    return "" if decision is None else f"{decision.pk}:{decision.decided_at.isoformat()}"


def decision_for(conflict: ConflictLogEntry) -> ConflictDecision | None:
    return ConflictDecision.objects.filter(
        round_id=conflict.round_id,
        organization_id=conflict.organization_id,
        tool_id=conflict.tool_id,
        centroid_id=conflict.centroid_id,
    ).first()


@transaction.atomic
def decide_conflict(
    actor: Actor, conflict: ConflictLogEntry, action: str, text: str = "", tool: str = "",
    seen: str | None = None,
) -> ConflictDecision:
    """Record (or replace) the decision on `conflict`; audited (the same decision again changes
    and audits nothing). A picked scenario (`text`) wins for `tool`, which may be left out when
    only one candidate tool holds the text (across tools the centroid and a dissenter often hold
    the same text, each claimed for its own tool). `seen` (`decision_seen`: what the reviewer's
    page showed) refuses (409) a different decision when another one was taken since: two
    reviewers deciding at once, the later one replaced the earlier unseen. Only the operator or an admin of
    the conflict's organization may decide; a conflict of the server merge (between edges, no
    organization) is the operator's alone. An admin's right is checked under a lock of their
    membership row (services.require_admin_now): one demoted or deactivated a moment ago may no
    longer decide. A decision that publishes for a tool the registry in force does not list
    (`out_of_registry`: deactivated since the conflict was logged) is refused (409): no merge
    would apply it. The audit entry records the text's length, never its words nor a digest of
    them (a short text is easily guessed and a digest would confirm the guess): a picked scenario
    is a client's text, which an erasure must be able to remove, and the audit log is
    append-only. The decision row, the entry's target, holds the text while it stands."""
    if conflict.organization_id is None:
        if not actor.is_operator:
            raise NotAllowed("only the operator may decide conflicts of the server merge")
    else:
        require_admin_now(
            actor, conflict.organization_id,
            "only the operator or this organization's admin may decide conflicts",
        )
    if action not in ConflictDecision.Action.values:
        raise InvalidRequest(f"action must be one of {', '.join(ConflictDecision.Action.values)}")
    # Decisions on one conflict one at a time: two at once (a double click) with no later round
    # to lock both read "no decision yet", and the second audited the same decision again. Locked
    # before the later rounds: an erasure that merges this round's log again holds the row to its
    # end and goes on to lock the later rounds, so a decision waiting for the row holds none.
    # Both locks are waited for briefly (a request): an erasure holds them until all its merges
    # commit, minutes with an LLM summarizer, and the reviewer's page hung that long.
    with waiting_briefly("decide the conflict"):
        locked = list(ConflictLogEntry.objects.select_for_update().filter(pk=conflict.pk)
                      .values_list("pk"))
        if locked:
            _still_decidable(conflict)
    if not locked:
        # A merge of the log again (an erasure) deleted the row `conflict` was read from, before
        # this request or while it waited for the lock: its texts may be an erased client's,
        # and a decision on it would store one again after the erasure. Log rows are never
        # updated, only replaced, so a row still there is the one read.
        raise Conflict(
            "this conflict's log was merged again (an erasure) since it was read: reload the "
            "conflicts and decide on the log as it stands"
        )
    text = " ".join((text or "").split())
    winner = ""  # of a picked scenario: the tool it wins for
    schema = current_schema()
    if action in (ConflictDecision.Action.ACCEPT, ConflictDecision.Action.EDIT):
        _refuse_out_of_registry(conflict, schema, action)
    if action == ConflictDecision.Action.ACCEPT:
        text = composed_precaution(conflict, schema)
        if not text:
            raise InvalidRequest("no precaution can be composed from this conflict; edit one instead")
    elif action == ConflictDecision.Action.EDIT:
        if not text:
            raise InvalidRequest("an edited precaution needs a text")
        if len(text) > schema.strings.precaution:
            raise InvalidRequest(
                f"the precaution is {len(text)} characters; at most {schema.strings.precaution}"
            )
        # It enters the next merge as it is: a character no compendium may hold would make that
        # merge refuse its own compendium and fail the round (every retry too).
        bad = _FORBIDDEN_CHARS.search(text)
        if bad is not None:
            raise InvalidRequest(
                f"the precaution contains a control character or bidirectional override "
                f"U+{ord(bad.group()):04X} at position {bad.start()}; remove it"
            )
        # It is published unmasked to every organization: what the server's scrub takes for
        # personal data would be removed from any client's text, and is refused in a reviewer's.
        personal = scrub_text(text).found
        if personal:
            raise InvalidRequest(
                f"the precaution holds {personal}, which every organization would read in the "
                "global compendium; write it without"
            )
    elif action == ConflictDecision.Action.SCENARIO:
        tools = [t for t, candidate in scenario_candidates(conflict) if candidate == text]
        if not tools:
            raise InvalidRequest("the winning scenario must be the centroid or one of the dissenters")
        tool = (tool or "").strip()
        if tool and tool not in tools:
            raise InvalidRequest(
                f"the winning scenario was not claimed for {tool[:128]}, only for {', '.join(tools)}"
            )
        if not tool and len(tools) > 1:
            raise InvalidRequest(
                f"the winning scenario was claimed for {' and '.join(tools)}: name the tool it "
                "wins for"
            )
        winner = tool or tools[0]
        _refuse_out_of_registry(conflict, schema, action, winner)
    else:
        text = ""
    standing = (
        ConflictDecision.objects.select_for_update()
        .filter(round_id=conflict.round_id, organization_id=conflict.organization_id,
                tool_id=conflict.tool_id, centroid_id=conflict.centroid_id)
        .first()
    )
    if standing is not None and (standing.action, standing.text, standing.winner_tool_id) == (
            action, text, winner):
        # The same decision again (a double click, a reload that posts again): nothing changes,
        # so nothing more is written to the append-only audit log.
        return standing
    if seen is not None and decision_seen(standing) != seen:
        if standing is None:
            now = "its decision has been removed since (an erasure)"
        else:
            by = f" by {standing.decided_by.get_username()}" if standing.decided_by else ""
            now = f"it has been decided since: {standing.get_action_display()}{by}"
        raise Conflict(
            f"this conflict's decision changed after the page was loaded ({now}); reload the "
            "conflicts and decide again"
        )
    decision, _ = ConflictDecision.objects.update_or_create(
        round_id=conflict.round_id,
        organization_id=conflict.organization_id,
        tool_id=conflict.tool_id,
        centroid_id=conflict.centroid_id,
        defaults={"action": action, "text": text, "winner_tool_id": winner,
                  "decided_by": actor.user},
    )
    audit(
        actor,
        AuditLog.Action.CONFLICT_DECIDE,
        target=decision,
        organization=conflict.organization,
        target_label=_audit_label(conflict.tool_id, conflict.round.number, conflict.organization),
        details={"action": action, "conflict": conflict.pk, "chars": len(text),
                 **({"tool": winner} if winner else {})},
    )
    return decision


def _audit_label(tool_id: str, round_number: int, organization) -> str:
    """How a `conflict.decide` entry names its conflict: the tool, the round and the merge (the
    entry's details give the conflict's id). Never the centroid id: a digest of the anchor's
    text, a client's request (`merge.clustering.centroid_id`), which would confirm a guess of it
    in the append-only log, and outlive the client's erasure there."""
    where = f"at {organization.slug}" if organization is not None else "between organizations"
    return f"{tool_id} conflict of round {round_number} {where}"


def remove_unfit_decisions(round_, organization_id, cause: str) -> int:
    """Delete the decisions on the conflict log of `round_`'s merge of `organization_id` (None:
    the server's) that no longer fit the log, after it was merged again (an erasure): one whose
    conflict is no longer logged, a picked scenario no longer among its conflict's texts, an
    accepted precaution no longer the one composed from it. Each such text may be an erased
    client's. An edited precaution or a dismissal stays while its conflict is logged: the text
    is the reviewer's own (an erasure removes an edit that still quotes what it erased:
    `remove_quoting_edits`). Each removal is audited, without the text; returns how many."""
    from federation.pipeline import merged_under_flag_rule  # the pipeline calls this module

    conflicts = {
        (c.tool_id, c.centroid_id): c
        for c in ConflictLogEntry.objects.filter(round=round_, organization_id=organization_id)
    }
    released = merged_under_flag_rule(round_, organization_id)
    removed = 0
    for decision in ConflictDecision.objects.filter(round=round_, organization_id=organization_id):
        conflict = conflicts.get((decision.tool_id, decision.centroid_id))
        if conflict is None:
            why = "its conflict is no longer logged"
        elif (decision.action == ConflictDecision.Action.SCENARIO
              and not picked_still_fits(decision, conflict)):
            why = "the picked scenario is no longer one of its conflict's texts"
        elif accept_out_of_date(decision, composed_precaution(conflict, flags_released=released)):
            why = "the accepted precaution is no longer the one composed"
        else:
            continue
        _remove(decision, round_, why, cause)
        removed += 1
    return removed


def _remove(decision: ConflictDecision, round_, why: str, cause: str) -> None:
    """One decision deleted, audited with why and its cause, without its text."""
    audit(
        Actor.system(),
        AuditLog.Action.CONFLICT_DECIDE,
        target=decision,
        organization=decision.organization,
        target_label=_audit_label(decision.tool_id, round_.number, decision.organization),
        details={"action": "removed", "decision": decision.action, "reason": why,
                 "cause": cause},
    )
    decision.delete()


def _plain(text: str) -> str:
    """A text as `quotes` compares it: its words, in any case, without closing punctuation (a
    composed precaution quotes a request as a clause: `merge.operator._clause`)."""
    return " ".join(text.split()).rstrip(" .;!?").casefold()


# Shorter erased texts are not looked for in an edited precaution: a word or two of a request
# ("weather", "a city") is any reviewer's word too.
QUOTE_MIN_CHARS = 12


def quotes(text: str, erased) -> bool:
    """Whether `text` holds one of the `erased` texts whole (`_plain`: case and closing
    punctuation aside), one of QUOTE_MIN_CHARS characters at least."""
    plain = _plain(text)
    return any(len(q) >= QUOTE_MIN_CHARS and q in plain for q in map(_plain, erased))


def remove_quoting_edits(round_, organization_id, erased, cause: str) -> int:
    """Delete the edited precautions on the conflict log of `round_`'s merge of
    `organization_id` (None: the server's) that still quote one of the `erased` texts (an erased
    client's requests and precautions): the edit field starts from the composed precaution,
    which quotes each dissenter's request, so an edit of a few words keeps it, and the next
    merges would publish it again. An edit is otherwise the reviewer's own text, and stays
    (`remove_unfit_decisions`). Each removal is audited, without the text; returns how many."""
    removed = 0
    for decision in ConflictDecision.objects.filter(
        round=round_, organization_id=organization_id, action=ConflictDecision.Action.EDIT
    ):
        if quotes(decision.text, erased):
            _remove(decision, round_, "the edited precaution quotes a text of the erased client",
                    cause)
            removed += 1
    return removed
