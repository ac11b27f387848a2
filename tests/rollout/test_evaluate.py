"""Held-out evaluation helper: sampled success, pass@k and greedy success."""

import asyncio

from rollout.client import ClientConfig, GenerationClient, SamplingParams
from rollout.envs import FrozenLakeEnv, FrozenLakeTask
from rollout.evaluate import evaluate_tasks
from rollout.testing import ServerScript, fixed_text_policy


def test_evaluate_tasks(serve, tok, prompts):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "```Right```")))
    tasks = [FrozenLakeTask(desc=("SG",)), FrozenLakeTask(desc=("GS",), max_turns=3)]

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,))) as c:
            return await evaluate_tasks(tasks, env_factory=FrozenLakeEnv, client=c, prompts=prompts, samples=4,
                                        sampling=SamplingParams(max_tokens=8))

    out = asyncio.run(go())
    assert out == {"tasks": 2.0, "episodes": 8.0, "sampled_success": 0.5, "pass@4": 0.5, "mean_turns": 2.0,
                   "greedy_success": 0.5}
