"""Asynchronous rollouts (``jaxprm.train.overlap``, ``rollout.asynchronous``): the producer's
staleness bound and order under a simulated learner, the versions a group carries, the dropping of
stale groups, and the trainer: with ``max_staleness: 0`` an asynchronous run gives the synchronous
run's rows; with 1 it overlaps, every group within the bound; a short asynchronous run learns (slow)."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.loop import train
from jaxprm.train.overlap import RolloutProducer, drop_stale, group_version
from jaxprm.train.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _simulate(max_staleness: int, steps: int = 6, rollout_s: float = 0.01, learn_s: float = 0.03):
    """A producer against a learner that takes ``learn_s`` per step: ``(step, version at rollout
    start, learner version when taken)`` per step, in the order taken."""

    async def main():
        producer = None

        async def collect(step):
            started = producer.version
            await asyncio.sleep(rollout_s)
            return step, started

        producer = RolloutProducer(collect, first=1, last=steps, max_staleness=max_staleness, learner_version=0)
        out = []
        for step in range(1, steps + 1):
            got, started = await producer.get()
            out.append((got, started, step - 1))
            await asyncio.sleep(learn_s)  # the learner's step
            await producer.served(step)
        await producer.aclose()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_the_producer_keeps_step_order_and_the_staleness_bound(max_staleness):
    taken = _simulate(max_staleness)
    assert [s for s, _, _ in taken] == list(range(1, 7))
    lags = [learner - started for _, started, learner in taken]
    assert max(lags) <= max_staleness
    if max_staleness == 0:
        assert lags == [0] * 6  # the synchronous loop: each rollout starts on the learner's newest weights
    else:
        assert max(lags) == max_staleness  # a learner slower than its rollouts uses the whole bound


def test_a_failed_rollout_reaches_the_learner():
    async def main():
        async def collect(step):
            if step == 2:
                raise RuntimeError("server gone")
            return step

        producer = RolloutProducer(collect, first=1, last=3, max_staleness=1, learner_version=0)
        assert await producer.get() == 1
        with pytest.raises(RuntimeError, match="server gone"):
            await producer.get()
        await producer.aclose()

    asyncio.run(main())


@dataclasses.dataclass
class _Response:
    weight_version: int | None


@dataclasses.dataclass
class _Interaction:
    model_response: _Response | None


@dataclasses.dataclass
class _Group:
    tree: list


def test_a_group_is_as_old_as_its_oldest_token_and_stale_groups_are_dropped():
    mixed = _Group([_Interaction(_Response(3)), _Interaction(_Response(2)), _Interaction(None)])  # updated mid-rollout
    unknown = _Group([_Interaction(_Response(None))])  # a server that reports no versions
    assert group_version(mixed, default=9) == 2 and group_version(unknown, default=1) == 1
    fresh, stale, known = (_Group([_Interaction(_Response(v))]) for v in (4, 2, 3))
    kept, stats = drop_stale([fresh, stale, known], served=9, learner_version=4, max_staleness=1)
    assert kept == [fresh, known]
    assert stats == {"stale_dropped_groups": 1, "staleness_mean": 0.5, "staleness_max": 1.0}


SMALL = ["env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "rollout.tasks_per_step=3",
         "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2", "warm_start.num_demos=16",
         "warm_start.steps=20", "warm_start.batch_size=4", "progress=false", "plots=false", "export_final=false",
         "compile_cache.precompile=false", "eval.every_steps=100", "eval.at_start=false", "steps=4",
         "checkpoint.every_steps=100"]
DATA = ("reward", "success", "trajectories", "sampled_actions", "generated_tokens", "kept_groups", "rows")
LEARNED = ("loss", "grad_norm")  # equal up to float rounding: the server may batch the requests differently


@pytest.mark.slow  # three 4-step runs: 92 s of the default suite on 2 cores
def test_max_staleness_zero_is_the_synchronous_loop_and_one_overlaps_within_the_bound(tmp_path):
    def run(name, *extra):
        # length-budget process rewards: an advantage on every token even when every episode fails
        cfg = load_config(ROOT / "configs" / "default_prm.yaml", [
            *SMALL, "rollout.export=tree_packed", *extra, f"run_dir={tmp_path / name}",
            f"warm_start.cache_dir={tmp_path / 'cache'}"])
        train(cfg, log=lambda m: None)
        return [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"]

    sync = run("sync")
    zero = run("zero", "rollout.asynchronous=true", "rollout.max_staleness=0")
    assert [{k: r[k] for k in DATA} for r in zero] == [{k: r[k] for k in DATA} for r in sync]
    for z, s in zip(zero, sync):
        assert [z[k] for k in LEARNED] == pytest.approx([s[k] for k in LEARNED], rel=1e-5, abs=1e-7)
    assert all(r["staleness_max"] == 0 and r["stale_dropped_groups"] == 0 for r in zero)
    one = run("one", "rollout.asynchronous=true", "rollout.max_staleness=1", "ppo.decoupled=true")
    assert [r["step"] for r in one] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 1 and r["stale_dropped_groups"] == 0 and "behave_gap" in r for r in one)
    assert max(r["staleness_max"] for r in one) == 1  # some step learned from the previous weights' groups
    assert all(r["grad_norm"] > 0 for r in one)


def test_asynchronous_runs_are_refused_where_they_cannot_work():
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(None, ["rollout.asynchronous=true", "rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.asynchronous"):
        load_config(None, ["rollout.asynchronous=true", "distributed.enabled=true"])


@pytest.mark.slow
def test_a_short_asynchronous_run_learns(tmp_path):
    """The default recipe for 10 steps with rollouts one version ahead and decoupled PPO."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", "steps=10", "eval.every_steps=10",
                          "rollout.asynchronous=true", "rollout.max_staleness=1", "ppo.decoupled=true",
                          "progress=false", "plots=false", "export_final=false", f"run_dir={run}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 10]
    assert evals[-1]["success"] - evals[0]["success"] > 0.05, evals
