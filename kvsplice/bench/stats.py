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
    return _wilson(successes, n, z)


def _wilson(successes: float, n: float, z: float) -> Interval:
    """wilson for counts that may be fractional (outcomes scaled to another number of requests)."""
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
    if not pairs:
        return None
    return _paired_counts(*_outcomes(pairs), z)


def _outcomes(pairs: Sequence[tuple[bool, bool]]) -> tuple[int, int, int, int]:
    """How many pairs are (both, first only, second only, neither)."""
    both = sum(1 for x, y in pairs if x and y)
    first_only = sum(1 for x, y in pairs if x and not y)
    second_only = sum(1 for x, y in pairs if y and not x)
    return both, first_only, second_only, len(pairs) - both - first_only - second_only


def _paired_counts(both: float, first_only: float, second_only: float, neither: float, z: float) -> Interval:
    """paired_difference from the counts of the four outcomes (fractional where scaled)."""
    n = both + first_only + second_only + neither
    one, two = _wilson(both + first_only, n, z), _wilson(both + second_only, n, z)
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


# requests_to_show looks no further: a million paired requests is beyond any benchmark run.
MAX_REQUESTS = 1_000_000


def requests_to_show(pairs: Sequence[tuple[bool, bool]], floor: float, z: float = Z95) -> int | None:
    """How many pairs, in the proportions of `pairs` (both, first only, second only, neither), the paired
    difference's interval needs before its lower bound reaches `floor` (a target such as "at most 2
    points below": -0.02); None where the estimate itself is at or below `floor` (no number of
    requests shows it) or it takes more than MAX_REQUESTS."""
    if not pairs:
        return None
    n0 = len(pairs)
    counts = _outcomes(pairs)
    if (counts[1] - counts[2]) / n0 <= floor:
        return None

    def shows(n: int) -> bool:
        both, first, second, neither = (c * n / n0 for c in counts)
        return _paired_counts(both, first, second, neither, z).low >= floor

    high = n0
    while not shows(high):
        if high >= MAX_REQUESTS:
            return None
        high = min(2 * high, MAX_REQUESTS)
    low = 0  # the bound only narrows as n grows: bisect between a failing and a showing n
    while high - low > 1:
        mid = (low + high) // 2
        if shows(mid):
            high = mid
        else:
            low = mid
    return high
