"""PRMModelScorer: serialization/truncation and a real scripted vLLM-style pooling server."""

from __future__ import annotations


import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from prm_test_scorers import agent_branch, response, run
from rollout.types import Interaction, branch_messages
from scorers import PRMConfig, PRMModelScorer, PRMRunner, ScorerHTTPError, ScoringRejected
from scorers.prm_model import aggregate_step_scores

WORDS = ["<unk>", "<sep>", "task", "fix", "the", "bug", "run", "ls", "cat", "file", "ok", "error", "reward", ":", "0", "1", "step"]
WORDS += [f"w{i}" for i in range(40)]
VOCAB = {w: i for i, w in enumerate(WORDS)}
SEP = VOCAB["<sep>"]


def make_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def branch(steps: list[tuple[str, str]], task: str = "task fix the bug", rewards=None) -> list[Interaction]:
    return agent_branch(steps, task=task, prefix="p", output_len=3, rewards=rewards)


def prm(server=None, **kw) -> PRMModelScorer:
    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("backoff_s", 0.0)
    return PRMModelScorer(
        base_url=server.url if server else "http://127.0.0.1:9", model="prm-7b", tokenizer=make_tokenizer(),
        step_separator_id=SEP, **kw,
    )


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, dtype=np.float64)))


STEPS = [("ls", "file"), ("cat file", "error"), ("run", "ok")]


def ctx_of(b):
    return {"messages": branch_messages(b), "branch": b}


# -- serialization ---------------------------------------------------------------------------------


def test_serialization_is_task_then_steps_each_ending_in_the_separator():
    s = prm(include_step_rewards=False)
    b = branch(STEPS)
    ids, n, truncated = s.serialize(b[-1], ctx_of(b))
    enc = lambda t: make_tokenizer().encode(t).ids  # noqa: E731
    expected = enc("task fix the bug\n") + enc("ls\nfile") + [SEP] + enc("cat file\nerror") + [SEP] + enc("run\n") + [SEP]
    assert ids == expected and n == 3 and not truncated


def test_step_rewards_are_serialized_when_known():
    s = prm()
    b = branch(STEPS[:2], rewards=[0.0, 1.0])
    ids, _, _ = s.serialize(b[-1], ctx_of(b))
    assert ids.count(VOCAB["reward"]) == 2 and VOCAB["1"] in ids


def test_recent_steps_window_and_token_budget_keep_the_task():
    b = branch([(f"w{i} w{i}", f"w{i + 20}") for i in range(8)])
    task_ids = make_tokenizer().encode("task fix the bug\n").ids
    s = prm(recent_steps=3, include_step_rewards=False)
    ids, n, truncated = s.serialize(b[-1], ctx_of(b))
    assert n == 3 and truncated and ids[: len(task_ids)] == task_ids and ids.count(SEP) == 3
    assert VOCAB["w5"] in ids and VOCAB["w4"] not in ids
    # a tight budget drops the oldest steps but never the task
    s = prm(recent_steps=10, max_input_tokens=len(task_ids) + 9, include_step_rewards=False)  # 4 tokens per step
    ids, n, truncated = s.serialize(b[-1], ctx_of(b))
    assert ids[: len(task_ids)] == task_ids and n == 2 and truncated and len(ids) <= len(task_ids) + 9
    assert ids[-1] == SEP and VOCAB["w7"] in ids and VOCAB["w6"] in ids and VOCAB["w5"] not in ids
    # when even the newest step does not fit, its tail (with the separator) is kept
    s = prm(max_input_tokens=len(task_ids) + 2, max_task_tokens=len(task_ids), include_step_rewards=False)
    ids, n, _ = s.serialize(b[-1], ctx_of(b))
    assert ids == task_ids + [VOCAB["w7"], SEP] and n == 1  # newest step is "w7 w7" + separator


def test_a_long_task_is_cut_to_its_head():
    b = branch([("ls", "file")], task=" ".join(f"w{i}" for i in range(30)))
    s = prm(max_input_tokens=16, max_task_tokens=5, include_step_rewards=False)
    ids, _, truncated = s.serialize(b[-1], ctx_of(b))
    assert ids[:5] == [VOCAB[f"w{i}"] for i in range(5)] and truncated and ids[-1] == SEP


def test_no_step_means_no_score():
    it = Interaction("x", None, [{"role": "user", "content": "task"}], [], model_response=response(2))
    with pytest.raises(ValueError, match="no agent step"):
        prm().serialize(it, {})


@pytest.mark.parametrize(
    ("how", "expected"), [("last", 0.2), ("mean", 0.5), ("max", 0.8), ("weighted", 0.25 * 0.2 + 0.75 * 0.5)]
)
def test_aggregations(how, expected):
    assert aggregate_step_scores([0.5, 0.8, 0.2], how, last_weight=0.25) == pytest.approx(expected)


# -- against the server ---------------------------------------------------------------------------


def _eval(scorer, b):
    async def go():
        try:
            return await scorer.evaluate_result(b[-1], ctx_of(b))
        finally:
            await scorer.aclose()

    return run(go())


