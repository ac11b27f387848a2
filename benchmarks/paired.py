"""Paired statistics for comparing two training arms seed by seed (one helper for every benchmark).

The convention, stated once: arm ``a`` against arm ``b`` on the same seeds (same warm start, same
tasks), ``d_i = a_i - b_i``. Reported: the number of pairs, each arm's mean and *sample* std
(``ddof=1``), the mean paired difference, the sample std of the differences, its 95% confidence
interval ``mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n)`` (Student's t), and the two-sided Wilcoxon
signed-rank p (exact for small samples; zero differences dropped; ``None`` when every difference
is zero). "``a`` beats ``b``" needs the CI above zero.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["paired_comparison", "format_comparison"]


def paired_comparison(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int | None]:
    """The paired comparison of ``a`` against ``b`` (see the module docstring). Needs two or more
    pairs of finite numbers."""
    from scipy import stats

    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} and {len(b)}")
    if len(a) < 2:
        raise ValueError(f"a paired comparison needs >= 2 pairs, got {len(a)}")
    if not all(math.isfinite(x) for x in (*a, *b)):
        raise ValueError("paired samples must be finite")
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean, sd = statistics.mean(d), statistics.stdev(d)
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    p = None if all(x == 0 for x in d) else float(stats.wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)
    return {"n": n, "mean_a": statistics.mean(a), "std_a": statistics.stdev(a), "mean_b": statistics.mean(b),
            "std_b": statistics.stdev(b), "mean_diff": mean, "std_diff": sd, "ci95_low": mean - half,
            "ci95_high": mean + half, "wilcoxon_p": p}


def format_comparison(name: str, c: dict) -> str:
    """One line: ``name: +d (95% CI [lo, hi]), Wilcoxon p, n pairs``."""
    p = "n/a" if c["wilcoxon_p"] is None else f"{c['wilcoxon_p']:.3f}"
    return (f"{name}: {c['mean_diff']:+.1f} (95% CI [{c['ci95_low']:+.1f}, {c['ci95_high']:+.1f}], "
            f"sd {c['std_diff']:.1f}), Wilcoxon p = {p}, {c['n']} pairs")
