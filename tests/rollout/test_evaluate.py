"""Held-out evaluation: sampled success, pass@k, greedy success, turns, hole and invalid rates."""

import asyncio

from rollout.client import ClientConfig, GenerationClient
from rollout.envs import FrozenLakeEnv, FrozenLakeTask
from rollout.evaluate import EvalSettings, evaluate
from rollout.testing import ServerScript, fixed_text_policy


def test_evaluate(serve, tok, prompts):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "```Right```")))
    tasks = [FrozenLakeTask(desc=("SG",)), FrozenLakeTask(desc=("GS",), max_turns=3)]

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,))) as c:
            return await evaluate(tasks, env_factory=FrozenLakeEnv, client=c, prompts=prompts,
                                  settings=EvalSettings(samples=4, max_turns=10, max_new_tokens=8))

    res = asyncio.run(go())
    m = res.metrics
    assert (m["success"], m["pass_at_4"], m["greedy_success"]) == (0.5, 0.5, 0.5)
    assert m["turns"] == 2.0 and m["hole_rate"] == 0.0 and m["invalid_rate"] == 0.0
    assert len(res.groups) == 2 and all(len(g.leaves) == 4 for g in res.groups)
