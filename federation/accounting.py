"""The privacy accountant: composition of the append-only ledger per organization and for the
federation, and the federation's budget cap.

Per organization, a round's spend is what one of its users can lose in that round: Σ ε_j over the
release's fields (F*·ε_j under a field cap), summed over re-materializations. Organizations hold
disjoint clients, so the federation's spend in a round is the largest organization spend (parallel
composition). Across rounds the basic and the advanced bound are both computed and the tighter is
reported.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from django.apps import apps
from django.conf import settings

from federation.merge.privacy import Composition, compose, round_spend
from federation.models import PrivacyLedgerEntry


def epsilon_budget() -> float:
    """The federation's ε cap: FederationSettings.epsilon_budget where that model exists and has a
    row, else settings.SYNAPSE_EPSILON_BUDGET."""
    try:
        model = apps.get_model("federation", "FederationSettings")
    except LookupError:
        model = None
    if model is not None:
        loader = getattr(model, "load", None)
        row = loader() if callable(loader) else model.objects.first()
        value = getattr(row, "epsilon_budget", None) if row is not None else None
        if value is not None:
            return float(value)
    return float(settings.SYNAPSE_EPSILON_BUDGET)


def delta_prime() -> float:
    return float(settings.SYNAPSE_DELTA_PRIME)


def _spends(exclude: tuple[int, int, int] | None = None) -> dict[int, dict[int, float]]:
    """{organization id: {round id: ε}} from the ledger, optionally leaving out one release."""
    groups: dict[tuple[int, int, int], list[PrivacyLedgerEntry]] = defaultdict(list)
    for row in PrivacyLedgerEntry.objects.only(
        "round_id", "organization_id", "release", "epsilon", "field_cap"
    ):
        key = (row.organization_id, row.round_id, row.release)
        if key != exclude:
            groups[key].append(row)
    out: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for (org, rnd, _), rows in groups.items():
        out[org][rnd] += round_spend([r.epsilon for r in rows], rows[0].field_cap)
    return out


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
    """ε still available to one edge release (a retry of the same release is not counted twice).

    cap − the composed spend recorded so far, where every round counts its largest organization
    spend, except this round, which counts this organization's own earlier releases only (other
    organizations' releases in the same round cover disjoint clients). Exact under basic
    composition."""
    spends = _spends(exclude=(organization_id, round_id, release))
    rounds = _federation_rounds(spends)
    rounds[round_id] = spends.get(organization_id, {}).get(round_id, 0.0)
    used = compose([rounds[r] for r in sorted(rounds)], delta_prime())
    return epsilon_budget() - used.epsilon


def would_exceed(round_epsilon: float) -> tuple[bool, Composition]:
    """Whether one more round spending `round_epsilon` would exceed the cap, and the composition."""
    rounds = _federation_rounds(_spends())
    projected = compose([rounds[r] for r in sorted(rounds)] + [round_epsilon], delta_prime())
    return projected.epsilon > epsilon_budget() + 1e-12, projected


@dataclass(frozen=True)
class PrivacyReport:
    budget: float
    federation: Composition
    organizations: dict[int, Composition]

    def as_dict(self) -> dict:
        return {
            "epsilon_budget": self.budget,
            "federation": self.federation.as_dict(),
            "organizations": {k: v.as_dict() for k, v in self.organizations.items()},
        }


def privacy_report() -> PrivacyReport:
    spends = _spends()
    rounds = _federation_rounds(spends)
    return PrivacyReport(
        budget=epsilon_budget(),
        federation=compose([rounds[r] for r in sorted(rounds)], delta_prime()),
        organizations={
            org: compose([per[r] for r in sorted(per)], delta_prime())
            for org, per in sorted(spends.items())
        },
    )
