"""Trainer integration of the recording proxy (rollout.source: agent): config rules, a short
in-process run with the example OpenAI-SDK agent (smoke), and the opt-in learning run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.loop import TrainError, train
from jaxprm.train.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "configs" / "agent_frozenlake.yaml"
SMOKE = [
    "env.train_tasks=16", "env.eval_tasks=1", "env.max_turns=3", "eval.num_tasks=1", "eval.samples=1",
    "eval.greedy=false", "eval.at_start=false", "eval.every_steps=2", "rollout.tasks_per_step=2",
    "rollout.group_size=2", "ppo.len_buckets=[256,512]", "warm_start.enabled=false", "progress=false",
    "plots=false", "export_final=false", "checkpoint.every_steps=2", "steps=2",
]


def test_agent_config_rules():
    cfg = load_config(AGENT)
    assert cfg.rollout.source == "agent" and cfg.prm.active and cfg.agent.workflow.endswith(":run")
    with pytest.raises(ConfigError, match=r"rollout.strategy: rollout.source 'agent' runs flat groups.*'patr'"):
        load_config(AGENT, ["rollout.strategy=patr"])
    with pytest.raises(ConfigError, match=r"agent.workflow: must look like package.module:function"):
        load_config(AGENT, ["agent.workflow=rollout.agents.frozenlake_chat.run"])
    with pytest.raises(ConfigError, match=r"agent.chat_template_type: active process-reward scorers need 'concat'"):
        load_config(AGENT, ["agent.chat_template_type=hf"])
    with pytest.raises(ConfigError, match=r"agent.discount: must be in \[0, 1\]"):
        load_config(AGENT, ["agent.discount=1.5"])
    with pytest.raises(ConfigError, match=r"rollout.source: got 'proxy'; allowed values: 'tree', 'agent'"):
        load_config(None, ["rollout.source=proxy"])
    assert load_config(None, ["rollout.source=agent", "rollout.strategy=flat"]).agent.timeout_s > 0


def test_a_missing_workflow_is_a_clear_error(tmp_path):
    cfg = load_config(AGENT, [*SMOKE, "agent.workflow=no_such_pkg.agent:run", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(TrainError, match=r"agent.workflow='no_such_pkg.agent:run'.*No module named"):
        train(cfg, log=lambda m: None)


def test_smoke_run_with_the_example_agent_through_the_proxy(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(AGENT, [*SMOKE, f"run_dir={run}"])
    logs: list[str] = []
    summary = train(cfg, log=logs.append)
    assert summary.steps == 2 and any("recording proxy on http://127.0.0.1:" in m for m in logs)
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["trajectories"] == 4 and r["kept_groups"] == 2 and r["agent_failed_groups"] == 0
        assert r["rows"] == 4 and r["sampled_actions"] >= 4 and "loss" in r and "invalid_rate" in r
        assert "rollout/prm_turn_reward/frozenlake_progress" in r  # prm_stats recorded by the trainer (spec names)
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2]
    assert json.loads((run / "summary.json").read_text())["last_eval"]["step"] == 2


@pytest.mark.slow
def test_agent_through_the_proxy_learns(tmp_path):
    """The acceptance run of the example agent (configs/agent_frozenlake.yaml, minutes on a CPU): held-out
    sampled success after training is reported next to the warm start; improvement is asserted
    loosely (one seed; the multi-seed comparison with the tree path is in the benchmark notes)."""
    run = tmp_path / "agent"
    cfg = load_config(AGENT, [f"run_dir={run}", "progress=false"])
    summary = train(cfg, log=print)
    print(summary.describe())
    assert summary.first_eval is not None and summary.last_eval is not None
    assert summary.last_eval["success"] >= summary.first_eval["success"]
