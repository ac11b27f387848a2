"""The baselines' strategies in real (tiny) training steps: DAPO's dynamic sampling and overlong
shaping, ARPO's budget, and the paper-faithful PaTR mode (no refill, Theta at checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxprm.train.config import load_config
from jaxprm.train.loop import train
from jaxprm.train.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "env.train_tasks=32", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=1", "eval.greedy=false",
    "eval.at_start=false", "warm_start.enabled=false", "progress=false", "plots=false", "export_final=false",
    "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2", "env.max_turns=4",
    "env.invalid_ends_episode=false", "rollout.tasks_per_step=3", "steps=1", "checkpoint.every_steps=100",
]


def _row(config: str, tmp_path: Path, *extra: str) -> dict:
    cfg = load_config(ROOT / config, [*SMALL, f"run_dir={tmp_path / 'run'}", *extra])
    summary = train(cfg)
    (row,) = [r for r in read_metrics(Path(summary.run_dir) / "metrics.jsonl") if r["kind"] == "train"]
    return row


def test_dapo_keeps_only_mixed_groups_and_rolls_out_again_until_the_batch_is_full(tmp_path):
    row = _row("configs/dapo.yaml", tmp_path, "rollout.temperature=2.0")
    rounds, want = row["dynamic_rounds"], 3
    assert 1 <= rounds <= 3
    rolled = rounds * want
    assert row["trajectories"] == rolled * 4  # every round's groups are counted in the row
    mixed = round(row["mixed_groups"] * rolled)
    assert row["kept_groups"] == min(want, mixed)
    assert row["dynamic_dropped_groups"] == rolled - mixed
    assert rounds == 3 or row["kept_groups"] == want  # it stops early only with a full batch
    assert 0 <= row["overlong_punished"] <= 1 and row["overlong_penalty_mean"] <= 0


@pytest.mark.slow  # default coverage: tests/rollout/test_tree.py::test_group_sizes_match_config (arpo)
def test_arpo_spends_exactly_the_group_budget(tmp_path):
    row = _row("configs/arpo.yaml", tmp_path, "rollout.max_branches=4")
    assert row["trajectories"] == 3 * 4
    assert "expanded" in row


@pytest.mark.slow  # default coverage: test_tree.py's tree_random-without-refill and theta_at=checkpoint tests
def test_the_paper_faithful_patr_never_refills(tmp_path):
    row = _row("configs/patr_paper.yaml", tmp_path)
    assert row["refills"] == 0
    assert row["trajectories"] <= 3 * (2 + 1)  # b0 roots, one expanded into 2 at the one checkpoint of 4 turns


def test_a_dapo_token_cap_stops_the_rounds_once_it_is_spent(tmp_path):
    row = _row("configs/dapo.yaml", tmp_path, "rollout.temperature=2.0", "rollout.dapo.max_tokens_per_step=1")
    assert row["dynamic_rounds"] == 1  # the first round always runs; it spends the cap
    assert row["trajectories"] == 3 * 4
    assert row["dynamic_token_capped"] == float(row["kept_groups"] < 3)


@pytest.mark.parametrize("estimator", ["tree_value", pytest.param("sibling", marks=pytest.mark.slow),
                                       pytest.param("anchor_state", marks=pytest.mark.slow)])
def test_a_tree_credit_estimator_trains_from_patr_trees(tmp_path, estimator):
    """PaTR trees through the packed step with each tree estimator: the rows carry their turns and
    the step trains (under tree_value a shared turn counts once: fewer trained tokens than rows)."""
    row = _row("configs/default.yaml", tmp_path, f"advantage.estimator={estimator}", "rollout.temperature=2.0")
    assert row["updates"] >= 1 and row["trained_tokens"] > 0
    assert row["adv_abs_mean"] > 0 or row["mixed_groups"] == 0


def test_a_token_budget_stops_the_run_and_places_the_evals(tmp_path):
    """Equal cost enforced: the run stops at the step whose sampled tokens reach token_budget and
    evaluates where the tokens first reach each fraction of it (and at the stop)."""
    cfg = load_config(ROOT / "configs/flat_grpo.yaml",
                      [*SMALL, f"run_dir={tmp_path / 'run'}", "steps=6", "token_budget=400",
                       "eval.token_fractions=[0.3, 0.6]", "eval.every_steps=1"])
    summary = train(cfg)
    rows = read_metrics(Path(summary.run_dir) / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    spent = [sum(r["generated_tokens"] for r in train_rows[:i + 1]) for i in range(len(train_rows))]
    assert summary.steps == len(train_rows) < 6  # stopped by the budget, not the step cap
    assert spent[-1] >= 400 and (len(spent) == 1 or spent[-2] < 400)
    evals = {r["step"]: r["sampled_tokens"] for r in rows if r["kind"] == "eval"}
    due = {i + 1 for i, s in enumerate(spent) if any((spent[i - 1] if i else 0) < f * 400 <= s for f in (0.3, 0.6))}
    assert set(evals) == due | {summary.steps}  # every_steps=1 is ignored: the fractions decide
    assert all(evals[s] == spent[s - 1] for s in evals)
