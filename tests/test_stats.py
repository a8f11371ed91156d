"""The paired statistics the report rests on, against scipy and hand-computed cases, and the CLI that
re-checks a published report."""
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as scipy_stats

from moeshrink.core import stats


@pytest.mark.parametrize("only_a, only_b", [(0, 0), (0, 5), (5, 0), (7, 14), (30, 12), (300, 216), (1, 1)])
def test_mcnemar_is_scipys_exact_binomial_test_on_the_discordant_pairs(only_a, only_b):
    expected = scipy_stats.binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    assert stats.mcnemar_exact(only_a, only_b) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_mcnemar_by_hand():
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # both tails of Binomial(5, 1/2) at 0 and 5
    assert stats.mcnemar_exact(1, 3) == pytest.approx(2 * 5 / 16)  # P(X <= 1) = (1 + 4) / 16, doubled


def test_fisher_matches_scipy_on_random_tables():
    rng = random.Random(0)
    for _ in range(200):
        total_a, total_b = rng.randrange(1, 2000), rng.randrange(1, 2000)
        bad_a, bad_b = rng.randrange(total_a + 1), rng.randrange(total_b + 1)
        expected = scipy_stats.fisher_exact([[bad_a, total_a - bad_a], [bad_b, total_b - bad_b]]).pvalue
        assert stats.fisher_exact(bad_a, total_a, bad_b, total_b) == pytest.approx(expected, rel=1e-8, abs=1e-300)


def test_fisher_by_hand():
    # [[1, 1], [0, 2]]: tables with column total 1 -> x = 0 (p = 1/2) or 1 (p = 1/2); both as likely
    assert stats.fisher_exact(1, 2, 0, 2) == pytest.approx(1.0)
    # [[3, 0], [0, 3]]: x = 3 has p = 1/20, x = 0 as well; sum = 1/10
    assert stats.fisher_exact(3, 3, 0, 3) == pytest.approx(0.1)


def test_drop_bound_by_hand():
    # no discordant pair: drop 0; Agresti-Min adds half an item per cell: se = sqrt(1) / 102
    result = stats.paired_drop(100, 0, 0)
    assert result["drop_points"] == 0
    assert result["at_worst_points"] == pytest.approx(100 * 1.6448536269514722 / 102)
    # b = 30, c = 12 of 100: centre 18 / 102, se = sqrt(43 - 18^2 / 102) / 102
    result = stats.paired_drop(100, 30, 12)
    assert result["drop_points"] == pytest.approx(18.0)
    expected = 18 / 102 + 1.6448536269514722 * math.sqrt(43 - 18**2 / 102) / 102
    assert result["at_worst_points"] == pytest.approx(100 * expected)
    # the published scale: a 0.6-point drop on 14,042 questions is bounded within about 0.3 points
    result = stats.paired_drop(14042, 300, 216)
    assert result["drop_points"] == pytest.approx(0.598, abs=1e-3)
    assert 0.8 < result["at_worst_points"] < 0.9


def test_drop_bound_never_below_the_drop_and_covers_the_truth():
    """The one-sided bound holds the true drop in about 95% of simulated paired runs."""
    rng = random.Random(1)
    p_only_ref, p_only_build, n, covered, runs = 0.06, 0.05, 400, 0, 2000
    true_drop = 100 * (p_only_ref - p_only_build)
    for _ in range(runs):
        b = c = 0
        for _ in range(n):
            u = rng.random()
            b += u < p_only_ref
            c += p_only_ref <= u < p_only_ref + p_only_build
        result = stats.paired_drop(n, b, c)
        assert result["at_worst_points"] >= result["drop_points"]
        covered += result["at_worst_points"] >= true_drop
    assert 0.93 <= covered / runs <= 0.98


@pytest.mark.parametrize("n, discordance", [(220, 0.06), (600, 0.10), (1500, 0.04)])
def test_minimum_detectable_drop_has_80_percent_power_in_simulation(n, discordance):
    """Paired runs whose true drop is the minimum detectable drop (at that discordance): the
    one-sided exact McNemar test at 5% rejects in about 80% of them."""
    expected_discordant = round(discordance * n)
    detectable = stats.min_detectable_drop(n, expected_discordant // 2, expected_discordant - expected_discordant // 2)
    true_drop = detectable / 100
    p_ref_only, p_build_only = (discordance + true_drop) / 2, max(0.0, (discordance - true_drop) / 2)
    rng = np.random.default_rng(0)
    runs, rejected = 2000, 0
    for _ in range(runs):
        cells = rng.multinomial(n, [p_ref_only, p_build_only, 1 - p_ref_only - p_build_only])
        b, c = int(cells[0]), int(cells[1])
        # one-sided exact test of "the build loses": P(X >= b), X ~ Binomial(b + c, 1/2)
        rejected += b + c > 0 and scipy_stats.binomtest(b, b + c, 0.5, alternative="greater").pvalue <= 0.05
    assert 0.70 <= rejected / runs <= 0.90, (detectable, rejected / runs)


def test_minimum_detectable_drop_shrinks_with_items_and_grows_with_discordance():
    assert stats.min_detectable_drop(4000, 100, 100) < stats.min_detectable_drop(1000, 25, 25)
    assert stats.min_detectable_drop(1000, 100, 100) > stats.min_detectable_drop(1000, 10, 10)
    assert 0 < stats.min_detectable_drop(50, 0, 0) <= 100


@pytest.mark.parametrize("call, message", [
    (lambda: stats.paired_drop(10, 8, 5), "exceed the 10 items"),
    (lambda: stats.paired_drop(0, 0, 0), "undefined"),
    (lambda: stats.mcnemar_exact(-1, 2), "only_a must be a count"),
    (lambda: stats.fisher_exact(5, 4, 0, 4), "more bad items than items"),
])
def test_bad_counts_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeshrink", "stats", *args], capture_output=True, text=True,
                          timeout=120)


def test_stats_cli_prints_json():
    assert json.loads(_cli("mcnemar", "--only-ref", "0", "--only-build", "5").stdout) == {"p_value": 0.0625}
    bound = json.loads(_cli("drop-bound", "--n", "100", "--only-ref", "30", "--only-build", "12").stdout)
    assert bound["drop_points"] == pytest.approx(18.0) and bound["at_worst_points"] > 18
    fisher = json.loads(_cli("fisher", "--bad-a", "3", "--total-a", "3", "--bad-b", "0", "--total-b", "3").stdout)
    assert fisher["p_value"] == pytest.approx(0.1)
    bad = _cli("fisher", "--bad-a", "9", "--total-a", "3", "--bad-b", "0", "--total-b", "3")
    assert bad.returncode == 2 and "more bad items than items" in bad.stderr


@pytest.mark.parametrize("total", [1, 7, 300, 1020, 1565])
def test_a_wilson_interval_holds_its_rate_at_none_and_at_all(total):
    """At 0 of n the lower bound is exactly 0 and at n of n the upper exactly 1 (in floating point the
    formula lands a hair inside, 0.9999999999999999 at 1,020 of 1,020, which put the rate outside)."""
    for successes in (0, total):
        figure = stats.rate_with_ci(successes, total)
        assert figure["ci95"][0] <= figure["value"] <= figure["ci95"][1]
    assert stats.wilson(0, total)[0] == 0.0 and stats.wilson(total, total)[1] == 1.0
    low, high = stats.wilson(total, total)
    assert low == pytest.approx(total / (total + stats.Z95 ** 2), rel=1e-12)  # the closed form at n of n
