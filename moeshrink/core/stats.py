"""Statistics the evals and the report share: Wilson intervals for rates, bootstrap intervals over
groups (passages) for ratios of sums, percentiles."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

from moeshrink.core.errors import MoeshrinkError

Z95 = 1.959963984540054


class StatsError(MoeshrinkError, ValueError):
    pass


def wilson(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (95% by default) for a binomial rate; (0, 1) when there is no trial."""
    if total <= 0:
        return 0.0, 1.0
    rate = successes / total
    denominator = 1 + z * z / total
    centre = (rate + z * z / (2 * total)) / denominator
    half = z * math.sqrt(rate * (1 - rate) / total + z * z / (4 * total * total)) / denominator
    # at 0 of n and n of n the bound is exactly 0 or 1; floating point lands a hair inside it
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == total else min(1.0, centre + half)
    return low, high


def rate_with_ci(successes: int, total: int) -> dict:
    low, high = wilson(successes, total)
    return {"value": successes / total if total else None, "count": successes, "total": total,
            "ci95": [low, high], "ci_method": "Wilson score, 95%"}


def bootstrap_ratio_ci(numerators: Sequence[float], denominators: Sequence[float], resamples: int = 2000,
                       seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of sum(numerators) / sum(denominators), resampling the groups
    (for agreement: passages, so that positions of one passage move together)."""
    groups = len(numerators)
    if groups == 0:
        return math.nan, math.nan
    rng = random.Random(seed)
    estimates = []
    for _ in range(resamples):
        picks = [rng.randrange(groups) for _ in range(groups)]
        denominator = sum(denominators[i] for i in picks)
        if denominator:
            estimates.append(sum(numerators[i] for i in picks) / denominator)
    estimates.sort()
    tail = (1 - level) / 2
    return estimates[int(tail * (len(estimates) - 1))], estimates[int((1 - tail) * (len(estimates) - 1))]


def percentiles(values: Sequence[float], points: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    out = {f"p{p:g}": ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] for p in points}
    out["max"] = ordered[-1]
    return out


Z95_ONE_SIDED = 1.6448536269514722


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Exact McNemar test, two-sided: the binomial test of the discordant pairs against 1/2 (items
    right only for A vs right only for B). 1.0 when there is no discordant pair."""
    _check_counts(only_a=only_a, only_b=only_b)
    discordant = only_a + only_b
    if discordant == 0:
        return 1.0
    smaller = min(only_a, only_b)
    # P(X <= smaller) for X ~ Binomial(discordant, 1/2)
    tail = sum(math.exp(_log_comb(discordant, k) - discordant * math.log(2)) for k in range(smaller + 1))
    return min(1.0, 2 * tail)


def paired_drop(n: int, only_ref: int, only_build: int) -> dict:
    """Accuracy points a build loses against the reference on the same n items, drop = (b - c) / n, and
    the one-sided 95% upper bound of that loss ("at worst"): Agresti and Min's adjusted Wald interval
    for a paired difference (half an item added to each of the four cells), which, unlike the plain
    Wald bound, does not collapse onto the drop when there are few or no discordant pairs."""
    _check_counts(n=n, only_ref=only_ref, only_build=only_build)
    if only_ref + only_build > n:
        raise StatsError(f"discordant pairs ({only_ref} + {only_build}) exceed the {n} items")
    if n == 0:
        raise StatsError("no paired item: the drop is undefined")
    drop = (only_ref - only_build) / n
    b, c, total = only_ref + 0.5, only_build + 0.5, n + 2
    centre = (b - c) / total
    standard_error = math.sqrt(max(0.0, (b + c) - (b - c) ** 2 / total)) / total
    at_worst = max(drop, min(1.0, centre + Z95_ONE_SIDED * standard_error))
    return {"drop_points": 100 * drop, "at_worst_points": 100 * at_worst,
            "method": "paired difference of proportions; at worst: one-sided 95% upper bound, "
                      "Agresti-Min adjusted Wald (z = 1.645)"}


Z80 = 0.8416212335729143  # one-sided quantile for 80% power


def min_detectable_drop(n: int, only_ref: int, only_build: int, z_alpha: float = Z95_ONE_SIDED,
                        z_power: float = Z80) -> float:
    """The smallest loss, in points, a paired comparison of n items would detect with a one-sided
    test at the 5% level and 80% power, given its discordance. Connor's (1987) normal approximation
    for McNemar's test, n = (z_a sqrt(psi) + z_b sqrt(psi - d^2))^2 / d^2, solved for d; the
    discordant share psi is estimated as (b + c + 1) / (n + 2) (finite with no disagreement) and is
    at least d, since a loss of d points makes at least d of the items disagree."""
    _check_counts(n=n, only_ref=only_ref, only_build=only_build)
    if n == 0:
        raise StatsError("no paired item: nothing could be detected")
    observed = (only_ref + only_build + 1) / (n + 2)

    def margin(d: float) -> float:  # > 0 while d is still too small to detect
        psi = max(observed, d)
        return z_alpha * math.sqrt(psi) + z_power * math.sqrt(max(0.0, psi - d * d)) - d * math.sqrt(n)

    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if margin(middle) > 0 else (low, middle)
    return 100 * high


def fisher_exact(bad_a: int, total_a: int, bad_b: int, total_b: int) -> float:
    """Fisher's exact test, two-sided, on the 2x2 table [[bad_a, total_a - bad_a], [bad_b, total_b - bad_b]]:
    the probability, with all margins fixed, of a table no more likely than the one observed."""
    _check_counts(bad_a=bad_a, total_a=total_a, bad_b=bad_b, total_b=total_b)
    if bad_a > total_a or bad_b > total_b:
        raise StatsError(f"more bad items than items: {bad_a} of {total_a}, {bad_b} of {total_b}")
    bad = bad_a + bad_b
    low, high = max(0, bad - total_b), min(bad, total_a)

    log_p = {x: _log_comb(total_a, x) + _log_comb(total_b, bad - x) - _log_comb(total_a + total_b, bad)
             for x in range(low, high + 1)}
    # scipy's tolerance: tables within a relative 1e-7 of the observed probability count as "as extreme"
    threshold = log_p[bad_a] + math.log1p(1e-7)
    return min(1.0, sum(math.exp(value) for value in log_p.values() if value <= threshold))


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise StatsError(f"{name} must be a count (an integer >= 0), got {value!r}")
