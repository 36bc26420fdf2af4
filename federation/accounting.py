"""The privacy accountant: composition of the append-only ledger per organization and for the
federation, and the federation's budget cap.

Per organization, a round's spend is what one of its users can lose in that round: Σ ε_j over the
release's fields (under a field cap, the 2·F* largest per-tool sums of ε_j), summed over
re-materializations. Organizations hold
disjoint clients, so the federation's spend in a round is the largest organization spend (parallel
composition). Across rounds the basic and the advanced bound are both computed and the tighter is
reported.

One notion of what the federation has committed, used by every check (opening a round, lowering
the cap, the pipeline before any noise, each edge release, the dashboard): the composition over

- every round with ledger rows, at its ledger spend (largest organization), whatever its state;
- every round that is open, closing or merging and has no ledger rows yet, at its *projected*
  spend (a reservation): `projected_round_spend(config)`, the ledger's own formula applied to one
  release of that round's configuration.

A round is counted once: its reservation gives way to its ledger rows as soon as an edge has
released. A failed round without ledger rows holds no reservation (no noise was drawn, and a
failure such as "no submissions" or "budget exceeded" may be final); `services.retry_round`
re-reserves it, and refuses the retry if that would exceed the cap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Count, F, Max, Min, Q, Sum

from federation.merge.privacy import Composition, compose, round_spend
from federation.models import Organization, PrivacyLedgerEntry, Round
from federation.round_config import RoundConfig

# Rounds that will still release numeric statistics without a further operator decision.
RESERVING_STATES = (Round.State.OPEN, Round.State.CLOSING, Round.State.MERGING)


# How far past the cap a composed ε′ may be and still count as within it: the same figure summed
# in another order (a round's reservation, ε, against its ledger rows, T·F shares of it) differs
# in its last bits, and a round accepted at open must not fail at its release for that.
RELATIVE_TOLERANCE = 1e-9


def over_cap(value: float, cap: float) -> bool:
    """Whether `value` exceeds `cap` by more than float summation could (RELATIVE_TOLERANCE)."""
    return value > cap + RELATIVE_TOLERANCE * max(1.0, abs(cap))


def _policy(field: str, fallback: float) -> float:
    """A privacy setting from the federation's settings row (operators change it there, audited),
    else the deployment's setting, which also seeds the row."""
    from federation.models import FederationSettings

    value = FederationSettings.objects.filter(pk=1).values_list(field, flat=True).first()
    return float(value if value is not None else fallback)


def epsilon_budget() -> float:
    """The federation's ε cap: FederationSettings.epsilon_budget, else SYNAPSE_EPSILON_BUDGET."""
    return _policy("epsilon_budget", settings.SYNAPSE_EPSILON_BUDGET)


def delta_prime() -> float:
    """δ′ of advanced composition: FederationSettings.delta_prime, else SYNAPSE_DELTA_PRIME."""
    return _policy("delta_prime", settings.SYNAPSE_DELTA_PRIME)


@dataclass
class Release:
    """One edge release's ledger rows (an organization's round, release n), summed: what it cost
    one user (`spend`), and with `ledger_releases(figures=True)` what the Privacy page says of it
    (how many statistics, how many of them noised at b >= Δ, the range of K and of ε_j, F*)."""

    organization_id: int
    round_id: int
    release: int
    spend: float = 0.0
    field_cap: int | None = None
    rows: int = 0
    noisy: int = 0
    k_min: int | None = None
    k_max: int | None = None
    eps_min: float | None = None
    eps_max: float | None = None

    def add(self, item: dict) -> None:
        """Fold in one grouped row's figures (a release's uncapped rows, or one tool's)."""
        if item.get("field_cap") is not None:
            self.field_cap = max(self.field_cap or 0, item["field_cap"])
        if "rows" not in item:
            return
        self.rows += item["rows"]
        self.noisy += item["noisy"]
        for name, pick in (("k_min", min), ("k_max", max), ("eps_min", min), ("eps_max", max)):
            current = getattr(self, name)
            setattr(self, name, item[name] if current is None else pick(current, item[name]))


