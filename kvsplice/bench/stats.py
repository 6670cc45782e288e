"""Confidence intervals for accuracies measured on a few dozen requests: Wilson's score interval for
one rate, and Newcombe's score interval for the paired difference of two systems' rates on the same
requests (Newcombe 1998, "Improved confidence intervals for the difference between binomial
proportions based on paired data", method 10). Both stay inside [0, 1] (or [-1, 1]) and keep close to
their nominal coverage at small n and near 0 or 1, where the normal approximation fails."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# The two-sided 95% quantile of the standard normal.
Z95 = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    """An estimate with the bounds of its confidence interval."""

    estimate: float
    low: float
    high: float


def wilson(successes: int, n: int, z: float = Z95) -> Interval | None:
    """Wilson's score interval for successes / n; None for n = 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n], got {successes} of {n}")
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    # At p = 0 or 1 the interval touches the bound exactly; rounding must not move it off.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return Interval(p, low, high)


def paired_difference(pairs: Sequence[tuple[bool, bool]], z: float = Z95) -> Interval | None:
    """The difference rate(first) - rate(second) over pairs of outcomes on the same cases, with
    Newcombe's square-and-add interval from the two Wilson intervals, corrected for the correlation
    of the paired outcomes; None without pairs."""
    n = len(pairs)
    if n == 0:
        return None
    both = sum(1 for x, y in pairs if x and y)
    first_only = sum(1 for x, y in pairs if x and not y)
    second_only = sum(1 for x, y in pairs if y and not x)
    neither = n - both - first_only - second_only
    one, two = wilson(both + first_only, n, z), wilson(both + second_only, n, z)
    assert one is not None and two is not None
    p1, p2 = one.estimate, two.estimate
    # phi: the correlation of the paired outcomes, a positive one shrunk by n/2 as Newcombe does
    # (a continuity correction); 0 when a margin is empty (it is undefined then).
    margins = (both + first_only) * (second_only + neither) * (both + second_only) * (first_only + neither)
    cross: float = both * neither - first_only * second_only
    if cross > 0:
        cross = max(0.0, cross - n / 2)
    phi = cross / math.sqrt(margins) if margins else 0.0
    below = math.sqrt(
        max(0.0, (p1 - one.low) ** 2 - 2 * phi * (p1 - one.low) * (two.high - p2) + (two.high - p2) ** 2)
    )
    above = math.sqrt(
        max(0.0, (one.high - p1) ** 2 - 2 * phi * (one.high - p1) * (p2 - two.low) + (p2 - two.low) ** 2)
    )
    d = p1 - p2
    return Interval(d, max(-1.0, d - below), min(1.0, d + above))
