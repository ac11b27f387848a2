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


def test_kept_arms_keep_their_own_provenance(tmp_path):
    import json

    from benchmarks.frozenlake import main

    def run(seed, last):
        return {"seed": seed, "steps": [0, 30], "sampled_tokens": [0, 100], "success": [0.4, last],
                "pass_at_4": [0.5, 0.6], "greedy": [0.4, 0.5], "response_tokens": [4.0, 4.0], "turns": [5.0, 5.0],
                "tokens_per_step": 100.0, "trajectories_per_step": 8.0, "actions_per_step": 40.0,
                "groups_with_success": 0.5, "mixed_groups": 0.5, "expanded_per_step": 0.0, "pruned_per_step": 0.0,
                "checkpoints_per_step": 0.0, "dynamic_dropped_per_step": 0.0, "wall_s": 1.0}

    old = {"commit": "a" * 40, "dirty": False, "command": "python -m benchmarks.frozenlake --old", "machine": {},
           "date": "2026-12-01T00:00:00+00:00", "pilot_tokens_per_task": {"grpo": 100.0, "patr": 90.0},
           "arm_provenance": {"patr": {"commit": "b" * 40, "command": "the patr run"}},
           "runs": {"grpo": [run(0, 0.6), run(1, 0.7)], "patr": [run(0, 0.5), run(1, 0.8)]}}
    (tmp_path / "results.json").write_text(json.dumps(old))
    assert main(["--budget", "tokens", "--variants", "grpo", "patr", "--keep", "grpo", "patr",
                 "--out", str(tmp_path)]) == 0  # nothing runs: every arm is kept
    new = json.loads((tmp_path / "results.json").read_text())
    assert new["arm_provenance"]["grpo"]["commit"] == "a" * 40  # the old JSON's own
    assert new["arm_provenance"]["patr"] == {"commit": "b" * 40, "command": "the patr run"}  # merged before
    assert len(new["commit"]) == 40 and new["paired_vs_grpo"]["patr"]["seeds"] == [0, 1]
    assert (tmp_path / "table.md").is_file() and (tmp_path / "success.png").is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["commit"] == new["commit"] and set(summary["variants"]) == {"grpo", "patr"}


def test_frozenlake_names_the_pairs_whose_warm_starts_differ():
    from benchmarks.frozenlake import paired_against

    def run(seed, last, digest):
        return {"seed": seed, "success": [0.5, last], "warm_start_sha256": digest}

    results = {"grpo": [run(0, 0.6, "a"), run(1, 0.7, "b"), run(2, 0.5, None)],
               "patr": [run(0, 0.8, "a"), run(1, 0.7, "B"), run(2, 0.6, "c")]}  # seed 2: one digest unknown
    assert paired_against(results)["patr"]["warm_start_differs"] == [1]


def test_the_table_on_sokoban_shows_dead_states_and_not_the_papers_frozenlake_numbers():
    from benchmarks.frozenlake import summarize, table

    def run(seed, last, dead):
        return {"seed": seed, "success": [0.4, last], "pass_at_4": [0.5, 0.6], "greedy": [0.4, 0.5],
                "response_tokens": [4.0, 4.0], "turns": [5.0, 5.0], "dead_rate": dead}

    sokoban = summarize({"grpo": [run(0, 0.6, [0.2, 0.1]), run(1, 0.7, [0.2, 0.3])]})
    assert sokoban["grpo"]["dead_rate"] == pytest.approx((0.2, 0.1414213))
    md = table(sokoban, "sokoban", paper=False)
    head, row = md.splitlines()[2], md.splitlines()[4]
    assert "dead states" in head and "paper" not in head and "| 20.0 ± 14.1 |" in row
    assert head.count("|") == row.count("|")
    # FrozenLake's runs record no dead states (older ones no key at all): no column, the paper's numbers
    frozen = summarize({"grpo": [{**run(0, 0.6, [None, None])}, {k: v for k, v in run(1, 0.7, []).items()
                                                                 if k != "dead_rate"}]})
    md = table(frozen, "frozenlake")
    assert "dead states" not in md and "66.5 / 67.0 / 513 / 3.4" in md