# What `ledger_releases(figures=True)` sums besides ε, per group of rows.
RELEASE_FIGURES = {
    "rows": Count("id"), "noisy": Count("id", filter=Q(noise_scale__gte=F("sensitivity"))),
    "k_min": Min("contributors"), "k_max": Max("contributors"),
    "eps_min": Min("epsilon"), "eps_max": Max("epsilon"),
}


def ledger_releases(
    exclude: tuple[int, int, int] | None = None, *, figures: bool = False
) -> dict[tuple[int, int, int], Release]:
    """{(organization id, round id, release): Release} of the whole ledger, optionally leaving out
    one release (organization, round, release), in two grouped queries; with `figures`, the
    Privacy page's figures of each release summed in the same two."""
    # Summed in the database: an edge releases every registry tool's statistics (199 × 4 rows a
    # release on MetaTool), and every budget check, the Privacy page and each /metrics scrape
    # read them. Without a field cap a release costs the sum of its ε_j (one row back per
    # release); under one, the 2·F* largest per-tool sums (`round_spend`: one row per tool).
    rows = PrivacyLedgerEntry.objects.order_by()
    if exclude is not None:
        org, rnd, release = exclude
        rows = rows.exclude(organization_id=org, round_id=rnd, release=release)
    extra = RELEASE_FIGURES if figures else {}
    out: dict[tuple[int, int, int], Release] = {}

    def entry(item: dict) -> Release:
        key = (item["organization_id"], item["round_id"], item["release"])
        if key not in out:
            out[key] = Release(*key)
        out[key].add(item)
        return out[key]

    for item in (
        rows.filter(field_cap__isnull=True)
        .values("organization_id", "round_id", "release")
        .annotate(total=Sum("epsilon"), **extra)
    ):
        entry(item).spend += float(item["total"])
    per_tool: dict[tuple[int, int, int, int], list[float]] = defaultdict(list)
    for item in (
        rows.filter(field_cap__isnull=False)
        .values("organization_id", "round_id", "release", "field_cap", "tool_id")
        .annotate(total=Sum("epsilon"), **extra)
    ):
        entry(item)
        key = (item["organization_id"], item["round_id"], item["release"], item["field_cap"])
        per_tool[key].append(float(item["total"]))
    for (org, rnd, release, cap), sums in per_tool.items():
        out[(org, rnd, release)].spend += round_spend(sums, cap)  # each sum its own tool
    return out


def spends_of(releases: dict[tuple[int, int, int], Release]) -> dict[int, dict[int, float]]:
    """{organization id: {round id: ε}}: each organization's releases of a round summed."""
    out: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (org, rnd, _), release in releases.items():
        out[org][rnd] += release.spend
    return out


def _spends(exclude: tuple[int, int, int] | None = None) -> dict[int, dict[int, float]]:
    """{organization id: {round id: ε}} from the ledger, optionally leaving out one release
    (organization, round, release)."""
    return spends_of(ledger_releases(exclude))


def organization_composition(organization_id: int) -> Composition:
    per_round = _spends().get(organization_id, {})
    return compose([per_round[r] for r in sorted(per_round)], delta_prime())


def _federation_rounds(spends: dict[int, dict[int, float]]) -> dict[int, float]:
    rounds: dict[int, float] = defaultdict(float)
    for per_round in spends.values():
        for rnd, eps in per_round.items():
            rounds[rnd] = max(rounds[rnd], eps)
    return rounds


def federation_composition() -> Composition:
    rounds = _federation_rounds(_spends())
    return compose([rounds[r] for r in sorted(rounds)], delta_prime())


