"""Per-user numeric statistics of a client, clipped and capped before they are averaged.

This is stage 1 of the numeric path (paper, App. "Edge Merge Operator", "Multi-user-per-client
deployments", option (a)), and it runs inside the client:

1. Each end user's raw value of every declared numeric field is computed from that user's own log
   lines only (calls, success rate, share of the user's calls, mean latency of one tool).
2. Each per-user value is clipped to the field's declared range and to a width of the field's
   sensitivity Δ: to [min, min(max, min + Δ)]. Whatever one user does, their value lies in an
   interval no wider than Δ ("clipped per user at Δ": a user's call count is capped at N_max = Δ).
3. Field cap F*: a user contributes only to the F* tools they touched most (by raw call count;
   ties broken by a seeded hash); their contributions to other tools are set to the neutral value.
4. The client releases, per tool and field, the mean over ALL U users of the client, a user who did
   not use the tool (or whose contribution was capped away) counting the neutral value (0 clipped
   into the bound). The denominator U is the same for every field, so replacing one user's data
   moves each released value by at most Δ/U, and at most 2·F* tools' values move at all: the
   replaced user's F* tools fall back to the neutral value, the replacement's F* tools rise from
   it (the edge splits ε accordingly: federation.merge.privacy.moved_tools).
5. The mean is released to 4 significant digits, kept inside the clip bound (`released_value`):
   the edge's bound (each client's value in an interval of width Δ) is exact, the per-user bound
   Δ/U holds to within the rounding, half a unit of the 4th digit of each value.

Consequence to know when reading the numbers: for rates and latencies the released value is a
mean over all users, non-users counting 0, i.e. the conditional rate times the share of users that
used the tool; a conditional mean over the tool's users only would not have sensitivity Δ/U
(its denominator is itself private and can be 1).

Pure: standard library only.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from compendium.schema import DERIVABLE_KINDS, NumericFieldSpec, NumericKind
from compendium.usage_log import UsageRecord


@dataclass(frozen=True)
class ClipBound:
    """The interval a single user's value of a field is clipped to, and a non-user's value."""

    lo: float
    hi: float
    neutral: float

    @property
    def width(self) -> float:
        return self.hi - self.lo

    def clip(self, value: float) -> float:
        return min(max(value, self.lo), self.hi)


def clip_bound(spec: NumericFieldSpec) -> ClipBound:
    lo = float(spec.min)
    hi = float(min(spec.max, spec.min + spec.sensitivity))
    return ClipBound(lo=lo, hi=hi, neutral=min(max(0.0, lo), hi))


def declaration_problem(spec: NumericFieldSpec) -> str | None:
    """What makes a declared field's clipping window unable to hold what the field measures, or
    None. The window is anchored at min (`clip_bound`) and a user who did not use a tool counts 0
    clamped into it, so it must reach the value of the declared range nearest 0: otherwise that
    value and everything between it and the window is clipped to the window's top, and the
    statistic says the same whatever the clients measured. A field a client derives from its
    usage log (count, rate, frequency, latency) is never negative: a min below 0 would cap a
    user's value at min + Δ, below Δ, with noise calibrated to a width no value fills."""
    bound = clip_bound(spec)
    window = f"[{bound.lo:g}, {bound.hi:g}]"
    if bound.width <= 0:
        # Δ below the spacing of floats at min: min + Δ rounds back to min, and the Laplace scale
        # w/(K·ε_j) of a window of no width is 0/0 (every round's open and release would fail).
        return (
            f"its clipping window [min, min(max, min + Δ)] has no width: Δ = "
            f"{spec.sensitivity:g} is below what a float can add to min = {spec.min:g}; "
            f"declare a larger Δ or a min nearer 0"
        )
    if spec.kind in DERIVABLE_KINDS and spec.min < 0:
        return (
            f"a {spec.kind.value} field's values, computed from a usage log, are never negative, "
            f"but min is {spec.min:g}: its clipping window {window} would cap a user's value at "
            f"{bound.hi:g}, not Δ = {spec.sensitivity:g}; declare min ≥ 0"
        )
    nearest_zero = min(max(0.0, float(spec.min)), float(spec.max))
    if bound.hi < nearest_zero:
        return (
            f"its clipping window [min, min(max, min + Δ)] = {window} leaves out "
            f"{nearest_zero:g}, the value of its range [{spec.min:g}, {spec.max:g}] nearest 0, "
            f"which a user who did not use a tool counts: every value from {bound.hi:g} to "
            f"{nearest_zero:g} and above would be clipped to {bound.hi:g}. Declare Δ at least "
            f"{nearest_zero - spec.min:g}, or a min of at least {nearest_zero - spec.sensitivity:g}"
        )
    return None


