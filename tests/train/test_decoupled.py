"""The trainer with decoupled PPO (``ppo.decoupled``): the learner's proximal log-probs, the
behaviour weights and their metrics, on the packed and the flat export."""

from __future__ import annotations

import pytest

from jaxprm.train.config import load_config
from jaxprm.train.loop import train
from jaxprm.train.rundir import read_metrics

SMALL = [
    "env.train_tasks=32", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.greedy=false",
    "eval.at_start=false", "warm_start.enabled=false", "progress=false", "plots=false", "export_final=false",
    "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2", "env.max_turns=4",
    "rollout.tasks_per_step=2", "steps=2", "eval.every_steps=100", "checkpoint.every_steps=100",
    "compile_cache.enabled=false", "ppo.decoupled=true",
]


@pytest.mark.parametrize("export", ["tree_packed", pytest.param("concat", marks=pytest.mark.slow)])
def test_a_synchronous_decoupled_run_sees_the_sampler_as_its_proximal_policy(tmp_path, export):
    cfg = load_config(None, [*SMALL, f"rollout.export={export}", f"run_dir={tmp_path / 'run'}"])
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 2
    for r in rows:
        # synchronous: the sampler ran this step's weights, so proximal = behaviour up to float noise
        assert 0.0 <= r["behave_gap"] < 1e-3, r["behave_gap"]
        assert r["behave_capped_fraction"] == 0.0
        assert r["loss"] == r["loss"]  # finite