def remaining_for_release(round_id: int, organization_id: int, release: int) -> float:
    """ε still available to one edge release (a retry of the same release is not counted twice):
    the largest x such that the committed composition with this round at `own + x` stays within
    the cap.

    Every other round counts as in `committed_composition` (ledger spend, or the reservation of a
    round that has not released yet: an erasure's re-release must not take budget an open round
    holds), and this round counts this organization's own earlier releases only (other
    organizations' releases in the same round cover disjoint clients). Under basic composition
    this is cap − the committed ε′; when advanced composition is the tighter, a release adds more
    than its own ε (it raises max ε_r), so the figure is found by bisection on the composed ε′.
    Negative when the committed figure is already over the cap."""
    spends = _spends(exclude=(organization_id, round_id, release))
    committed = commitments(spends)
    own = spends.get(organization_id, {}).get(round_id, 0.0)
    others = committed.spends(exclude=round_id)
    cap, delta = epsilon_budget(), delta_prime()

    def total(x: float) -> float:
        return compose(others + [own + x], delta).epsilon

    now = total(0.0)
    if over_cap(now, cap):
        return cap - now
    lo, hi = 0.0, max(cap - now, 1e-12)
    while total(hi) <= cap:  # basic composition grows by x: this ends once hi > cap
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if total(mid) <= cap:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return lo


def releasable_numeric_fields() -> frozenset[str]:
    """The names of the declared numeric fields an edge can release (`Schema.releasable_fields`:
    those of a kind a client derives from its usage log, not `other`), the only fields a merge
    noises and charges; F is their number."""
    from compendium.models import NumericField
    from compendium.schema import DERIVABLE_KINDS

    return frozenset(NumericField.objects.filter(kind__in=[k.value for k in DERIVABLE_KINDS])
                     .values_list("name", flat=True))


def projected_round_spend(
    config: RoundConfig | dict | None, fields: int | Collection[str] | None = None,
    not_released: Sequence[str] = (),
) -> float:
    """ε one round will cost the federation when its edges release, before it has ledger rows.

    The ledger's formula for one release of that round, applied to one tool's F releasable
    numeric fields (declared, of a kind other than `other`: `releasable_numeric_fields`):
    round_spend([ε_j] * F, F*, [tool] * F) with the merge's
    ε_j = config.per_field_epsilon(F, fields_per_tool=F). That is F·ε/F = ε whenever F ≥ 1
    (the merge releases every registry tool's F fields, T·F statistics at ε/(T·F) each, or
    ε/(2·F*·F) under a cap, which gives the same ε), and 0 when no releasable numeric field is
    declared (nothing is noised). Organizations release in parallel, so one release is the federation's
    round spend; an erasure's re-release is counted when it is recorded. An upper bound: the edges
    leave out the fields no release of the round can make useful (`merge.drowned_fields`, which
    depends on how many clients submit), and the ledger records what they released.
    `not_released`: the fields the round will not release (`Round.fields_not_released`, fixed
    when it opens; its merges never release them): they cost nothing, and each tool's release
    costs the other fields' ε_j only (ε_j is still ε split over all F fields). A name no longer
    declared (a field removed since the round opened) takes nothing off: the merge reads the
    schema in force, and releases its every releasable field the round did not name. `fields`:
    the releasable names (default: read now), or their number F when only that is known."""
    if not isinstance(config, RoundConfig):
        config = RoundConfig.from_stored(config)
    declared = releasable_numeric_fields() if fields is None else fields
    if isinstance(declared, int):
        f = declared
        released = f - min(len(set(not_released)), f)
    else:
        f = len(declared)
        released = len(set(declared) - set(not_released))
    if released <= 0:
        return 0.0
    eps_j = config.per_field_epsilon(f, fields_per_tool=f)
    return round_spend([eps_j] * released, config.field_cap, ["tool"] * released)


def fields_not_released(config: RoundConfig | dict | None) -> list[str]:
    """The declared numeric fields the edges of a round with `config` will not release if every
    approved client submits (`merge.drowned_fields` at the most approved clients of one
    organization, over the organizations that have any): no client need compute or send them.
    Fewer submissions only add fields; clients approved after this is read can take some away,
    and a client that left a field out then counts its neutral value, as for a tool it did not
    use."""
    from federation.merge import drowned_fields
    from federation.models import Client
    from federation.submissions import schema_in_force

    if not isinstance(config, RoundConfig):
        config = RoundConfig.from_stored(config)
    approved = list(
        Client.objects.filter(status=Client.Status.APPROVED)
        .order_by()
        .values("organization")
        .annotate(n=Count("id"))
        .values_list("n", flat=True)
    )
    return sorted(drowned_fields(schema_in_force(), config, max(approved, default=0), len(approved)))


