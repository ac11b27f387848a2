"""The scorers' circuit breaker: its state machine on a fake clock, and a real judge server killed
mid-run: groups are rejected at once with kind ``scorer_unavailable`` (not after timeouts), the
other groups go on, and scoring resumes when the server is back on its port."""

from __future__ import annotations

import asyncio
import time

import pytest

from prm_test_scorers import agent_branch
from rollout.types import InteractionTree
from scorer_http_server import ScriptedServer
from scorers import CircuitBreaker, LLMJudgeScorer, PRMRunner, ScorerUnavailable


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_fails_fast_probes_and_closes():
    clock = Clock()
    b = CircuitBreaker("judge", failures=2, probe_s=1.0, max_probe_s=3.0, clock=clock)
    assert b.before() is False
    b.failure(False)
    assert b.state == "closed"
    b.failure(False)
    assert b.state == "open" and b.counts["opened"] == 1
    with pytest.raises(ScorerUnavailable, match="judge: server unavailable"):
        b.before()
    clock.t = 1.0
    assert b.before() is True and b.state == "half_open"  # the probe
    with pytest.raises(ScorerUnavailable):
        b.before()  # others still fail fast while it probes
    b.failure(True)  # still down: the wait doubles
    assert b.state == "open" and b.wait_s == 2.0
    clock.t = 2.5
    with pytest.raises(ScorerUnavailable):
        b.before()
    clock.t = 3.0
    probe = b.before()
    b.abandon(probe)  # a cancelled probe gives its slot back
    assert b.before() is True
    b.success(True)
    assert b.state == "closed" and b.wait_s == 1.0 and b.before() is False
    assert b.counts == {"opened": 1, "fast_failures": 3, "probes": 3, "closed_after_probe": 1}
    with pytest.raises(ValueError, match="breaker_failures"):
        CircuitBreaker("x", failures=0)


def _session(i: int, turns: int = 2) -> tuple[InteractionTree, dict, None]:
    tree = InteractionTree()
    for it in agent_branch([("ls", "a.py"), ("cat a.py", "x = 1")][:turns], task=f"task {i}", prefix=f"s{i}-"):
        tree.add(it)
    return tree, {"task": f"task {i}"}, None


def test_a_killed_judge_rejects_at_once_and_scoring_resumes_after_a_restart():
    server = ScriptedServer().start()
    port = server.port
    judge = LLMJudgeScorer(base_url=server.url, model="judge", timeout_s=1.0, max_retries=1, backoff_s=0.05,
                           breaker_failures=2, breaker_probe_s=0.5)

    async def go():
        runner = await PRMRunner.create(None, scorers=[judge])
        try:
            before = await runner.score_sessions([_session(i) for i in range(2)])
            server.stop()  # the judge dies
            t0 = time.perf_counter()
            down = await runner.score_sessions([_session(10)])  # its two turns' calls wait out their retries
            t_slow = time.perf_counter() - t0
            t0 = time.perf_counter()
            fast = await runner.score_sessions([_session(20 + i) for i in range(4)])  # open: rejected at once
            t_fast = time.perf_counter() - t0
            restarted = ScriptedServer()
            restarted.port = port
            from jaxprm.inprocess import ThreadedServer
            restarted._http = ThreadedServer(restarted.app, port=port, name="judge-again", startup_timeout_s=20,
                                             timeout_graceful_shutdown=1)
            try:
                await asyncio.sleep(0.6)  # past the probe wait
                (probe,) = await runner.score_sessions([_session(30, turns=1)])  # its one call is the probe
                after = [probe, *await runner.score_sessions([_session(31 + i) for i in range(2)])]
            finally:
                restarted.stop()
            return before, down, fast, after, t_slow, t_fast
        finally:
            await runner.aclose()

    before, down, fast, after, t_slow, t_fast = asyncio.run(go())
    assert all(not hasattr(r, "kind") for r in before)  # scored
    assert [r.kind for r in down] == ["failed"]  # transport errors after retries: 2 failed calls open the breaker
    assert [r.kind for r in fast] == ["scorer_unavailable"] * 4 and "server unavailable" in fast[0].reason
    assert t_fast < 0.5 * max(t_slow, 0.2)
    assert all(not hasattr(r, "kind") for r in after)  # the probe found the server: scoring resumed
    assert judge.http.breaker.state == "closed" and judge.http.breaker.counts["closed_after_probe"] == 1


def test_patrs_branch_scorer_follows_the_same_rule():
    """``score_branch`` (PaTR's checkpoints) goes through the same client: once the breaker is open
    a branch is rejected at once with kind ``scorer_unavailable`` (the strategy rejects its group
    with that kind, counted as ``branch_rejected/scorer_unavailable``)."""
    import socket

    from rollout.types import branch_messages
    from scorers import ScoringRejected, score_branch

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    judge = LLMJudgeScorer(base_url=f"http://127.0.0.1:{port}", model="judge", timeout_s=1.0, max_retries=0,
                           breaker_failures=1, breaker_probe_s=30.0)
    branch = agent_branch([("ls", "a.py")], task="t")

    async def go():
        kinds = []
        for _ in range(2):
            with pytest.raises(ScoringRejected) as e:
                await score_branch(judge, branch, messages=branch_messages(branch))
            kinds.append(e.value.kind)
        await judge.aclose()
        return kinds

    assert asyncio.run(go()) == ["failed", "scorer_unavailable"]
