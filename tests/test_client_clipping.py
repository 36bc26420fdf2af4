"""Stage 1 of the numeric path at the client: per-user clipping at Δ, the field cap F*, and the
average over the client's users (paper, App. "Multi-user-per-client deployments", option (a))."""

from __future__ import annotations

import math
import random

import pytest

from compendium.builder import BuildOptions, build_compendium
from compendium.clipping import RELEASED_DIGITS, client_statistics, clip_bound, released_value
from compendium.schema import (
    DEFAULT_NUMERIC_FIELDS,
    Compendium,
    NumericFieldSpec,
    NumericKind,
    Schema,
    ToolMetadata,
    ToolSpec,
    exceeds_field_cap,
)
from compendium.usage_log import UsageRecord
from compendium.validation import validate_compendium

FIELDS = list(DEFAULT_NUMERIC_FIELDS)
SPECS = {f.name: f for f in FIELDS}
TOOLS = [f"tool{i}" for i in range(8)]


def rec(user: str, tool: str, outcome: str = "success", latency: float = 100.0) -> UsageRecord:
    return UsageRecord(line=0, query="q", tool=tool, outcome=outcome, latency_ms=latency, user=user)


def released(records, field_cap=None) -> dict[str, dict[str, float]]:
    return client_statistics(records, FIELDS, field_cap=field_cap).stats


def value(stats, tool: str, name: str) -> float:
    """A tool nobody contributed to releases nothing; every user counted the neutral value."""
    return stats.get(tool, {}).get(name, clip_bound(SPECS[name]).neutral)


def random_user(rng: random.Random, user: str, extreme: bool = False) -> list[UsageRecord]:
    out = []
    for tool in rng.sample(TOOLS, rng.randint(1, len(TOOLS))):
        calls = rng.choice([5000, 120, 60]) if extreme else rng.randint(1, 12)
        for _ in range(calls):
            outcome = rng.choice(["success", "failure", "corrected"])
            latency = rng.choice([0.0, 9e9]) if extreme else rng.uniform(20, 900)
            out.append(rec(user, tool, outcome, latency))
    return out


def max_change(a, b) -> dict[str, float]:
    """Per field, the largest change of a released value beyond what rounding to
    RELEASED_DIGITS significant digits can add (half a unit of the last digit on each side)."""
    tools = set(a) | set(b)
    half_unit = 0.5 * 10.0 ** (1 - RELEASED_DIGITS)  # relative to the value
    return {
        name: max(
            abs(value(a, t, name) - value(b, t, name))
            - half_unit * (abs(value(a, t, name)) + abs(value(b, t, name)))
            for t in tools
        )
        for name in SPECS
    }


@pytest.mark.parametrize("field_cap", [None, 2])
def test_one_users_extreme_numbers_move_each_released_value_by_at_most_delta_over_u(field_cap):
    rng = random.Random(11)
    worst = {name: 0.0 for name in SPECS}
    for trial in range(40):
        users = rng.randint(1, 6)
        others = [r for u in range(1, users) for r in random_user(rng, f"u{u}")]
        before = released(others + random_user(rng, "u0"), field_cap)
        after = released(others + random_user(rng, "u0", extreme=True), field_cap)
        for name, change in max_change(before, after).items():
            bound = SPECS[name].sensitivity / users
            assert change <= bound + 1e-9, (trial, name, change, bound)
            worst[name] = max(worst[name], change * users / SPECS[name].sensitivity)
    # the test can fail: the extreme user reaches the bound for calls (clipped at N_max = Δ)
    assert worst["calls"] > 0.9


def test_a_single_user_moves_the_released_value_by_at_most_delta():
    calm = [rec("only", "tool0", latency=10) for _ in range(3)]
    wild = [rec("only", "tool0", "failure", latency=1e12) for _ in range(10**4)]
    a, b = released(calm), released(wild)
    for name, spec in SPECS.items():
        assert abs(a["tool0"][name] - b["tool0"][name]) <= spec.sensitivity
    assert b["tool0"]["calls"] == 50.0  # clipped at N_max = Δ_calls
    assert b["tool0"]["latency_ms"] == 10000.0  # clipped to the declared range


def test_released_value_is_the_mean_over_all_users_non_users_counting_zero():
    records = [rec("a", "tool0") for _ in range(10)]
    records += [rec("b", "tool1", "failure", latency=300) for _ in range(4)]
    records += [rec("b", "tool0", "failure", latency=500)]
    stats = client_statistics(records, FIELDS)
    assert stats.num_users == 2
    assert stats.stats["tool0"]["calls"] == pytest.approx((10 + 1) / 2)
    assert stats.stats["tool0"]["success_rate"] == pytest.approx((1.0 + 0.0) / 2)
    assert stats.stats["tool0"]["frequency"] == pytest.approx((1.0 + 1 / 5) / 2)
    assert stats.stats["tool0"]["latency_ms"] == pytest.approx((100 + 500) / 2)
    assert stats.stats["tool1"]["calls"] == pytest.approx((0 + 4) / 2)
    assert stats.stats["tool1"]["latency_ms"] == pytest.approx((0 + 300) / 2)