@dataclass(frozen=True)
class Commitments:
    """What the federation has committed: ledger spend and reservations, per round id."""

    recorded: dict[int, float]  # rounds with ledger rows: largest organization spend
    reserved: dict[int, float]  # open/closing/merging rounds without ledger rows: projected spend

    def spends(self, extra: Sequence[float] = (), exclude: int | None = None) -> list[float]:
        rounds = {**self.reserved, **self.recorded}
        rounds.pop(exclude, None)
        return [rounds[r] for r in sorted(rounds)] + [float(e) for e in extra]


def reservations(recorded_rounds: set[int] | None = None) -> dict[int, float]:
    """{round id: projected ε} of the rounds that are open, closing or merging and have no ledger
    rows (rounds with a zero projection are left out)."""
    if recorded_rounds is None:
        recorded_rounds = set(PrivacyLedgerEntry.objects.values_list("round_id", flat=True))
    rows = Round.objects.filter(state__in=RESERVING_STATES).values_list(
        "pk", "config", "fields_not_released"
    )
    fields = releasable_numeric_fields()
    out = {}
    for pk, config, not_released in rows:
        if pk in recorded_rounds:
            continue
        spend = projected_round_spend(config, fields, not_released or ())
        if spend > 0:
            out[pk] = spend
    return out


def commitments(spends: dict[int, dict[int, float]] | None = None) -> Commitments:
    recorded = _federation_rounds(_spends() if spends is None else spends)
    return Commitments(dict(recorded), reservations(set(recorded)))


def committed_composition(extra: Sequence[float] = (), delta: float | None = None) -> Composition:
    """The federation's committed ε′: the ledger's rounds, the reservations of rounds that have
    not released yet, and `extra` (round spends not yet reserved), composed at δ′ = `delta`
    (default: the federation's)."""
    return compose(commitments().spends(extra), delta_prime() if delta is None else delta)


def round_reservation(round_: Round) -> float:
    """What `round_` adds to the commitment if it is (re)started now: nothing if it has ledger
    rows (they are counted already), else its projected spend."""
    if PrivacyLedgerEntry.objects.filter(round=round_).exists():
        return 0.0
    return projected_round_spend(round_.config, not_released=round_.fields_not_released or ())


def _extra_spends(extra: RoundConfig | float | None) -> list[float]:
    if isinstance(extra, RoundConfig):  # a round opened now would not release these
        return [projected_round_spend(extra, not_released=fields_not_released(extra))]
    return [] if extra is None else [float(extra)]


@dataclass(frozen=True)
class BudgetCheck:
    """The committed ε′ before and after `extra` against the cap, from one reading of the ledger."""

    committed: Commitments
    extra: list[float]
    before: Composition
    after: Composition
    cap: float

    @property
    def exceeded(self) -> bool:
        return over_cap(self.after.epsilon, self.cap)

    def refusal(self, what: str) -> str:
        """The accountant's one refusal message: "" within the cap, else a sentence naming both
        figures, the cap and how the committed figure is made up. `what` is its subject
        ("opening a round at ε = 1")."""
        if not self.exceeded:
            return ""
        spend = f" (projected round spend ε = {self.extra[0]:.6g})" if self.extra else ""
        return (
            f"{what}{spend} would bring the federation's committed ε′ from "
            f"{self.before.epsilon:.6g} to {self.after.epsilon:.6g} ({self.after.tighter} "
            f"composition), above its privacy budget of {self.cap:.6g} (committed: "
            f"{len(self.committed.recorded)} round(s) recorded in the ledger, "
            f"{len(self.committed.reserved)} reserved by rounds not released yet)"
        )


