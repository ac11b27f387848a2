"""Every rollout strategy trains on Sokoban: one real (tiny) step each, through the embedded server,
with Sokoban progress ranking PaTR's branches and, for PaTR, as a per-turn process reward.

The default suite runs PaTR (with evaluation and the process reward); the other
strategies' trainer steps are ``slow``. Each strategy's Sokoban groups are also rolled out against
a real HTTP server in the default suite (``tests/rollout/test_tree.py::test_every_strategy_rolls_out_sokoban``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxprm.train.config import load_config
from jaxprm.train.loop import train
from jaxprm.train.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.greedy=true",
    "eval.every_steps=1", "eval.at_start=false", "warm_start.enabled=false", "progress=false", "plots=false", "export_final=false",
    "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2", "env.max_turns=4",
    "env.invalid_ends_episode=false", "rollout.tasks_per_step=2", "steps=1", "checkpoint.every_steps=100",
    "rollout.max_branches=4",
]
PRM = ["prm.enabled=true", "prm.scorers=[{path: scorers.SokobanProgressScorer, kwargs: {mode: delta}}]",
       "rollout.export=concat", "advantage.token_rewards_as_adv=true"]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("strategy, extra", [
    ("patr", PRM),
    pytest.param("flat", [], marks=SLOW), pytest.param("tree_random", [], marks=SLOW),
    pytest.param("arpo", [], marks=SLOW), pytest.param("dapo", [], marks=SLOW),
])
def test_every_strategy_takes_a_training_step_on_sokoban(tmp_path, strategy, extra):
    cfg = load_config(ROOT / "configs/sokoban.yaml", [*SMALL, f"rollout.strategy={strategy}", f"run_dir={tmp_path / 'run'}",
                                                      f"warm_start.cache_dir={tmp_path / 'cache'}", *extra])
    summary = train(cfg)
    rows = read_metrics(Path(summary.run_dir) / "metrics.jsonl")
    (row,) = [r for r in rows if r["kind"] == "train"]
    assert row["trajectories"] > 0
    assert "loss" in row or strategy == "dapo"  # DAPO skips a step whose groups all agree
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [1]
    assert {"success", "greedy_success", "dead_rate", "greedy_dead_rate"} <= set(evals[-1])
    assert 0 <= evals[-1]["dead_rate"] <= 1
    if strategy == "patr":
        assert any("sokoban_progress" in k for k in row)  # the process reward's metrics


def test_the_warm_start_demonstrations_follow_the_solver_on_sokoban():
    """Noisy solver demonstrations, tokenized as rollouts: all optimal moves solve every level."""
    from jaxprm.models import build_tiny_tokenizer
    from jaxprm.train import adapters
    from jaxprm.train.warmstart import make_demos

    cfg = load_config(ROOT / "configs/sokoban.yaml", ["env.train_tasks=8", "env.eval_tasks=1", "eval.num_tasks=1"])
    tasks, _ = adapters.tasks(cfg)
    tok = build_tiny_tokenizer()
    factory = adapters.env_factory(cfg)
    perfect = make_demos(tasks, tok, n=8, optimal_prob=1.0, seed=0, env_factory=factory)
    assert all(d.success and d.turns == t.optimal_length for d, t in zip(perfect, tasks))
    noisy = make_demos(tasks, tok, n=8, optimal_prob=0.5, seed=0, env_factory=factory)
    assert sum(d.turns for d in noisy) > sum(d.turns for d in perfect)
    assert all(len(d.tokens) == len(d.mask) for d in noisy)
