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


def test_frozenlake_pairs_runs_by_seed_and_reports_the_sample_std():
    from benchmarks.frozenlake import _ms, paired_against

    run = lambda seed, first, last: {"seed": seed, "success": [first, last]}  # noqa: E731
    results = {"grpo": [run(0, 0.5, 0.6), run(1, 0.5, 0.7), run(2, 0.4, 0.5)],
               "patr_sibling": [run(2, 0.4, 0.6), run(0, 0.5, 0.8)]}  # seed 1 never ran
    c = paired_against(results)["patr_sibling"]
    assert c["seeds"] == [0, 2]
    assert c["final_success"]["mean_diff"] == pytest.approx(15.0)  # seed 0: +20, seed 2: +10 points
    assert c["gain"]["n"] == 2 and c["gain"]["mean_diff"] == pytest.approx(15.0)
    assert _ms([1.0, 2.0, 3.0, None]) == pytest.approx((2.0, 1.0)) and _ms([4.0]) == (4.0, 0.0)
