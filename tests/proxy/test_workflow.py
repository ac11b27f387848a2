"""The agent contract: the shipped FrozenLake chat agent (official openai SDK only) run as a group
through the proxy, its env states feeding the FrozenLake progress scorer; a failed agent discards
its group; the workflow return forms and resolution errors."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from rollout.envs import make_tasks
from rollout.proxy.workflow import resolve_workflow, reward_body, run_agent_group
from scorers import FrozenLakeProgressScorer

from .conftest import running_proxy


def test_reward_body_forms_and_workflow_resolution():
    assert reward_body(1) == {"reward": 1.0}
    assert reward_body({"chatcmpl-a": 0.5}) == {"rewards": {"chatcmpl-a": 0.5}}
    body = {"rewards": {"chatcmpl-a": 1.0}, "env_states": {"chatcmpl-a": {"x": 1}}}
    assert reward_body(body) == body
    with pytest.raises(TypeError, match="must return a number or a mapping"):
        reward_body("done")
    assert resolve_workflow("rollout.agents.frozenlake_chat:run").__name__ == "run"
    with pytest.raises(ValueError, match="package.module:function"):
        resolve_workflow("rollout.agents.frozenlake_chat.run")
    with pytest.raises(ImportError, match="has no attribute 'walk'"):
        resolve_workflow("rollout.agents.frozenlake_chat:walk")
    with pytest.raises(TypeError, match="must be an async function"):
        resolve_workflow("rollout.proxy.workflow:reward_body")


def test_the_example_agent_group_is_scored_from_its_env_states(upstream):
    task = make_tasks(3, 1, 0, sizes=(4,), max_turns=4)[0][0]
    from rollout.agents.frozenlake_chat import run

    async def go():
        async with running_proxy(upstream, scorers=[FrozenLakeProgressScorer(mode="delta")]) as srv:
            async with httpx.AsyncClient(timeout=120) as http:
                out = await run_agent_group(srv.proxy, srv.base_url, task, "fl", 3, run, http_client=http,
                                            timeout_s=120, kwargs={"max_tokens": 8, "invalid_ends_episode": False})
            return out, {s: srv.proxy.store.by_id.get(s) for s in ("fl-0", "fl-1", "fl-2")}

    out, left = asyncio.run(go())
    assert out.status == "ok" and out.errors == [] and len(out.export.rows) == 3
    assert all(v is None for v in left.values())  # exported with remove_session: gone
    for row, body in zip(sorted(out.export.rows, key=lambda r: r.session_id), out.results):
        ids = list(body["rewards"])
        assert list(row.interaction_ids) == ids  # one linear chat: every turn on the leaf's chain
        assert row.outcome_reward == body["rewards"][ids[-1]]
        states = body["env_states"]
        mask = row.loss_mask > 0
        assert np.all(row.process_rewards[~mask] == 0)
        first = states[ids[0]]  # delta mode: the first turn's reward is its progress level
        progress = max(0.0, 1.0 - first["distance"] / first["start_distance"]) if first["distance"] >= 0 else 0.0
        level = 0.5 * progress  # reward_weight 0.5: the reward term is 0 before success
        turn0 = row.turn_ids == 0
        assert np.allclose(row.process_rewards[turn0], 1.0 if first["success"] else level)


def test_the_example_agent_plays_sokoban_through_the_proxy(upstream):
    """``grid_chat`` with ``env="sokoban"``: a JSON task, each turn scored by Sokoban progress (delta)."""
    from rollout.agents.grid_chat import run
    from rollout.envs.sokoban import make_tasks as sokoban_tasks
    from scorers import SokobanProgressScorer, sokoban_progress_score

    task = sokoban_tasks(5, 1, 0, size=5, boxes=1, max_turns=4)[0][0]
    as_json = {"room": list(task.room), "max_turns": 4}

    async def go():
        async with running_proxy(upstream, scorers=[SokobanProgressScorer(mode="delta")]) as srv:
            async with httpx.AsyncClient(timeout=120) as http:
                return await run_agent_group(srv.proxy, srv.base_url, as_json, "sk", 2, run, http_client=http,
                                             timeout_s=120, kwargs={"env": "sokoban", "max_tokens": 8,
                                                                    "invalid_ends_episode": False})

    out = asyncio.run(go())
    assert out.status == "ok" and out.errors == [] and len(out.export.rows) == 2
    for row, body in zip(sorted(out.export.rows, key=lambda r: r.session_id), out.results):
        ids = list(body["rewards"])
        assert row.outcome_reward == pytest.approx(body["rewards"][ids[-1]])
        first = body["env_states"][ids[0]]
        assert {"distance", "start_distance", "dead", "boxes"} <= set(first)
        assert np.allclose(row.process_rewards[row.turn_ids == 0], sokoban_progress_score(first))


def test_a_failed_agent_discards_its_group(upstream):
    task = make_tasks(4, 1, 0, sizes=(4,), max_turns=3)[0][0]
    from rollout.agents.frozenlake_chat import run

    calls = {"n": 0}

    async def flaky(task, base_url, api_key, http_client, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the agent crashed")
        return await run(task, base_url, api_key, http_client, **kw)

    async def go():
        async with running_proxy(upstream, scorers=[FrozenLakeProgressScorer()]) as srv:
            async with httpx.AsyncClient(timeout=120) as http:
                out = await run_agent_group(srv.proxy, srv.base_url, task, "bad", 3, flaky, http_client=http,
                                            timeout_s=120)
            return out, len(srv.proxy.store), srv.proxy.stats()

    out, live, stats = asyncio.run(go())
    assert out.status == "agent_failed" and out.export.discarded and out.export.rows == []
    assert len(out.errors) == 1 and "the agent crashed" in out.errors[0]
    assert out.export.prm_stats is None and live == 0 and stats["discarded_exports"] == 1