@pytest.mark.parametrize("how", ["last", "mean", "max", "weighted"])
def test_per_token_values_sigmoid_at_separators(server, how):
    server.pooling_fn = lambda ids: [[0.1 * t - 1.0] for t in range(len(ids))]  # [L, 1]
    b = branch(STEPS)
    res = _eval(prm(server, aggregation=how, last_weight=0.7), b)
    (body,) = server.requests["pooling"]
    assert body["model"] == "prm-7b"
    ids = body["input"]
    steps = sigmoid([0.1 * t - 1.0 for t, i in enumerate(ids) if i == SEP])
    assert len(steps) == 3
    assert res.reward == pytest.approx(aggregate_step_scores(steps, how, last_weight=0.7))
    obs = {o.metric_id: o.value for o in res.observations}
    assert obs == {"step_scores": 3.0, "input_truncated": False}


def test_values_only_at_step_tags_and_label_columns(server):
    server.script("pooling", {"values": [[0.9, 0.1], [0.3, 0.7]]})  # [S, K] probabilities
    res = _eval(prm(server, apply_sigmoid=False, label_index=1, aggregation="mean"), branch(STEPS[:2]))
    assert res.reward == pytest.approx(0.4)
    server.script("pooling", {"values": [2.0, -1.0]})  # [S] logits
    res = _eval(prm(server), branch(STEPS[:2]))
    assert res.reward == pytest.approx(float(sigmoid(-1.0)))


def test_malformed_pooling_bodies_are_retried_then_rejected(server):
    server.script("pooling", {"values": [1.0]}, {"raw": "[[["}, {"json": {"data": []}}, {"values": [0.0, 0.0]})
    res = _eval(prm(server, max_retries=3), branch(STEPS[:2]))
    assert res.reward == pytest.approx(0.5) and len(server.requests["pooling"]) == 4
    server.script("pooling", {"raw": '{"data": [{"data": [NaN, 0.0]}]}'}, {"values": [1.0, 2.0, 3.0]})
    with pytest.raises(ScorerHTTPError, match="malformed"):
        _eval(prm(server, max_retries=1), branch(STEPS[:2]))


def test_5xx_and_timeouts_are_retried(server):
    server.script("pooling", {"status": 500}, {"delay": 1.5}, {"values": [0.0, 0.0]})
    res = _eval(prm(server, max_retries=2, timeout_s=0.3), branch(STEPS[:2]))
    assert res.reward == pytest.approx(0.5) and len(server.requests["pooling"]) == 3


def test_server_errors_keep_the_servers_reason(server):
    server.defaults["pooling"] = {"status": 500}
    with pytest.raises(ScorerHTTPError, match="HTTP 500: scripted failure"):
        _eval(prm(server, max_retries=0), branch(STEPS[:2]))


def test_through_the_runner_every_turn_gets_its_prefix_score(server):
    server.pooling_fn = lambda ids: [float(ids.count(SEP)) if i == SEP else 0.0 for i in ids]  # logit = #steps

    async def go():
        r = PRMRunner(PRMConfig(), scorers=[prm(server)])
        try:
            return await r.run(branch(STEPS))
        finally:
            await r.scorers[0].aclose()
            await r.aclose()

    res = run(go())
    for k, iid in enumerate(["p0", "p1", "p2"]):
        np.testing.assert_allclose(res[iid], [sigmoid(k + 1)] * 3, rtol=1e-6)


def test_unreachable_server_rejects_through_the_runner(free_port):
    s = PRMModelScorer(base_url=f"http://127.0.0.1:{free_port()}", model="m", tokenizer=make_tokenizer(),
                       step_separator_id=SEP, max_retries=1, backoff_s=0.0)
    with pytest.raises(ScoringRejected, match="ConnectError"):
        run(PRMRunner(PRMConfig(), scorers=[s]).run(branch(STEPS[:1])))


def test_tokenizer_from_a_tokenizer_json_path(tmp_path, server):
    path = tmp_path / "tokenizer.json"
    make_tokenizer().save(str(path))
    s = PRMModelScorer(base_url=server.url, model="m", tokenizer=str(path), step_separator_id=SEP)
    ids, _, _ = s.serialize(branch(STEPS)[-1], {})
    assert ids[:4] == [VOCAB["task"], VOCAB["fix"], VOCAB["the"], VOCAB["bug"]]


def test_from_config_with_a_tokenizer_path(tmp_path, server):
    path = tmp_path / "tokenizer.json"
    make_tokenizer().save(str(path))
    server.pooling_fn = lambda ids: [3.0 if i == SEP else 0.0 for i in ids]
    cfg = {"scorers": [{"path": "scorers.PRMModelScorer", "kwargs": {
        "base_url": server.url, "model": "m", "tokenizer": str(path), "step_separator_id": SEP}}]}

    async def go():
        r = await PRMRunner.create(cfg)
        try:
            return await r.run(branch(STEPS[:1]))
        finally:
            await r.aclose()

    np.testing.assert_allclose(run(go())["p0"], [sigmoid(3.0)] * 3, rtol=1e-6)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"step_separator_id": -1}, "step_separator_id"),
        ({"aggregation": "median"}, "aggregation"),
        ({"last_weight": 2.0}, "last_weight"),
        ({"max_task_tokens": 5000}, "max_task_tokens"),
        ({"endpoint": "pooling"}, "endpoint"),
        ({"step_template": "{act}"}, "step_template"),
        ({"tokenizer": object()}, "tokenizer"),
    ],
)
def test_constructor_validation(kw, match):
    base = dict(base_url="http://127.0.0.1:9", model="m", tokenizer=make_tokenizer(), step_separator_id=SEP)
    base.update(kw)
    with pytest.raises((ValueError, TypeError), match=match):
        PRMModelScorer(**base)
