"""Runs nobody else can steer: the embedded server takes only the trainer's random API key and
loads weights only from the run directory, and a sampler that is not the learner's policy (seen in
``behavior_kl``) is a loud warning, then an error past ``server.max_behavior_kl``."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.generation import Generation
from jaxprm.train.loop import TrainError, train
from jaxprm.train.rundir import read_metrics
from jaxprm.train.setup import load_policy

TINY = ["env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "rollout.tasks_per_step=2",
        "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.strategy=flat", "warm_start.enabled=false", "progress=false"]


def test_the_embedded_server_answers_only_the_trainers_key(tmp_path):
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}"])
    logs: list[str] = []
    gen = Generation(cfg, load_policy(cfg), tmp_path, logs.append)

    async def probe():
        await gen.start()
        try:
            key = gen.client.config.api_key
            assert key and len(key) >= 32
            async with httpx.AsyncClient(base_url=gen.server.url, timeout=60) as anyone:
                assert (await anyone.get("/health")).status_code == 200
                assert (await anyone.get("/get_weight_version")).status_code == 401
                swap = await anyone.post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
                assert swap.status_code == 401
                trainer = {"Authorization": f"Bearer {key}"}
                assert (await anyone.get("/get_weight_version", headers=trainer)).status_code == 200
                # even with the key, weights load only from under the run directory
                r = await anyone.post("/update_weights_from_disk", json={"model_path": "/etc"}, headers=trainer)
                assert r.status_code == 403
            await gen.sync(1)  # the trainer's own in-process swap still works
            assert gen.server.weight_version == 1
            return key
        finally:
            await gen.aclose()

    key = asyncio.run(probe())
    assert not any(key in m for m in logs) and any("API key required" in m for m in logs)


def test_behavior_kl_warns_then_stops(tmp_path):
    cfg = load_config(None, [*TINY, "server.warn_behavior_kl=0.05", "server.max_behavior_kl=1.0",
                             f"run_dir={tmp_path}"])
    logs: list[str] = []
    gen = Generation(cfg, load_policy(cfg), tmp_path, logs.append)
    gen.check_behavior(1, {"behavior_kl": 1e-13})
    gen.check_behavior(2, {"skipped": True})  # no update, nothing measured
    assert logs == []
    gen.check_behavior(3, {"behavior_kl": 0.3})
    assert len(logs) == 1 and logs[0].startswith("WARNING: step 3: behavior_kl=0.3 > server.warn_behavior_kl=0.05")
    for bad in (4.0, math.nan):
        with pytest.raises(TrainError, match=r"step 4: behavior_kl=\S+ exceeds server.max_behavior_kl=1.0"):
            gen.check_behavior(4, {"behavior_kl": bad})
    gen.cfg = load_config(None, [*TINY, "server.max_behavior_kl=null", f"run_dir={tmp_path}"])
    gen.check_behavior(5, {"behavior_kl": 40.0})  # null: warn only
    assert len(logs) == 2
    with pytest.raises(ConfigError, match="server.warn_behavior_kl: must be <= max_behavior_kl"):
        load_config(None, ["server.warn_behavior_kl=2", "server.max_behavior_kl=1"])
    with pytest.raises(ConfigError, match="server.max_behavior_kl"):
        load_config(None, ["server.max_behavior_kl=-1"])


def test_a_server_that_serves_other_weights_stops_the_run(tmp_path):
    """A real one-step run against a server that serves someone else's weights (another seed of the
    tiny model, as if another process had swapped them): the step's row records behavior_kl and the
    run stops with the error instead of exiting 0."""
    from jaxprm.models import load_model
    from jaxprm.serve import ServerHandle

    model, tok = load_model("tiny", seed=1)  # the trainer's policy is seed 0
    with ServerHandle.start(model, tok, model_name="jaxprm", sampler_kwargs={"max_batch": 8}) as server:
        cfg = load_config(None, [*TINY, "server.kind=external", f"server.urls=[{server.url}]", "steps=1",
                                 "eval.at_start=false", "plots=false", "export_final=false",
                                 "server.max_behavior_kl=0.01", "server.warn_behavior_kl=0.001",
                                 f"run_dir={tmp_path / 'run'}"])
        logs: list[str] = []
        with pytest.raises(TrainError, match=r"step 1: behavior_kl=\S+ exceeds server.max_behavior_kl=0.01"):
            train(cfg, log=logs.append)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 1 and rows[0]["behavior_kl"] > 0.01
    assert not (tmp_path / "run" / "checkpoints" / "1").exists()  # the off-policy step is not checkpointed