@dataclass
class ToolUsage:
    """One user's raw use of one tool in the log."""

    calls: int = 0
    successes: int = 0
    latency_sum: float = 0.0


def per_user_usage(records: Iterable[UsageRecord]) -> dict[str, dict[str, ToolUsage]]:
    """user -> tool -> raw usage. A call counts against the tool that was called (`tool`)."""
    usage: dict[str, dict[str, ToolUsage]] = defaultdict(lambda: defaultdict(ToolUsage))
    for record in records:
        entry = usage[record.user][record.tool]
        entry.calls += 1
        entry.successes += record.outcome == "success"
        entry.latency_sum += record.latency_ms
    return {user: dict(tools) for user, tools in usage.items()}


def raw_value(kind: NumericKind, usage: ToolUsage, user_total_calls: int) -> float:
    if kind is NumericKind.COUNT:
        return float(usage.calls)
    if kind is NumericKind.RATE:
        return usage.successes / usage.calls
    if kind is NumericKind.FREQUENCY:
        return usage.calls / user_total_calls
    if kind is NumericKind.LATENCY:
        return usage.latency_sum / usage.calls
    raise ValueError(f"a {kind} field cannot be derived from a usage log")


def _tie_break(seed: int, user: str, tool: str) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{user}\x00{tool}".encode(), digest_size=8).digest()


def capped_tools(
    usage: dict[str, ToolUsage], field_cap: int | None, seed: int = 0, user: str = ""
) -> list[str]:
    """The user's F* most-touched tools by raw call count (ties: seeded hash), or all of them."""
    ranked = sorted(usage, key=lambda t: (-usage[t].calls, _tie_break(seed, user, t)))
    return ranked if field_cap is None else ranked[:field_cap]


@dataclass
class ClientStatistics:
    """What the client releases (`stats`) and what it did to get there (kept locally)."""

    stats: dict[str, dict[str, float]]
    num_users: int
    field_cap: int | None
    bounds: dict[str, ClipBound]
    clipped_values: dict[str, int] = field(default_factory=dict)
    capped_contributions: int = 0
    skipped_fields: list[str] = field(default_factory=list)
    # user -> tool -> field -> clipped value; stays on the client (tests and inspect use it)
    contributions: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


def client_statistics(
    records: Sequence[UsageRecord],
    fields: Sequence[NumericFieldSpec],
    field_cap: int | None = None,
    seed: int = 0,
) -> ClientStatistics:
    """Per-user clipped, F*-capped statistics averaged over the client's users (option (a))."""
    if field_cap is not None and field_cap < 1:
        raise ValueError("the field cap F* must be at least 1")
    derivable = [f for f in fields if f.kind in DERIVABLE_KINDS]
    bounds = {f.name: clip_bound(f) for f in derivable}
    usage = per_user_usage(records)
    result = ClientStatistics(
        stats={},
        num_users=len(usage),
        field_cap=field_cap,
        bounds=bounds,
        clipped_values={f.name: 0 for f in derivable},
        skipped_fields=[f.name for f in fields if f.kind not in DERIVABLE_KINDS],
    )
    if not usage:
        return result

    touched: set[str] = set()
    for user in sorted(usage):
        tools = usage[user]
        total = sum(t.calls for t in tools.values())
        kept = capped_tools(tools, field_cap, seed, user)
        result.capped_contributions += len(tools) - len(kept)
        mine: dict[str, dict[str, float]] = {}
        for tool in kept:
            values = {}
            for spec in derivable:
                raw = raw_value(spec.kind, tools[tool], total)
                clipped = bounds[spec.name].clip(raw)
                result.clipped_values[spec.name] += clipped != raw
                values[spec.name] = clipped
            mine[tool] = values
        result.contributions[user] = mine
        touched.update(kept)

    users = sorted(result.contributions)
    for tool in sorted(touched):
        result.stats[tool] = {
            spec.name: released_value(
                math.fsum(
                    result.contributions[u][tool][spec.name]
                    if tool in result.contributions[u]
                    else bounds[spec.name].neutral
                    for u in users
                )
                / len(users),
                bounds[spec.name],
            )
            for spec in derivable
        }
    return result


RELEASED_DIGITS = 4


def released_value(mean: float, bound: ClipBound) -> float:
    """The mean as released: to `RELEASED_DIGITS` significant digits (0.6666666666666666 is 18
    bytes of a submission, 0.6667 is 6; the edge's Laplace noise is orders of magnitude coarser),
    kept inside the clip bound, so that the value still lies in an interval of width Δ and the
    edge's sensitivity is unchanged."""
    if mean == 0 or not math.isfinite(mean):
        return mean
    digits = RELEASED_DIGITS - 1 - math.floor(math.log10(abs(mean)))
    return bound.clip(round(mean, digits))