def test_released_values_have_four_significant_digits_and_stay_in_the_bound():
    bound = clip_bound(SPECS["success_rate"])
    assert released_value(2 / 3, bound) == 0.6667
    assert released_value(0.013306138306138306, bound) == 0.01331
    assert released_value(0.99996, bound) == 1.0 and released_value(0.0, bound) == 0.0
    latency = clip_bound(SPECS["latency_ms"])
    assert released_value(1332.9166666666667, latency) == 1333.0
    assert released_value(latency.hi - 0.4, latency) == latency.hi
    stats = client_statistics([rec("a", "tool0"), rec("b", "tool1"), rec("c", "tool1")], FIELDS)
    assert stats.stats["tool0"]["calls"] == 0.3333
    assert stats.stats["tool1"]["frequency"] == 0.6667


def test_clip_bound_is_anchored_at_min_and_no_wider_than_delta():
    narrow = NumericFieldSpec(name="x", kind=NumericKind.LATENCY, min=100, max=5000, sensitivity=400)
    bound = clip_bound(narrow)
    assert (bound.lo, bound.hi, bound.neutral) == (100, 500, 100)
    assert bound.clip(9999) == 500 and bound.clip(-5) == 100
    assert clip_bound(SPECS["calls"]).hi == 50  # N_max = Δ
    assert clip_bound(SPECS["frequency"]).hi == 1  # the declared range is narrower than Δ = 2


def test_field_cap_limits_each_user_to_their_most_touched_tools():
    heavy = []
    for rank, tool in enumerate(TOOLS[:6]):  # tool0 most used ... tool5 least
        heavy += [rec("heavy", tool, latency=50) for _ in range(10 - rank)]
    light = [rec("light", "tool7") for _ in range(3)]
    stats = client_statistics(heavy + light, FIELDS, field_cap=2)
    assert sorted(stats.contributions["heavy"]) == ["tool0", "tool1"]
    assert stats.capped_contributions == 4
    assert sorted(stats.stats) == ["tool0", "tool1", "tool7"]  # tool2..tool5 get nothing
    for user, tools in stats.contributions.items():
        assert len(tools) <= 2, user

    # anything the user does on a capped-away tool (without changing which tools are on top)
    # leaves the release unchanged
    changed = [
        rec(r.user, r.tool, "failure", latency=9e9) if r.tool in ("tool4", "tool5") else r
        for r in heavy
    ]
    assert client_statistics(changed + light, FIELDS, field_cap=2).stats == stats.stats


def test_field_cap_over_random_logs_bounds_the_tools_one_user_moves():
    rng = random.Random(5)
    for _ in range(30):
        cap = rng.randint(1, 3)
        others = [r for u in range(1, 4) for r in random_user(rng, f"u{u}")]
        a = released(others + random_user(rng, "u0"), cap)
        b = released(others + random_user(rng, "u0", extreme=True), cap)
        moved = {
            t for t in set(a) | set(b) for n in SPECS if abs(value(a, t, n) - value(b, t, n)) > 1e-12
        }
        # u0's old and new top-F* tools: at most 2·F* tools can move under replacement
        assert len(moved) <= 2 * cap


def test_ties_in_the_field_cap_are_broken_by_the_seed_deterministically():
    records = [rec("u", t) for t in TOOLS]  # all tools touched once: all tied
    picks = {
        seed: tuple(client_statistics(records, FIELDS, field_cap=3, seed=seed).contributions["u"])
        for seed in range(8)
    }
    assert picks[0] == tuple(
        client_statistics(records, FIELDS, field_cap=3, seed=0).contributions["u"]
    )
    assert len(set(picks.values())) > 1


def test_built_metadata_is_in_range_and_valid():
    schema = Schema(tools=[ToolSpec(tool_id=t, description=f"tool {t}") for t in TOOLS])
    rng = random.Random(2)
    records = [r for u in range(5) for r in random_user(rng, f"u{u}", extreme=u == 0)]
    records = [
        UsageRecord(line=i + 1, query=f"request number {i % 7}", tool=r.tool, outcome=r.outcome,
                    latency_ms=r.latency_ms, user=r.user,
                    corrected_to=("tool0" if r.tool != "tool0" else "tool1")
                    if r.outcome == "corrected" else None)
        for i, r in enumerate(records)
    ]
    compendium, report = build_compendium(
        records, schema, BuildOptions(collapse=False, field_cap=3)
    )
    assert compendium.num_users == 5
    assert validate_compendium(compendium, schema).ok
    assert report.clipped_values["calls"] > 0 and report.clipped_values["latency_ms"] > 0
    for entry in compendium.metadata:
        for name, number in entry.stats.items():
            assert SPECS[name].min <= number <= SPECS[name].max


