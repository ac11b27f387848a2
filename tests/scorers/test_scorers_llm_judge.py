"""LLMJudgeScorer against a real scripted OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest

from prm_test_scorers import agent_branch, run
from rollout.types import Interaction, branch_messages
from scorers import LLMJudgeScorer, PRMConfig, PRMRunner, ScorerHTTPError, ScoringRejected, score_branch
from scorers._trajectory import Step, split_steps
from scorers.llm_judge import classify_action, detect_phase, heuristic_score, parse_judge_score

TASK = "Fix the crash in utils.parse_date when the input has a timezone."


def swe_branch(actions_and_obs: list[tuple[str, str]]) -> list[Interaction]:
    """A concat-style SWE branch: one interaction per (action, observation)."""
    return agent_branch(actions_and_obs, task=TASK, system="You are a coding agent.", prefix="w", output_len=5)


def judge(server, **kw) -> LLMJudgeScorer:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("backoff_s", 0.0)
    return LLMJudgeScorer(base_url=server.url, model="judge-7b", **kw)


async def _eval(scorer, branch, ctx=None):
    try:
        ctx = ctx if ctx is not None else {"messages": branch_messages(branch), "branch": branch}
        return await scorer.evaluate_result(branch[-1], ctx)
    finally:
        await scorer.aclose()


EXPLORE = [("grep -rn parse_date src/", "src/utils.py:10:def parse_date(s):"), ("cat src/utils.py", "def parse_date(s):\n    return s")]


def test_happy_path_blends_judge_and_heuristic(server):
    server.script("chat", {"content": '{"score": 0.8}'})
    branch = swe_branch(EXPLORE)
    s = judge(server, judge_weight=0.6)
    res = run(_eval(s, branch))
    _, steps = split_steps(branch_messages(branch) + [{"role": "tool", "content": EXPLORE[-1][1]}])
    heur = heuristic_score(steps)
    assert res.reward == pytest.approx(0.6 * 0.8 + 0.4 * heur)
    obs = {o.metric_id: o.value for o in res.observations}
    assert obs["judge_score"] == 0.8 and obs["heuristic_score"] == pytest.approx(heur)
    assert obs["phase_diagnosis"] is True and obs["phase_editing"] is False
    (body,) = server.requests["chat"]
    assert body["model"] == "judge-7b" and body["messages"][0]["role"] == "system"
    prompt = body["messages"][1]["content"]
    assert TASK in prompt and "grep -rn parse_date" in prompt and "exploring the repository" in prompt
    assert '{"score"' in prompt


@pytest.mark.parametrize(
    ("steps", "phase", "phrase"),
    [
        ([("grep -rn foo .", "a.py:1: foo")], "diagnosis", "exploring the repository"),
        ([("cat a.py", "x"), ("str_replace_editor str_replace a.py --old x --new y", "edited")], "editing", "changing code"),
        ([("str_replace a.py", "ok"), ("python -m pytest tests/test_a.py", "1 passed")], "verification", "running tests"),
        ([("echo hello", "hello")], "default", "middle of solving"),
    ],
)
def test_phase_specific_prompts(server, steps, phase, phrase):
    branch = swe_branch(steps)
    s = judge(server)
    res = run(_eval(s, branch))
    assert {o.metric_id: o.value for o in res.observations}[f"phase_{phase}"] is True
    assert phrase in server.requests["chat"][0]["messages"][1]["content"]


def test_5xx_is_retried_then_succeeds(server):
    server.script("chat", {"status": 503}, {"status": 500}, {"status": 429}, {"content": '{"score": 1.0}'})
    res = run(_eval(judge(server, max_retries=3, judge_weight=1.0), swe_branch(EXPLORE)))
    assert res.reward == 1.0 and len(server.requests["chat"]) == 4


def test_5xx_exhausting_retries_rejects_through_the_runner(server):
    server.defaults["chat"] = {"status": 502}

    async def go():
        r = PRMRunner(PRMConfig(), scorers=[judge(server, max_retries=1)])
        try:
            return await r.run(swe_branch(EXPLORE[:1]))
        finally:
            await r.scorers[0].aclose()

    with pytest.raises(ScoringRejected, match="HTTP 502") as info:
        run(go())
    assert isinstance(info.value.__cause__, ScorerHTTPError)
    assert len(server.requests["chat"]) == 2


def test_4xx_is_not_retried(server):
    server.script("chat", {"status": 400})
    with pytest.raises(ScorerHTTPError, match="not retried"):
        run(_eval(judge(server, max_retries=3), swe_branch(EXPLORE)))
    assert len(server.requests["chat"]) == 1


def test_malformed_answers_are_retried(server):
    server.script(
        "chat",
        {"raw": "{not json"},
        {"json": {"choices": []}},
        {"content": "I would say about 0.7"},
        {"content": '{"score": 1.5}'},
        {"content": 'Sure! {"score": 0.25} hope that helps'},
    )
    res = run(_eval(judge(server, max_retries=4, judge_weight=1.0), swe_branch(EXPLORE)))
    assert res.reward == pytest.approx(0.25) and len(server.requests["chat"]) == 5


def test_a_retry_after_a_malformed_answer_samples_differently(server):
    # a deterministic server at temperature 0 repeats its answer: retries must change the request
    server.script("chat", {"content": "no idea"}, {"content": '{"score": 0.4}'})
    res = run(_eval(judge(server, max_retries=2, judge_weight=1.0), swe_branch(EXPLORE)))
    first, retry = server.requests["chat"]
    assert res.reward == pytest.approx(0.4)
    assert first["temperature"] == 0.0 and "seed" not in first
    assert retry["temperature"] >= 0.7 and retry["seed"] == 1 and retry["messages"] == first["messages"]


def test_server_errors_keep_the_servers_reason(server):
    server.defaults["chat"] = {"status": 500}
    with pytest.raises(ScorerHTTPError, match="HTTP 500: scripted failure"):
        run(_eval(judge(server, max_retries=0), swe_branch(EXPLORE)))


def test_aclose_from_another_event_loop_does_not_raise(server):
    s = judge(server, judge_weight=1.0)
    run(s.evaluate(swe_branch(EXPLORE)[-1], {}))  # the HTTP client belongs to that (now closed) loop
    run(s.aclose())  # raised "Event loop is closed" before


def test_malformed_answers_exhausting_retries_reject(server):
    server.defaults["chat"] = {"content": "no idea"}
    with pytest.raises(ScorerHTTPError, match="malformed response"):
        run(_eval(judge(server, max_retries=2), swe_branch(EXPLORE)))
    assert len(server.requests["chat"]) == 3


def test_slow_responses_time_out_and_are_retried(server):
    server.script("chat", {"delay": 1.5, "content": '{"score": 0.9}'}, {"content": '{"score": 0.3}'})
    res = run(_eval(judge(server, timeout_s=0.3, max_retries=1, judge_weight=1.0), swe_branch(EXPLORE)))
    assert res.reward == pytest.approx(0.3)
    server.script("chat", {"delay": 1.5}, {"delay": 1.5})
    with pytest.raises(ScorerHTTPError, match="timeout after 0.3s"):
        run(_eval(judge(server, timeout_s=0.3, max_retries=1), swe_branch(EXPLORE)))


def test_connection_refused_is_retried_then_fails(free_port):
    s = LLMJudgeScorer(base_url=f"http://127.0.0.1:{free_port()}", model="m", max_retries=1, backoff_s=0.0, timeout_s=2)
    with pytest.raises(ScorerHTTPError, match="ConnectError"):
        run(_eval(s, swe_branch(EXPLORE)))


def test_cancellation_propagates_from_a_pending_request(server):
    server.script("chat", {"delay": 5.0})

    async def go():
        s = judge(server, timeout_s=10)
        task = asyncio.create_task(s.evaluate(swe_branch(EXPLORE)[-1], {}))
        while not server.requests["chat"]:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await s.aclose()

    run(go())


def test_heuristic_only_makes_no_request(server):
    res = run(_eval(judge(server, judge_weight=0.0), swe_branch(EXPLORE)))
    assert server.requests["chat"] == [] and 0.0 <= res.reward <= 1.0


def test_runner_scores_every_turn_concurrently_and_patr_helper_works(server):
    server.defaults["chat"] = {"content": '{"score": 1.0}'}
    branch = swe_branch(EXPLORE + [("str_replace src/utils.py", "edited"), ("pytest tests/test_utils.py -k tz", "3 passed")])

    async def go():
        async with PRMRunner(PRMConfig(), scorers=[judge(server)]) as r:
            res = await r.run(branch)
            patr = await score_branch(r.scorers[0], branch)
            await r.scorers[0].aclose()
            return res, patr

    res, patr = run(go())
    assert len(server.requests["chat"]) == 5
    assert all(0.0 <= v[0] <= 1.0 for v in res.values())
    # each turn's prompt shows the prefix up to that turn plus the observation that answered it
    prompts = [b["messages"][1]["content"] for b in server.requests["chat"]]
    assert sum("cat src/utils.py" in p for p in prompts) == 4  # every call but turn w0's
    assert sum("edited" in p for p in prompts) == 3  # turn w2 (its own observation), w3, score_branch
    assert not any("3 passed" in p for p in prompts)  # never part of the recorded conversation
    assert 0.0 <= patr <= 1.0


def test_constructor_validation(server):
    with pytest.raises(ValueError, match="judge_weight"):
        judge(server, judge_weight=1.2)
    with pytest.raises(ValueError, match="base_url"):
        LLMJudgeScorer(base_url="localhost:1", model="m")
    with pytest.raises(ValueError, match="max_retries"):
        judge(server, max_retries=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        judge(server, timeout_s=0)
    with pytest.raises(TypeError, match="unknown keyword"):
        judge(server, lamda=0.5)


# -- pure parts -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [('{"score": 0.4}', 0.4), ("```json\n{\"score\": 1}\n```", 1.0), ('x {"score": "0.5"} y', 0.5), ('{"score": 0}', 0.0),
     # braces inside the object (judges of code quote them) and nested objects
     ('Rating: {"score": 0.6, "reason": "edits the {tz} branch"}', 0.6),
     ('{"verdict": {"score": 0.3, "why": "ok"}} done', 0.3),
     ('Verdict: {"score": 0.7, "evidence": {"file": "tz.py", "line": 3}}', 0.7),
     ('I considered {foo} then answered {"score": 0.9}', 0.9)],
)
def test_parse_judge_score(content, expected):
    assert parse_judge_score(content) == expected


@pytest.mark.parametrize("content", ["", "0.5", '{"value": 0.5}', '{"score": -0.1}', '{"score": "high"}', '{"score": true}', None])
def test_parse_judge_score_rejects(content):
    with pytest.raises(ValueError):
        parse_judge_score(content)


def test_action_classes_and_phase():
    assert classify_action("python -m pytest tests/test_x.py") == "test"
    assert classify_action("sed -i 's/a/b/' x.py") == "edit"
    assert classify_action("find . -name '*.py'") == "search"
    assert classify_action("cat setup.py") == "inspect"
    assert classify_action("submit") == "finish"
    assert detect_phase([Step("ls", ""), Step("echo", "")]) == "diagnosis"
    assert detect_phase([Step("echo", "Traceback (most recent call last):")]) == "diagnosis"
    assert detect_phase([]) == "default"


def test_heuristic_signals():
    base = heuristic_score([Step("echo hi", "hi")])
    assert base == 0.5
    looping = heuristic_score([Step("ls", "a")] * 4)
    assert looping == pytest.approx(0.5 - 0.3)
    failing = heuristic_score([Step("runme", "bash: runme: command not found")])
    assert failing == pytest.approx(0.4)
    blind_edit = heuristic_score([Step("sed -i 's/a/b/' x.py", "")])
    assert blind_edit == pytest.approx(0.3)
    premature = heuristic_score([Step("cat x.py", "def f(): pass"), Step("sed -i 's/a/b/' x.py", ""), Step("submit", "")])
    grounded = heuristic_score(
        [Step("cat x.py", "def f(): pass"), Step("sed -i 's/a/b/' x.py", ""), Step("pytest tests/test_x.py::test_f", "1 passed")]
    )
    assert premature < 0.5 < grounded
    assert grounded == pytest.approx(0.5 + 0.1 + 0.15 + 0.1 + 0.05)
    assert 0.0 <= heuristic_score([Step("x", "command not found")] * 10) <= 1.0
