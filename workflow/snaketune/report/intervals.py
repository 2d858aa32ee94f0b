"""Whether a change between two models is within the noise: the interval of a difference from each figure's own 95%
interval.

The evaluate stage writes `<figure>_ci95` beside the preference figures (Wilson intervals of the accuracies); the
report reads them where they exist and computes the exact-match interval from the counts the stage records, with
the stage's own function (snaketune.evaluation.intervals.wilson_interval).
"""

from __future__ import annotations

import math


def difference_interval(
    a: float, a_ci: list[float], b: float, b_ci: list[float]
) -> tuple[float, float, float]:
    """b - a with a 95% interval built from each figure's own interval: Newcombe's hybrid score method
    (Newcombe 1998, "Interval estimation for the difference between independent proportions", method 10),
    which for symmetric intervals of means is the usual sqrt(se_a² + se_b²) one. It treats the two models'
    scores as independent; on the same questions they are paired and positively correlated, so the interval
    is, if anything, too wide: a change called beyond the noise here is beyond it."""
    d = b - a
    lo = d - math.hypot(b - b_ci[0], a_ci[1] - a)
    hi = d + math.hypot(b_ci[1] - b, a - a_ci[0])
    return d, lo, hi


def within_noise(interval: tuple[float, float, float]) -> bool:
    """Whether a difference's interval (difference_interval) holds zero."""
    _, lo, hi = interval
    return lo <= 0.0 <= hi
