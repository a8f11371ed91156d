"""Statistics the evals and the report share: Wilson intervals for rates, bootstrap intervals over
groups (passages) for ratios of sums, percentiles."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (95% by default) for a binomial rate; (0, 1) when there is no trial."""
    if total <= 0:
        return 0.0, 1.0
    rate = successes / total
    denominator = 1 + z * z / total
    centre = (rate + z * z / (2 * total)) / denominator
    half = z * math.sqrt(rate * (1 - rate) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


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