def test_exceeds_field_cap_needs_statistics_and_a_recorded_cap_no_larger_than_the_rounds():
    stats = [ToolMetadata(tool_id="weather", stats={"calls": 1.0})]
    for recorded, round_cap, exceeds in [
        (None, 2, True), (3, 2, True), (2, 2, False), (1, 2, False),
        (None, None, False), (9, None, False),  # a round without a cap takes any
    ]:
        compendium = Compendium(metadata=stats, field_cap=recorded)
        assert exceeds_field_cap(compendium, round_cap) is exceeds, (recorded, round_cap)
    # nothing F* bounds: text, or metadata without statistics
    assert not exceeds_field_cap(Compendium(metadata=[ToolMetadata(tool_id="weather")]), 1)
    assert not exceeds_field_cap(Compendium(field_cap=5), 1)


@pytest.mark.parametrize(
    ("kind", "lo", "hi", "delta", "names"),
    [
        # 0 in the range, the window [-100, -90] below it: every value from -90 up clipped to -90
        (NumericKind.OTHER, -100, 100, 10, ["[-100, -90]", "leaves out 0", "at least 100"]),
        # a range below 0 whose window is at its far end: -90 .. -1 all read as -90
        (NumericKind.OTHER, -100, -1, 10, ["[-100, -90]", "leaves out -1", "at least 99"]),
        # a count is never negative: [-10, 40] caps a user at 40 calls, not Δ = 50
        (NumericKind.COUNT, -10, 1000, 50, ["count", "never negative", "min ≥ 0"]),
        (NumericKind.RATE, -1, 1, 1, ["rate", "never negative", "[-1, 0]"]),
    ],
)
def test_a_clipping_window_that_cannot_hold_what_the_field_measures_is_refused(
    kind, lo, hi, delta, names
):
    """The window every value is clipped to is anchored at min, [min, min(max, min + Δ)], and a
    user who did not use a tool counts 0 clamped into it. A field with a negative minimum and a
    narrow Δ was accepted, and then every figure of the field was clipped into a window that
    left out 0 (the statistic said the same whatever the clients measured); a derivable field
    with min < 0 silently lowered its per-user cap below Δ."""
    from compendium.clipping import declaration_problem

    spec = NumericFieldSpec(name="x", kind=kind, min=lo, max=hi, sensitivity=delta)
    problem = declaration_problem(spec)
    assert problem is not None
    for name in names:
        assert name in problem, problem


def test_the_windows_that_hold_what_the_field_measures_are_accepted():
    from compendium.clipping import declaration_problem

    assert all(declaration_problem(spec) is None for spec in DEFAULT_NUMERIC_FIELDS)
    for lo, hi, delta in ((-1, 1, 2), (-100, 100, 100), (-10, -1, 9), (1, 5, 4), (100, 5000, 400),
                          (-1, 1, 1)):
        spec = NumericFieldSpec(name="x", kind=NumericKind.OTHER, min=lo, max=hi, sensitivity=delta)
        assert declaration_problem(spec) is None, (lo, hi, delta)
    assert declaration_problem(NumericFieldSpec(
        name="x", kind=NumericKind.LATENCY, min=100, max=5000, sensitivity=400)) is None


def test_a_window_that_rounds_to_no_width_is_refused():
    """min + Δ rounds back to min where Δ is below the spacing of floats at min (at 1e9 that
    spacing is about 1.2e-7): the window [1e9, 1e9] has width 0, so the Laplace scale w/(K·ε_j)
    is 0/0. The declaration was accepted, and then opening any round failed with a ValueError
    ("sensitivity and ε must be positive", from the drowned-field check: a 500), as did every
    edge release."""
    from compendium.clipping import clip_bound, declaration_problem

    spec = NumericFieldSpec(name="x", kind=NumericKind.LATENCY, min=1e9, max=2e9,
                            sensitivity=1e-8)
    assert clip_bound(spec).width == 0.0
    problem = declaration_problem(spec)
    assert problem is not None and "no width" in problem and "Δ" in problem, problem
    # a Δ the floats at min can hold is fine
    assert declaration_problem(NumericFieldSpec(name="x", kind=NumericKind.LATENCY, min=1e9,
                                                max=2e9, sensitivity=1e-3)) is None


@pytest.mark.django_db
def test_the_operator_cannot_declare_a_field_whose_window_leaves_out_its_neutral_value():
    """What the admin's form asks (`schema_problem`) before a declared field is saved."""
    from compendium.models import NumericField
    from compendium.services import schema_problem

    field = NumericField(name="temperature_change", kind="other", min_value=-100, max_value=100,
                         sensitivity=10)
    problem = schema_problem(field)
    assert problem is not None and "leaves out 0" in problem
    field.sensitivity = 100
    assert schema_problem(field) is None


@pytest.mark.parametrize(("lo", "hi", "delta", "named"), [
    (0, math.inf, 1, "max"),
    (-math.inf, 0, 1, "min"),
    (0, 10, math.inf, "sensitivity"),
    (-1e308, 1e308, 1, "too wide"),
])
def test_a_numeric_field_declares_finite_bounds_and_sensitivity(lo, hi, delta, named):
    """The paper's schema "declares finite ranges per numeric field, bounding Δ_m by
    construction": an infinite bound or Δ (or a range whose width overflows) was accepted, and
    the edge's Laplace scale became infinite, its release only the window's edge."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=named):
        NumericFieldSpec(name="x", kind=NumericKind.OTHER, min=lo, max=hi, sensitivity=delta)
