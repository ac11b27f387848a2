"""The agent path trains on what the tree path trains on: the shipped FrozenLake chat agent through
the proxy, with its group seeded like a flat tree group, against a deterministic upstream (the
scripted server's policies: an answer is a function of the prompt tokens and the seed), exports
rows equal to the tree path's flat GRPO rows: tokens, loss mask, log-probs, turn ids, process
rewards (FrozenLake progress, delta mode), outcome and truncation; over successes, holes, the
turn limit, invalid answers (ending the episode or not) and the Theta loop rule; and the same for
the tool-calling agent (``env.action_format: tool_call``: moves are ``move`` calls, the proxy
prefills the call, observations are tool messages)."""

from __future__ import annotations

import asyncio
import collections

import httpx
import numpy as np
import pytest

from rollout.agents.frozenlake_chat import run as chat_agent_run
from rollout.agents.frozenlake_tools import run as tools_agent_run
from rollout.client import ClientConfig, GenerationClient, SamplingParams
from rollout.envs.frozenlake import COMPACT_SYSTEM_PROMPT, FrozenLakeEnv, make_tasks
from rollout.envs.tool_moves import ToolMoveEnv, demo_text, tool_prompts
from rollout.export import group_rows
from rollout.proxy import ProxyConfig, ProxyServer
from rollout.proxy.workflow import run_agent_group
from rollout.scoring import score_groups
from rollout.testing import (ScriptedServer, ServerScript, frozenlake_policy, hashed_action_policy,
                             make_test_tokenizer, make_tools_test_tokenizer)
from rollout.groups import TreeConfig
from rollout.tree import run_group
from scorers import FrozenLakeProgressScorer, PRMRunner

SEED, GROUP_SEED, G = 3, 20_007, 6


def _tree_rows(url, tok, task, invalid_ends, theta, tools=False):
    def env():
        game = FrozenLakeEnv(COMPACT_SYSTEM_PROMPT, invalid_ends_episode=invalid_ends)
        return ToolMoveEnv(game) if tools else game

    async def go():
        cfg = TreeConfig(strategy="flat", group_size=G, max_turns=task.max_turns, theta=theta, seed=SEED,
                         sampling=SamplingParams(max_tokens=32 if tools else 8, temperature=1.0))
        async with GenerationClient(ClientConfig(endpoints=(url,), dialect="sglang")) as client:
            group = await run_group(task, env_factory=env, client=client, prompts=tool_prompts(tok) if tools else tok,
                                    config=cfg, group_seed=GROUP_SEED)
        runner = await PRMRunner.create(None, scorers=[FrozenLakeProgressScorer(mode="delta")])
        try:
            scored = await score_groups(runner, [group])
        finally:
            await runner.aclose()
        rows = group_rows(scored.groups[0], 0)  # the scored group carries its process rewards
        return {lf.branch_id: (lf, row) for lf, row in zip(group.leaves, rows)}

    return asyncio.run(go())


def _agent_rows(url, tok, task, invalid_ends, theta, tools=False):
    agent_run, max_tokens = (tools_agent_run, 32) if tools else (chat_agent_run, 8)

    async def go():
        cfg = ProxyConfig(upstream=ClientConfig(endpoints=(url,), dialect="sglang"), admin_key="k",
                          default_max_tokens=8)
        async with await ProxyServer.start(cfg, tok, scorers=[FrozenLakeProgressScorer(mode="delta")]) as srv:
            async with httpx.AsyncClient(timeout=60) as http:
                out = await run_agent_group(srv.proxy, srv.base_url, task, "eq", G, agent_run, http_client=http,
                                            timeout_s=60, seed=f"{SEED}:{GROUP_SEED}",
                                            kwargs={"system_prompt": "compact", "invalid_ends_episode": invalid_ends,
                                                    "max_tokens": max_tokens, "temperature": 1.0, "theta": theta})
        assert out.status == "ok", out
        return {f"b{r.session_id.rsplit('-', 1)[1]}": r for r in out.export.rows}

    return asyncio.run(go())


@pytest.mark.parametrize("policy,invalid_ends,theta,expect", [
    ("navigator", True, 6, {"success", "done", "max_turns"}),
    ("random_with_invalid", False, 2, {"loop", "done", "max_turns"}),
    ("random_with_invalid", True, 6, {"invalid", "done"}),
    ("tool_calls", False, 2, {"loop", "done", "max_turns"}),
    ("tool_calls", True, 6, {"invalid", "done"}),
])
def test_agent_rows_equal_the_tree_paths_flat_rows(policy, invalid_ends, theta, expect):
    tools = policy == "tool_calls"
    tok = make_tools_test_tokenizer() if tools else make_test_tokenizer()
    tasks, _ = make_tasks(11, 4, 0, sizes=(4,), max_turns=8)
    if policy == "navigator":
        pol = frozenlake_policy(tok, p_good=0.6)
    else:  # a tool call's arguments after the prefill, or a fenced move; "I am not sure." a quarter of the time
        pol = hashed_action_policy(tok, p_invalid=0.25, answer=demo_text if tools else None)
    statuses = collections.Counter()
    with ScriptedServer(ServerScript(policy=pol), tok) as up:
        for task in tasks:
            tree = _tree_rows(up.url, tok, task, invalid_ends, theta, tools)
            agent = _agent_rows(up.url, tok, task, invalid_ends, theta, tools)
            assert set(tree) == set(agent) == {f"b{i}" for i in range(G)}
            for bid, (leaf, trow) in tree.items():
                statuses[leaf.status] += 1
                arow = agent[bid].to_row_data(0)
                for f in ("tokens", "loss_mask", "logprobs", "turn_ids", "process_rewards"):
                    assert np.array_equal(getattr(trow, f), getattr(arow, f)), (task.task_id, bid, f)
                assert trow.outcome_reward == arow.outcome_reward and trow.truncated == arow.truncated
                assert len(agent[bid].interaction_ids) == leaf.turns
    assert expect <= set(statuses), statuses  # the cases this parametrization is there to cover
