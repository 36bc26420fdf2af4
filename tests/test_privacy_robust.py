"""The Laplace mechanism, composition, and Byzantine-robust rules (pure functions)."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
from scipy import stats

from federation.merge.privacy import (
    advanced_composition,
    basic_composition,
    compose,
    laplace_release,
    laplace_scale,
    round_spend,
)
from federation.merge.robust import (
    byzantine_count,
    krum_keep,
    krum_premise_from,
    krum_scores,
    most_kept,
    robust_batches,
    robust_keep,
    trimmed_keep,
    trimmed_mean,
)


def test_noise_scale_is_delta_over_k_epsilon():
    assert laplace_scale(50, 10, 0.25) == pytest.approx(20.0)
    with pytest.raises(ValueError):
        laplace_scale(1, 0, 1)


def test_released_noise_follows_laplace_b_goodness_of_fit():
    rng = np.random.default_rng(12345)
    values = [400.0, 500.0, 600.0]  # mean 500, far from the range ends: no clipping
    b = laplace_scale(100.0, 3, 0.5)
    draws = np.array(
        [
            laplace_release(values, lower=0, upper=10000, sensitivity=100, epsilon=0.5, rng=rng)[0]
            for _ in range(20000)
        ]
    )
    noise = draws - 500.0
    assert stats.kstest(noise, "laplace", args=(0, b)).pvalue > 0.01
    # and the test has power: a wrong scale is rejected
    assert stats.kstest(noise, "laplace", args=(0, 1.5 * b)).pvalue < 1e-6


def test_release_clips_input_and_output():
    rng = np.random.default_rng(0)
    value, _ = laplace_release([5.0, -3.0], lower=0, upper=1, sensitivity=1, epsilon=0.01, rng=rng)
    assert 0.0 <= value <= 1.0


def test_composition_matches_formulas():
    assert basic_composition([0.5] * 10) == pytest.approx(5.0)
    eps, rounds, delta = 0.5, 10, 1e-5
    expected = math.sqrt(2 * rounds * math.log(1 / delta)) * eps + rounds * eps * (math.exp(eps) - 1)
    assert advanced_composition(eps, rounds, delta) == pytest.approx(expected)
    small = compose([0.5] * 10, delta)
    assert small.tighter == "basic" and small.epsilon == pytest.approx(5.0) and small.delta == 0
    # many rounds of a small ε: advanced composition is the tighter
    many = compose([0.01] * 10000, delta)
    assert many.tighter == "advanced"
    assert many.epsilon == pytest.approx(advanced_composition(0.01, 10000, delta))
    assert many.epsilon < 100.0
    # a round's ε past ~709 overflows the advanced bound: basic is reported, and the report's
    # JSON (manage.py privacy_report) says null where it wrote Infinity, which is not JSON
    huge = compose([800.0], delta)
    assert huge.tighter == "basic" and huge.epsilon == 800.0
    assert huge.as_dict()["advanced_epsilon"] is None
    assert json.loads(json.dumps(huge.as_dict(), allow_nan=False))["epsilon"] == 800.0


def test_advanced_composition_can_be_the_tighter_inside_the_papers_small_r_regime():
    """Theorem 1 says basic composition is strictly tighter for R <= 30 and ε <= 2; at a small
    per-round ε it is not (ε = 0.01, R = 30, δ' = 1e-5: advanced 0.266 < basic 0.3), so the
    accountant must take the smaller of the two rather than assume basic. Over unequal rounds the
    advanced bound is the textbook formula at k = R releases of the largest ε_r."""
    def textbook(eps, k, delta):
        return math.sqrt(2 * k * math.log(1 / delta)) * eps + k * eps * (math.exp(eps) - 1)

    delta = 1e-5
    small = compose([0.01] * 30, delta)
    assert small.basic_epsilon == pytest.approx(0.3)
    assert small.advanced_epsilon == pytest.approx(textbook(0.01, 30, delta))
    assert small.advanced_epsilon < small.basic_epsilon
    assert small.tighter == "advanced" and small.epsilon == pytest.approx(small.advanced_epsilon)
    assert small.delta == delta  # the advanced bound is (ε', δ')-DP, not pure
    # at the paper's operating points (ε = 0.5, 1, 2; R = 3) basic is the tighter, as it says
    for eps in (0.5, 1.0, 2.0):
        assert compose([eps] * 3, delta).tighter == "basic"
    # unequal rounds: R counts the rounds that spent, ε is their largest spend
    mixed = compose([0.01] * 29 + [0.02, 0.0], delta)
    assert mixed.rounds == 30 and mixed.basic_epsilon == pytest.approx(0.31)
    assert mixed.advanced_epsilon == pytest.approx(textbook(0.02, 30, delta))


def test_round_spend_with_and_without_field_cap():
    assert round_spend([0.25] * 4, None) == pytest.approx(1.0)
    assert round_spend([0.5] * 4, 1) == pytest.approx(1.0)  # 2·F* = 2 fields, each its own tool
    assert round_spend([0.5] * 4, 2) == pytest.approx(2.0)


def test_krum_drops_planted_outliers():
    rng = np.random.default_rng(3)
    honest = rng.normal(0, 0.05, size=(8, 16)) + 1.0
    outliers = rng.normal(0, 0.05, size=(2, 16)) - 3.0
    vectors = np.vstack([honest[:4], outliers[:1], honest[4:], outliers[1:]])
    keep = krum_keep(vectors, f=2)
    assert set(keep) == {0, 1, 2, 3, 5, 6, 7, 8}


def test_trimmed_mean_resists_planted_outliers():
    values = np.array([1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98, 100.0, 95.0, 90.0, -80.0])
    f = byzantine_count(len(values), 0.34)
    assert f == 4
    assert trimmed_mean(values, f) == pytest.approx(1.0, abs=0.05)
    assert abs(values.mean() - 1.0) > 0.5  # the plain mean is pulled away
    vectors = np.vstack([np.ones((6, 4)), np.full((1, 4), 9.0), np.full((1, 4), -9.0)])
    kept = trimmed_keep(vectors, 1)
    assert set(kept) <= set(range(6)) and len(kept) == 6


def test_robust_keep_none_keeps_everything():
    vectors = np.eye(5)
    assert list(robust_keep(vectors, "none", 0.4)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        robust_keep(vectors, "median", 0.4)


def test_robust_batches_drop_the_source_whose_batch_points_elsewhere():
    """Per tool, each source's batch is summed up by its mean direction; the rule keeps the
    central ones. Four honest sources write about one thing for tool "a", a fifth sends batches
    about something else under that label: Krum drops that batch alone, the trimmed mean drops it
    and the honest batch farthest from the robust center; a tool with two sources is not judged."""
    rng = np.random.default_rng(7)
    honest_dir, other_dir = np.eye(16)[0], np.eye(16)[1]

    def batch(direction, n=4):
        rows = direction + rng.normal(0, 0.15, size=(n, 16))
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    batches = {(f"h{i}", "a"): batch(honest_dir) for i in range(4)}
    batches[("liar", "a")] = batch(other_dir)
    batches[("h0", "b")] = batch(other_dir)
    batches[("liar", "b")] = batch(honest_dir)  # only two sources for "b": kept whatever they say
    assert byzantine_count(5, 0.25) == 1
    assert robust_batches(batches, "krum", 0.25) == {("liar", "a")}
    trimmed = robust_batches(batches, "trimmed-mean", 0.25)
    assert ("liar", "a") in trimmed and len(trimmed) == 2
    assert all(tool == "a" for _, tool in trimmed)
    assert robust_batches(batches, "none", 0.25) == set()
    assert robust_batches(batches, "krum", 0.1) == set()  # f = floor(0.1 * 5) = 0


def test_round_spend_under_a_field_cap_charges_each_tool_all_its_fields():
    """The cap is on tools: a user feeding F* tools moves every field of each, so a round costs
    the 2·F* largest per-tool sums of ε_j (a replaced user's F* tools and the replacement's),
    not F*·max ε_j."""
    tools = ["a", "a", "a", "a", "b", "b", "b", "b", "c", "c", "c", "c"]
    assert round_spend([0.125] * 12, 1, tools) == pytest.approx(1.0)
    assert round_spend([0.125] * 12, None, tools) == pytest.approx(1.5)
    assert round_spend([0.125] * 12, 2, tools) == pytest.approx(1.5)  # only 3 tools
    uneven = [0.5] * 4 + [0.25] * 4 + [0.125] * 4
    assert round_spend(uneven, 1, tools) == pytest.approx(2.0 + 1.0)  # the two largest tools


def test_byzantine_count_is_the_floor_of_the_share_as_written():
    """f = ⌊share·n⌋ of the share the operator wrote: 0.29 of 100 sources is 29, but 0.29·100 is
    28.999999999999996 in floating point, and the floor of that trimmed one too few each side
    (0.35 of 180, 0.29 of 200 likewise)."""
    assert byzantine_count(100, 0.29) == 29
    assert byzantine_count(180, 0.35) == 63
    assert byzantine_count(200, 0.29) == 58
    assert byzantine_count(3, 1 / 3) == 1 and byzantine_count(10, 0.1) == 1
    assert byzantine_count(9, 0.1) == 0 and byzantine_count(4, 0.25) == 1
    assert byzantine_count(4, 0.49) == 1  # at most (n − 1) // 2: something is always kept
    assert byzantine_count(1, 0.4) == 0 and byzantine_count(0, 0.4) == 0


def test_krum_counts_the_groups_it_judges_with_fewer_than_2f_plus_3_inputs():
    """Krum's guarantee needs n ≥ 2f + 3. With 4 sources at a share of 0.25, f = 1 and n = 4 < 5:
    the rule still judges (what it keeps is unchanged), and `short` counts the group by (n, f).
    Five sources at that share meet the premise; f = 0 (share 0.1), a group of fewer than 3
    (not judged) and the trimmed mean are never counted."""
    rng = np.random.default_rng(3)

    def batch():
        rows = rng.normal(size=(3, 8))
        return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    batches = {(s, "four"): batch() for s in ("a", "b", "c", "d")}
    batches |= {(s, "five"): batch() for s in ("a", "b", "c", "d", "e")}
    batches |= {(s, "two"): batch() for s in ("a", "b")}
    short: Counter = Counter()
    dropped = robust_batches(batches, "krum", 0.25, short=short)
    assert short == {(4, 1): 1}
    assert dropped == robust_batches(batches, "krum", 0.25)  # the count changes nothing kept
    assert len(dropped) == 2  # n − f kept in each judged tool
    for rule, share in (("trimmed-mean", 0.25), ("krum", 0.1), ("none", 0.25)):
        other: Counter = Counter()
        robust_batches(batches, rule, share, short=other)
        assert not other, (rule, share)
    # Inside a cluster, through robust_keep: n = 3 at 0.4 (f = 1), n = 6 at 0.4 (f = 2) fall
    # short; n = 7 at 0.4 (f = 2) does not.
    vectors = rng.normal(size=(7, 8))
    short = Counter()
    for n in (3, 6, 7):
        kept = robust_keep(vectors[:n], "krum", 0.4, short=short)
        assert list(kept) == list(robust_keep(vectors[:n], "krum", 0.4))
    assert short == {(3, 1): 1, (6, 2): 1}
    robust_keep(vectors[:2], "krum", 0.4, short=short)  # not judged at all
    assert short == {(3, 1): 1, (6, 2): 1}


def test_krum_premise_from_is_the_least_n_from_which_every_group_meets_it():
    assert krum_premise_from(0.25) == 5  # 4 inputs: f = 1, 4 < 5
    assert krum_premise_from(0.1) == 1  # f ≤ 1 below 20 inputs, and n ≥ 5 once f = 1
    assert krum_premise_from(0.4) == 11  # 10 inputs: f = 4, 10 < 11
    for share in (0.1, 0.2, 0.25, 1 / 3, 0.4, 0.45, 0.49):
        start = krum_premise_from(share)
        assert all(n >= 2 * byzantine_count(n, share) + 3 or byzantine_count(n, share) == 0
                   for n in range(start, 2000)), share
        if start > 1:
            n = start - 1
            assert 1 <= byzantine_count(n, share) and n < 2 * byzantine_count(n, share) + 3
    assert krum_premise_from(0.4999999) is None  # millions of sizes to look at: not said
    with pytest.raises(ValueError):
        krum_premise_from(0.5)


def test_advanced_composition_stays_finite_at_a_subnormal_delta_prime():
    """The settings take any δ′ in (0, 1). Below ~5.6e-309 (a subnormal float, which PostgreSQL
    stores and the settings accepted) 1/δ′ overflows to infinity, so ln(1/δ′) did too and the
    advanced bound came out infinite: the privacy page showed "inf" and `privacy_report` null, as
    for a round's ε past ~709, though ln(1/δ′) = −ln δ′ is about 737 at δ′ = 1e-320. With many
    small rounds the advanced bound is the tighter there and was lost."""
    for delta in (1e-310, 1e-320, 5e-324):
        expected = math.sqrt(2 * 10000 * -math.log(delta)) * 0.01 + 10000 * 0.01 * math.expm1(0.01)
        assert advanced_composition(0.01, 10000, delta) == pytest.approx(expected)
        many = compose([0.01] * 10000, delta)
        assert many.tighter == "advanced" and many.epsilon < 100.0
        assert many.as_dict()["advanced_epsilon"] == pytest.approx(expected)
    # the bound still grows as δ′ shrinks (the normal range is unchanged)
    assert advanced_composition(0.01, 10000, 1e-300) < advanced_composition(0.01, 10000, 1e-310)


def test_krum_scores_are_blanchards_sums_over_the_n_minus_f_minus_2_nearest_by_hand():
    """Blanchard et al. (2017): each vector's score is the sum of its squared distances to its
    n − f − 2 nearest others; multi-Krum keeps the n − f lowest. Seven points on a line, f = 2:
    three neighbours each. 0 → 1, 2, 3: 1 + 4 + 9 = 14; 1 → 0, 2, 3: 1 + 1 + 4 = 6; 2 → 1, 3, 0:
    6; 3 → 2, 1, 0: 14; 10 → 11, 3, 2: 1 + 49 + 64 = 114; 11 → 10, 3, 2: 1 + 64 + 81 = 146;
    100 → 11, 10, 3: 89² + 90² + 97² = 25430. The five lowest are 0, 1, 2, 3 and 10."""
    line = np.array([[0.0], [1.0], [2.0], [3.0], [10.0], [11.0], [100.0]])
    assert krum_scores(line, 2).tolist() == pytest.approx([14, 6, 6, 14, 114, 146, 25430])
    assert krum_keep(line, 2).tolist() == [0, 1, 2, 3, 4]
    # n − f − 2 = 0 (three inputs, f = 1) is below Krum's premise: one neighbour each, the two
    # nearest of 0, 1, 1.5 are kept (0 → 1: 1; 1 → 1.5: 0.25; 1.5 → 1: 0.25)
    three = np.array([[0.0], [1.0], [1.5]])
    assert krum_scores(three, 1).tolist() == pytest.approx([1.0, 0.25, 0.25])
    assert krum_keep(three, 1).tolist() == [1, 2]
    # ties are broken by position, so the same inputs always keep the same members
    assert krum_keep(np.zeros((5, 2)), 1).tolist() == [0, 1, 2, 3]


def test_trimmed_mean_and_trimmed_keep_by_hand():
    """Yin et al. (2018): per coordinate, the f lowest and f highest values are dropped and the
    rest averaged. Columns (1, 2, 3, 4, 100) and (10, 20, 30, −1000, 40), f = 1: (2 + 3 + 4)/3
    = 3 and (10 + 20 + 30)/3 = 20. trimmed_keep keeps the n − 2f members nearest that center."""
    values = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, -1000.0], [100.0, 40.0]])
    assert trimmed_mean(values, 1).tolist() == pytest.approx([3.0, 20.0])
    assert trimmed_mean(values[:, 0], 2) == pytest.approx(3.0)  # the median of five
    assert trimmed_mean(values[:, 0], 0) == pytest.approx(22.0)  # f = 0: the plain mean
    # center (1/3, 1/3): distances 0.47, 0.75, 0.75, 6.6 and 4.35; the three nearest stay
    square = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0], [-4.0, 0.0]])
    assert trimmed_mean(square, 1).tolist() == pytest.approx([1 / 3, 1 / 3])
    assert trimmed_keep(square, 1).tolist() == [0, 1, 2]


def test_a_trimmed_mean_moves_by_at_most_the_window_over_the_count_kept():
    """The edge calibrates a trimmed release's noise to w/(K − 2f): replacing one of K values in
    a window of width w moves every order statistic up (or down) by at most what the value moved
    and their sum by exactly that, so the middle K − 2f move together by at most w. The bound is
    reached: (0, 0, 0, 1, 1, 1, 1) → (0, 0, 1, 1, 1, 1, 1) at f = 2 moves the mean of the middle
    three from 2/3 to 1."""
    k, f = 7, byzantine_count(7, 0.3)
    assert f == 2
    # an edge of at most 7 keeps at most 4 (6 inputs: f = 1): drowned fields are judged on that
    assert most_kept(7, 0.3) == 4
    before = np.array([0, 0, 0, 1, 1, 1, 1.0])
    after = np.array([0, 0, 1, 1, 1, 1, 1.0])
    assert trimmed_mean(after, f) - trimmed_mean(before, f) == pytest.approx(1 / (k - 2 * f))
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(2000):
        data = rng.uniform(0, 1, size=k)
        moved = data.copy()
        moved[rng.integers(k)] = rng.choice([0.0, 1.0, rng.uniform(0, 1)])
        worst = max(worst, abs(trimmed_mean(moved, f) - trimmed_mean(data, f)))
    assert worst <= 1 / (k - 2 * f) + 1e-12


def test_the_laplace_release_is_the_clipped_mean_plus_a_draw_of_scale_w_over_k_epsilon():
    """One release by hand: values (−1, 0.2, 0.4, 2) clipped to [0, 1] are (0, 0.2, 0.4, 1), mean
    0.4; b = 1/(4 · 0.5) = 0.5; the grid's step is (1/4)/2^20, the mean 0.4 is round(0.4/step)
    steps, and the figure is that plus the exact discrete Laplace draw of scale (2^20 + 1)/0.5
    steps from the generator's next 32 bytes, times the step, clamped to the window."""
    import random
    from fractions import Fraction

    from federation.merge.privacy import GRID_STEPS, discrete_laplace

    step = 0.25 / GRID_STEPS
    source = random.Random(int.from_bytes(np.random.default_rng(9).bytes(32), "big"))
    draw = discrete_laplace(Fraction(GRID_STEPS + 1) / Fraction(0.5), source)
    value, scale = laplace_release([-1.0, 0.2, 0.4, 2.0], lower=0.0, upper=1.0, sensitivity=1.0,
                                   epsilon=0.5, rng=np.random.default_rng(9))
    assert scale == 0.5
    assert value == min(1.0, max(0.0, (round(0.4 / step) + draw) * step))
    assert 0.0 < value < 1.0  # this seed's draw lands inside the window: the sum is seen
    # a replay of the release (the same generator state) publishes the same figure
    assert laplace_release([-1.0, 0.2, 0.4, 2.0], lower=0.0, upper=1.0, sensitivity=1.0,
                           epsilon=0.5, rng=np.random.default_rng(9))[0] == value


def test_the_discrete_laplace_draw_has_the_exact_probabilities():
    """P(z) = (1 − a)/(1 + a) · a^|z|, a = exp(−1/t): a chi-square test over z in [−6, 6] (the
    tails pooled) at t = 2, with power against t = 2.4, and at a scale of a float ε's exact
    fraction (ε = 0.3 is 5404319552844595/2^54: big-integer arithmetic) the mean |z| is t."""
    import random
    from fractions import Fraction

    from federation.merge.privacy import discrete_laplace

    rng = random.Random(2026)
    draws = np.array([discrete_laplace(Fraction(2), rng) for _ in range(60000)])

    def expected(t: float) -> np.ndarray:
        a = math.exp(-1 / t)
        inner = np.array([(1 - a) / (1 + a) * a ** abs(z) for z in range(-6, 7)])
        tail = (1 - inner.sum()) / 2
        return np.concatenate([[tail], inner, [tail]]) * len(draws)

    observed = np.concatenate([[np.sum(draws < -6)],
                               [np.sum(draws == z) for z in range(-6, 7)], [np.sum(draws > 6)]])
    assert stats.chisquare(observed, expected(2.0)).pvalue > 0.01
    assert stats.chisquare(observed, expected(2.4)).pvalue < 1e-6
    scale = Fraction(1001) / Fraction(0.3)
    wide = [discrete_laplace(scale, rng) for _ in range(4000)]
    assert all(isinstance(z, int) for z in wide)
    a = math.exp(-1 / float(scale))
    mean_abs = 2 * a / ((1 - a) * (1 + a))  # E|z| of the discrete Laplace, ≈ t
    assert np.mean(np.abs(wide)) == pytest.approx(mean_abs, rel=0.08)
    with pytest.raises(ValueError):
        discrete_laplace(Fraction(0), rng)


def test_a_release_lies_on_its_grid_whatever_the_mean():
    """The published figure is a whole number of grid steps (Δ/(K·2^20)) before the clamp: its
    low-order bits carry the draw only, not the float arithmetic of a continuous draw added to
    the mean (Mironov 2012)."""
    from federation.merge.privacy import GRID_STEPS

    step = 100.0 / 3 / GRID_STEPS
    rng = np.random.default_rng(4)
    for values in ([400.0, 500.0, 600.0], [400.0, 500.0, 600.1], [0.1, 0.2, 0.3]):
        value, _ = laplace_release(values, lower=-1e6, upper=1e6, sensitivity=100.0,
                                   epsilon=0.5, rng=rng)
        assert value / step == pytest.approx(round(value / step), abs=1e-6)


def test_the_composition_curve_is_each_prefix_composed_in_one_pass():
    """The Privacy page's ε′ curve composed every prefix of the rounds again (R²/2 steps per
    organization); `compose_prefixes` carries the sum, the count and the largest ε_r along, and
    gives exactly `compose` of each prefix (rounds of no spend included, as the page has them)."""
    from federation.merge.privacy import compose_prefixes

    rng = np.random.default_rng(3)
    spends = [float(e) for e in rng.choice([0.0, 0.05, 0.3, 1.7], size=60)] + [0.0]
    for delta in (1e-5, 0.3):
        assert compose_prefixes(spends, delta) == [
            compose(spends[: i + 1], delta) for i in range(len(spends))]
    assert compose_prefixes([]) == []
