"""``benchmarks.proxy_learning``'s bookkeeping without training: each agent arm (on the trainer's
loop, in a child process) against the tree path, seed by seed; the arms' configs may differ only in
what the arm sets."""

from __future__ import annotations

import pytest
import yaml

from benchmarks.proxy_learning import _overrides, _print_summary, _summary, check_same_settings


def _run(arm, seed, rollout_s, last):
    return {"arm": arm, "seed": seed, "steps": [0, 10], "success": [0.3, last], "train_success_mean": 0.4,
            "sampled_actions": 100, "generated_tokens": 500, "rollout_s": rollout_s}


def test_each_agent_arm_is_set_against_the_tree_path(capsys):
    runs = [_run("agent", 0, 40.0, 0.5), _run("agent_processes", 0, 25.0, 0.5), _run("tree", 0, 20.0, 0.45),
            _run("agent", 1, 30.0, 0.6), _run("agent_processes", 1, 24.0, 0.6), _run("tree", 1, 20.0, 0.6)]
    s = _summary(runs, ["agent", "agent_processes", "tree"])
    assert s["rollout_time_ratio"]["agent_over_tree"] == pytest.approx([2.0, 1.5])
    assert s["rollout_time_ratio_agent_processes"]["agent_over_tree"] == pytest.approx([1.25, 1.2])
    assert s["agent_processes_minus_tree"]["last"] == pytest.approx([0.05, 0.0])
    assert all(s["rollout_time_ratio_agent_processes"]["same_generated_tokens"])
    _print_summary(s, runs, ["agent", "agent_processes", "tree"])
    assert "rollout seconds agent_processes / tree, per seed: 25.0 / 20.0 = 1.25x" in capsys.readouterr().out


def test_arms_differ_only_in_what_they_set(tmp_path):
    assert "agent.processes=1" in _overrides("agent_processes", 0, tmp_path, None, [])
    for arm, extra in (("a", {"rollout": {"source": "agent"}, "agent": {"processes": 1}}),
                       ("t", {"rollout": {"source": "tree"}, "agent": {"processes": 0}})):
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "config.yaml").write_text(yaml.safe_dump({**extra, "run_dir": arm, "steps": 3}))
    assert check_same_settings(tmp_path / "a", tmp_path / "t") == []
    (tmp_path / "t" / "config.yaml").write_text(yaml.safe_dump({"rollout": {"source": "tree"}, "steps": 4}))
    assert check_same_settings(tmp_path / "a", tmp_path / "t") == ["steps"]
