"""The embedded server's death is the external case with one server: a request that loses its
connection marks it down, the probe restarts it in place (same port, same sampler, so the weights last
synced), checks its weight version, and the request is sent again and answered -- the same sample a
healthy server would give. Found dead between steps, the weight sync restarts it."""

from __future__ import annotations

import asyncio

from jaxprm.train.config import load_config
from jaxprm.train.generation import Generation
from jaxprm.train.setup import load_policy
from rollout.dialects import SamplingParams

TINY = ["env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "rollout.tasks_per_step=2",
        "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.strategy=flat", "warm_start.enabled=false",
        "progress=false"]
PARAMS = SamplingParams(max_tokens=6, seed=11)
PROMPT = [5, 6, 7, 8]


def test_a_dead_embedded_server_is_restarted_in_place_with_the_synced_weights(tmp_path):
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}"])
    logs: list[str] = []
    gen = Generation(cfg, load_policy(cfg), tmp_path, logs.append)

    async def scenario():
        await gen.start()
        try:
            await gen.sync(3)
            port, before = gen.server.port, await gen.client.generate(PROMPT, PARAMS)
            assert before.response.weight_version == 3

            gen.server.stop()  # the server dies mid-run: its HTTP thread and its engine stop
            assert not gen.server.alive
            after = await asyncio.wait_for(gen.client.generate(PROMPT, PARAMS), 60)
            assert gen.server.alive and gen.server.port == port
            assert after.response.weight_version == 3
            assert list(after.response.output_tokens) == list(before.response.output_tokens)  # same seed, same weights, same sample
            stats = gen.client.stats()
            assert stats["failovers"] >= 1 and stats["marked_down"] == 1 and stats["recovered"] == 1
            assert gen.server_health()["server_recoveries"] == 1

            gen.server.stop()  # dies between steps: the next sync finds it and restarts it
            await gen.sync(4)
            assert gen.server.alive and gen.server.port == port and gen.server.weight_version == 4
            assert (await gen.client.generate(PROMPT, PARAMS)).response.weight_version == 4
        finally:
            await gen.aclose()

    asyncio.run(scenario())
    restarts = [m for m in logs if "restarting it in place" in m]
    assert len(restarts) == 2, logs
    assert any("is back, serving weight version 3" in m for m in logs)


def test_a_restarted_server_serving_another_version_stays_down(tmp_path):
    """The version check is real: a server that comes back with other weights is not used."""
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}"])
    gen = Generation(cfg, load_policy(cfg), tmp_path, lambda _m: None)

    async def scenario():
        await gen.start()
        try:
            await gen.sync(2)
            gen.server.sampler.update_params(gen.policy.params, version=9)  # someone else's weights
            gen.client.health.mark_down(gen.server.url, "test")
            still_down = await gen.client.recover(wait_s=30)
            assert still_down == [gen.server.url]
            assert "weight version 9 after recovery, not 2" in gen.client.health.down()[gen.server.url]
        finally:
            await gen.aclose()

    asyncio.run(scenario())
