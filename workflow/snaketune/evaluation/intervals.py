"""95% intervals of shares, torch-free: the evaluate stage writes them beside its accuracies
(snaketune.evaluation.scores), and the report computes the same interval where a stage recorded only the counts
(snaketune.report.headline) and uses the same quantile for its own intervals (snaketune.report.benchmark). One
function and one constant, so the two layers can never disagree on an interval."""

from __future__ import annotations

import math

Z95 = 1.959963984540054
"""The standard normal's 97.5% quantile (statistics.NormalDist().inv_cdf(0.975)): two-sided 95% intervals."""


def wilson_interval(wins: int, n: int, z: float = Z95) -> list[float]:
    """Wilson's score interval of a share (wins of n): unlike the normal approximation it stays inside [0, 1]
    and is honest at the small n of a held-out pair set or the builtin questions (a few dozen to 200 here)."""
    if n == 0:
        return [0.0, 1.0]
    p = wins / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]
