"""``benchmarks.recipe.summarize``: one finished run's curve, gain and where its steps' time went."""

from __future__ import annotations

import json

import pytest

from benchmarks.recipe import summarize


def test_summarize_reads_the_curve_and_splits_the_step_time(tmp_path):
    rows = [{"step": 0, "kind": "eval", "success": 0.25, "pass_at_4": 0.5, "greedy_success": 0.5, "dead_rate": 0.2},
            {"step": 1, "kind": "train", "rollout_s": 2.0, "learn_s": 5.0, "step_s": 8.0, "invalid_rate": 0.1},
            {"step": 2, "kind": "train", "rollout_s": 4.0, "learn_s": 7.0, "step_s": 12.0, "sync_s": 1.0},
            {"step": 2, "kind": "eval", "success": 0.5, "pass_at_4": 0.75, "greedy_success": 0.625, "dead_rate": 0.1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"wall_s": 30.0}))
    r = summarize(tmp_path)
    assert r["eval_steps"] == [0, 2] and r["gain_points"] == pytest.approx(25.0) and r["dead_rate"] == [0.2, 0.1]
    assert r["max_invalid_rate"] == pytest.approx(0.1) and r["wall_s"] == 30.0
    # sync ran on one step of two: not a phase of every step, left out
    assert r["seconds_per_step"] == {"rollout": 3.0, "learn": 6.0, "step": 10.0}

