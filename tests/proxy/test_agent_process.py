"""``rollout.proxy.agent_process``: workflows run in a child process record the same rows as in the
caller's loop (same seeds, a real proxy over loopback); a crash, a timeout, an unpicklable result, a
bad spec and a killed process each fail as they should and say why."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import numpy as np
import pytest

from rollout.envs import make_tasks
from rollout.proxy.agent_process import AgentError, AgentProcess, AgentProcessDied
from rollout.proxy.workflow import run_agent_group
from scorers import FrozenLakeProgressScorer

from .conftest import running_proxy

CHAT = "rollout.agents.frozenlake_chat:run"
KW = {"max_tokens": 8, "invalid_ends_episode": False}


def test_agents_in_a_process_record_the_rows_they_record_in_the_loop(upstream):
    task = make_tasks(3, 1, 0, sizes=(4,), max_turns=4)[0][0]
    from rollout.agents.frozenlake_chat import run

    async def go():
        async with running_proxy(upstream, scorers=[FrozenLakeProgressScorer(mode="delta")]) as srv:
            async with httpx.AsyncClient(timeout=120) as http:
                here = await run_agent_group(srv.proxy, srv.base_url, task, "here", 3, run, http_client=http,
                                             timeout_s=120, kwargs=KW, seed="5:1")
            proc = await AgentProcess.start(CHAT, concurrency=8)
            try:
                there = await run_agent_group(srv.proxy, srv.base_url, task, "there", 3, proc, http_client=None,
                                              timeout_s=120, kwargs=KW, seed="5:1")
            finally:
                await proc.close()
            return here, there, proc

    here, there, proc = asyncio.run(go())
    assert here.status == there.status == "ok" and len(there.export.rows) == 3
    assert not proc.alive and proc.process.exitcode == 0
    for a, b in zip(sorted(here.export.rows, key=lambda r: r.session_id[-1]),
                    sorted(there.export.rows, key=lambda r: r.session_id[-1])):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.outcome_reward == b.outcome_reward
        assert np.allclose(a.process_rewards, b.process_rewards)
    assert [len(r["rewards"]) for r in here.results] == [len(r["rewards"]) for r in there.results]


def test_a_crash_a_timeout_and_a_bad_result_fail_the_call_and_the_process_goes_on():
    async def go():
        proc = await AgentProcess.start("tests.proxy.agent_workflows:crash")
        try:
            with pytest.raises(AgentError, match=r"RuntimeError: the agent crashed on t1"):
                await proc("t1", "http://127.0.0.1:9", "k")
        finally:
            await proc.close()
        slow = await AgentProcess.start("tests.proxy.agent_workflows:slow")
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(slow("t", "u", "k"), 0.5)  # the caller's timeout cancels it in the child
            assert await slow("t", "u", "k", seconds=0.01) == 1.0 and slow.alive
        finally:
            await slow.close()
        bad = await AgentProcess.start("tests.proxy.agent_workflows:unpicklable")
        try:
            with pytest.raises(AgentError, match="cannot be sent back"):
                await bad("t", "u", "k")
        finally:
            await bad.close()

    asyncio.run(go())


def test_a_bad_spec_fails_at_start_and_a_killed_process_fails_every_call():
    async def go():
        with pytest.raises(ImportError, match="must be an async function"):
            await AgentProcess.start("tests.proxy.agent_workflows:not_async")
        with pytest.raises(ImportError, match="has no attribute 'nope'"):
            await AgentProcess.start("tests.proxy.agent_workflows:nope")
        proc = await AgentProcess.start("tests.proxy.agent_workflows:slow")
        try:
            pending = asyncio.ensure_future(proc("t", "u", "k"))
            await asyncio.sleep(0.2)
            os.kill(proc.process.pid, signal.SIGKILL)
            with pytest.raises(AgentProcessDied, match="exited"):
                await asyncio.wait_for(pending, 30)
            with pytest.raises(AgentProcessDied):
                await proc("t", "u", "k")
        finally:
            await proc.close()

    asyncio.run(go())
