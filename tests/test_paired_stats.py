"""benchmarks.paired: the paired comparison's numbers against hand-computed values."""

from __future__ import annotations

import math

import pytest

from benchmarks.paired import format_comparison, paired_comparison


def test_paired_comparison_by_hand():
    c = paired_comparison([3.0, 5.0, 7.0, 9.0], [2.0, 3.0, 4.0, 5.0])  # d = 1, 2, 3, 4
    sd = math.sqrt(5 / 3)  # sample std of 1..4
    half = 3.182446305284263 * sd / 2  # t_{0.975, 3}
    assert c["n"] == 4 and c["mean_diff"] == pytest.approx(2.5) and c["std_diff"] == pytest.approx(sd)
    assert c["ci95_low"] == pytest.approx(2.5 - half) and c["ci95_high"] == pytest.approx(2.5 + half)
    assert c["wilcoxon_p"] == pytest.approx(2 / 16)  # exact: all four signs positive, two-sided
    assert c["std_a"] == pytest.approx(math.sqrt(20 / 3))
    assert "+2.5 (95% CI [+0.4, +4.6]" in format_comparison("x", c)


def test_paired_comparison_refuses_what_it_cannot_pair():
    with pytest.raises(ValueError, match="differ in length"):
        paired_comparison([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=">= 2 pairs"):
        paired_comparison([1.0], [1.0])
    assert paired_comparison([1.0, 2.0], [1.0, 2.0])["wilcoxon_p"] is None
