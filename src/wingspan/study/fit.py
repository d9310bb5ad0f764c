"""The log-linear fit tau = a + b * ln(D), with R^2 and confidence intervals from Student's t, and the
prompt bootstrap that says how much a measured tau would move on other prompts.

Ordinary least squares on x = ln(D). The intervals are the textbook ones for a straight-line fit,
estimate +- t_{(1+c)/2, n-2} * standard error, so they need at least three depths (n - 2 >= 1 degree of
freedom); with two the line is exact and no interval is given. The fit's interval only sees the scatter of
the taus around the line; the bootstrap sees the sampling noise of each tau itself.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from wingspan.eval.metrics import acceptance_length

Item = TypeVar("Item")


@dataclass
class LogFit:
    a: float  # tau at D = 1
    b: float  # tau gained per e-fold of depth (b * ln 2 per doubling)
    r2: float | None  # None with two depths (a line through two points is exact) or when every tau is the same
    n: int
    confidence: float
    a_interval: tuple[float, float] | None
    b_interval: tuple[float, float] | None

    def predict(self, depth: float) -> float:
        return self.a + self.b * math.log(depth)


def fit_log_linear(depths: list[int], taus: list[float], confidence: float = 0.95) -> LogFit:
    """Least-squares fit of tau = a + b ln(depth) over at least two distinct depths."""
    if len(depths) != len(taus):
        raise ValueError(f"{len(depths)} depths but {len(taus)} taus")
    if len(set(depths)) < 2:
        raise ValueError(f"a fit needs at least two distinct depths, got {sorted(set(depths))}")
    if min(depths) < 1:
        raise ValueError(f"depths must be >= 1, got {depths}")
    n = len(depths)
    xs = [math.log(d) for d in depths]
    mean_x, mean_y = sum(xs) / n, sum(taus) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    b = log_slope(depths, taus)
    a = mean_y - b * mean_x
    residual = sum((y - a - b * x) ** 2 for x, y in zip(xs, taus))
    total = sum((y - mean_y) ** 2 for y in taus)
    r2 = 1 - residual / total if total > 0 and n > 2 else None
    if n < 3:
        return LogFit(a, b, r2, n, confidence, None, None)
    variance = residual / (n - 2)
    t = t_quantile((1 + confidence) / 2, n - 2)
    b_half = t * math.sqrt(variance / sxx)
    a_half = t * math.sqrt(variance * (1 / n + mean_x**2 / sxx))
    return LogFit(a, b, r2, n, confidence, (a - a_half, a + a_half), (b - b_half, b + b_half))


def log_slope(depths: Sequence[int], taus: Sequence[float]) -> float:
    """The least-squares b of tau = a + b ln(depth) alone: cheap enough to refit thousands of resamples."""
    xs = [math.log(d) for d in depths]
    mean_x, mean_y = sum(xs) / len(xs), sum(taus) / len(taus)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, taus)) / sum((x - mean_x) ** 2 for x in xs)


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with `df` degrees of freedom (Simpson's rule on the density, |error| < 1e-9)."""
    if x < 0:
        return 1 - t_cdf(-x, df)
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(u: float) -> float:
        return scale * (1 + u * u / df) ** (-(df + 1) / 2)

    intervals = 4000
    h = x / intervals
    inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, intervals))
    return 0.5 + h / 3 * (density(0.0) + inner + density(x))


def t_quantile(p: float, df: int) -> float:
    """The x with t_cdf(x, df) = p, for 0.5 <= p < 1 (bisection)."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def prompts_tau(prompts: Sequence[tuple[int, int]]) -> float | None:
    """tau over (rounds, accepted drafts) per prompt, pooled as the evaluation pools a set: all tokens over
    all rounds."""
    return acceptance_length(sum(r for r, _ in prompts), sum(a for _, a in prompts))


def bootstrap_interval(
    strata: Sequence[Sequence[Item]],
    statistic: Callable[[list[Item]], float],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile interval of `statistic` over resamples that draw each stratum's items (prompts of one set)
    with replacement, as many as it has. Seeded, so a report says the same thing every time it is written."""
    if not all(strata):
        raise ValueError("every stratum needs at least one item")
    rng = random.Random(seed)
    values = sorted(statistic([rng.choice(items) for items in strata for _ in items]) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return values[int(tail * (resamples - 1))], values[math.ceil((1 - tail) * (resamples - 1))]