def check_budget(
    extra: RoundConfig | float | None = None,
    budget: float | None = None,
    spends: dict[int, dict[int, float]] | None = None,
    committed: Commitments | None = None,
) -> BudgetCheck:
    """The committed composition plus `extra` against the cap (`budget`, default
    `epsilon_budget()`). `extra`: a RoundConfig (one more round: its projected spend), a float (a
    round spend as the ledger counts it), or None (whether what is already committed exceeds the
    cap: the pipeline's check, where the round being started is counted already, by its
    reservation or its ledger rows). `spends`: the ledger as `_spends()` read it, and
    `committed`: `commitments(spends)`, if at hand."""
    committed = commitments(spends) if committed is None else committed
    more = _extra_spends(extra)
    delta = delta_prime()
    return BudgetCheck(
        committed=committed,
        extra=more,
        before=compose(committed.spends(), delta),
        after=compose(committed.spends(more), delta),
        cap=epsilon_budget() if budget is None else budget,
    )


def retry_refusals(rounds, budget: float | None = None) -> dict[int, str]:
    """{round pk: `budget_refusal(round_reservation(r), "retrying round N", budget)`} of each of
    `rounds` (failed ones), from one reading of the ledger, the settings and the reservations
    for all of them: a reading per round made a page listing failed rounds slower with each."""
    rounds = list(rounds)
    if not rounds:
        return {}
    base = check_budget(budget=budget)
    fields = releasable_numeric_fields()
    delta = base.before.delta_prime
    out = {}
    for rnd in rounds:
        # round_reservation: nothing for a round with ledger rows (counted already)
        extra = 0.0 if rnd.pk in base.committed.recorded else projected_round_spend(
            rnd.config, fields, not_released=rnd.fields_not_released or ())
        more = _extra_spends(extra)
        check = BudgetCheck(committed=base.committed, extra=more, before=base.before,
                            after=compose(base.committed.spends(more), delta), cap=base.cap)
        out[rnd.pk] = check.refusal(f"retrying round {rnd.number}")
    return out


def would_exceed(extra: RoundConfig | float | None = None) -> tuple[bool, Composition]:
    """Whether the committed composition plus `extra` exceeds the cap, and that composition."""
    check = check_budget(extra)
    return check.exceeded, check.after


def budget_refusal(
    extra: RoundConfig | float | None, what: str, budget: float | None = None
) -> str:
    """`check_budget(extra, budget).refusal(what)`: "" when within the cap."""
    return check_budget(extra, budget).refusal(what)


@dataclass(frozen=True)
class PrivacyReport:
    budget: float
    federation: Composition  # recorded in the ledger
    organizations: dict[int, Composition]
    committed: Composition  # the ledger plus the reservations of rounds not released yet
    reserved: dict[int, float]  # round id: projected ε of a round without ledger rows

    def as_dict(self) -> dict:
        """Rounds by their number and organizations by their slug, as an operator names them."""
        numbers = dict(Round.objects.filter(pk__in=self.reserved).values_list("pk", "number"))
        slugs = dict(Organization.objects.filter(pk__in=self.organizations).values_list("pk", "slug"))
        return {
            "epsilon_budget": self.budget,
            "federation": self.federation.as_dict(),
            "committed": self.committed.as_dict(),
            "reserved_by_round": {
                str(numbers.get(k, k)): v for k, v in sorted(self.reserved.items())
            },
            "organizations": {
                slugs.get(k, str(k)): v.as_dict() for k, v in self.organizations.items()
            },
        }


def privacy_report(
    spends: dict[int, dict[int, float]] | None = None, committed: Commitments | None = None
) -> PrivacyReport:
    """The report of `spends` (default: the ledger read now) and `committed` (default:
    `commitments(spends)`)."""
    spends = _spends() if spends is None else spends
    committed = commitments(spends) if committed is None else committed
    rounds = committed.recorded
    delta = delta_prime()  # read once: not once per organization
    return PrivacyReport(
        budget=epsilon_budget(),
        federation=compose([rounds[r] for r in sorted(rounds)], delta),
        organizations={
            org: compose([per[r] for r in sorted(per)], delta)
            for org, per in sorted(spends.items())
        },
        committed=compose(committed.spends(), delta),
        reserved=committed.reserved,
    )
