"""The parent rule and concat tokenization: unit tests on sessions, then real chats through the proxy
(the official openai SDK as the agent, the embedded tiny server as the upstream) and their rows."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai

from rollout.chat import PromptBuilder
from rollout.proxy.sessions import Session, normalize_message
from rollout.types import ModelResponse

from .conftest import admin_headers, key_headers, running_proxy

SYS = {"role": "system", "content": "FrozenLake: reach G."}
USER = {"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}


def _resp(n_in: int = 3, n_out: int = 2) -> ModelResponse:
    return ModelResponse(input_tokens=np.arange(n_in), output_tokens=np.arange(n_out) + 50,
                         output_logprobs=np.full(n_out, -0.1))


def _turn(s: Session, messages, text: str):
    rec = s.begin(messages, concat=True)
    s.complete(rec, _resp(), text)
    return rec


# ------------------------------------------------------------------------- unit: the rule itself


def test_longest_prefix_wins_and_ties_go_to_the_earliest():
    s = Session("t-0", "k", task_id="t", group_id="t")
    a = _turn(s, [SYS, USER], "a")
    a2 = _turn(s, [SYS, USER], "a")  # a retry with the same answer: a sibling of a, never a's child
    assert a.parent is None and a2.parent is None
    b = _turn(s, [SYS, USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u1"}], "b")
    assert b.parent is a  # both a and a2 match; the earliest wins
    c = _turn(s, [SYS, USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u1"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "u2"}], "c")
    assert c.parent is b  # longest: b (4 messages + output) beats a (2 + output)
    d = _turn(s, [SYS, USER, {"role": "assistant", "content": "other"}, {"role": "user", "content": "u1"}], "d")
    assert d.parent is None  # an edited assistant message matches no record: a new root


def test_null_keys_are_ignored_and_in_flight_records_are_skipped():
    s = Session("t-0", "k", task_id="t", group_id="t")
    a = _turn(s, [SYS, USER], "a")
    dumped = {"role": "assistant", "content": "a", "refusal": None, "tool_calls": None, "audio": None}
    assert normalize_message(dumped) == {"role": "assistant", "content": "a"}
    b = s.begin([SYS, USER, dumped, {"role": "user", "content": "u"}], concat=True)  # in flight
    assert b.parent is a
    c = _turn(s, [SYS, USER, dumped, {"role": "user", "content": "u"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "v"}], "c")
    assert c.parent is a  # b has no output yet: it cannot be a parent
    s.complete(b, _resp(), "")
    e = _turn(s, [SYS, USER, dumped, {"role": "user", "content": "u"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "v"}], "e")
    assert e.parent is b


def _brute_force_parent(s: Session, norm):
    """The parent rule (docs/design.md), literally: the completed record with the most messages whose messages +
    output prefix ``norm``; ties to the earliest."""
    best = None
    for rec in sorted(s.records.values(), key=lambda r: r.seq):
        if rec.done:
            full = [*rec.norm, normalize_message(rec.output_message)]
            if len(full) <= len(norm) and full == list(norm[:len(full)]) and (best is None or len(full) > len(best.norm) + 1):
                best = rec
    return best


def test_the_indexed_lookup_equals_the_rule_on_random_trees():
    import random

    rng = random.Random(0)
    for trial in range(30):
        s = Session(f"r{trial}-0", "k", task_id="r", group_id="r")
        convs = [[SYS, USER]]
        for _ in range(25):
            base = rng.choice(convs)
            if rng.random() < 0.3 and len(base) > 2:  # an edited or truncated history
                base = base[:rng.randrange(2, len(base))]
            msgs = [*base] if base[-1]["role"] == "user" else [*base, {"role": "user", "content": f"u{rng.randrange(3)}"}]
            expected = _brute_force_parent(s, [normalize_message(m) for m in msgs])
            rec = s.begin(msgs, concat=True)
            assert rec.parent is expected
            if rng.random() < 0.1:
                continue  # left in flight: never a parent
            text = f"a{rng.randrange(3)}"
            s.complete(rec, _resp(), text)
            convs.append([*msgs, {"role": "assistant", "content": text}])


def test_messages_are_deep_copied():
    s = Session("t-0", "k", task_id="t", group_id="t")
    msgs = [dict(SYS), dict(USER)]
    rec = _turn(s, msgs, "a")
    msgs[1]["content"] = "changed by the agent afterwards"
    assert rec.messages[1]["content"] == USER["content"]


# ------------------------------------------------------------------------- through the proxy


async def _chat(client, messages):
    r = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    return r, r.choices[0].message


async def _export(srv, session_ids, **kw):
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(srv.url + "/export_trajectories", json={"session_ids": session_ids, **kw},
                            headers=admin_headers())
    assert r.status_code == 200, r.text
    return r.json()


async def _reward(srv, key, body):
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(srv.url + "/rl/set_reward", json=body, headers=key_headers(key))
    assert r.status_code == 200, r.text
    return r.json()


def _check_row(row, records, version):
    """Tokens of every turn sit token-identical in the row; masks/logprobs/turn ids/versions as docs/design.md states."""
    tokens = np.asarray(row["tokens"])
    mask = np.asarray(row["loss_mask"])
    lps = np.asarray(row["logprobs"], np.float32)
    turn_ids = np.asarray(row["turn_ids"])
    versions = np.asarray(row["versions"])
    expected_mask = np.zeros_like(mask)
    for j, rec in enumerate(records):
        r = rec.response
        s, n = r.input_len, r.output_len
        assert np.array_equal(tokens[:s], r.input_tokens), f"turn {j}: the prompt is not a prefix of the row"
        assert np.array_equal(tokens[s:s + n], r.output_tokens), f"turn {j}: generated tokens moved"
        assert np.array_equal(lps[s:s + n], r.output_logprobs)
        assert np.all(turn_ids[s:s + n] == j) and np.all(versions[s:s + n] == version)
        expected_mask[s:s + n] = 1
    assert np.array_equal(mask, expected_mask)
    assert np.all(lps[mask == 0] == 0) and np.all(turn_ids[mask == 0] == -1) and np.all(versions[mask == 0] == -1)
    last = records[-1].response
    assert len(tokens) == last.input_len + last.output_len


def test_linear_chat_keeps_earlier_turns_token_identical(upstream):
    handle, tok = upstream

    async def go():
        async with running_proxy(upstream) as srv:
            _, (s,) = srv.proxy.start_session("lin")
            client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0)
            msgs = [SYS, USER]
            for i in range(3):
                r, m = await _chat(client, msgs)
                msgs = [*msgs, m.model_dump(), {"role": "user", "content": f"You moved. Turn {i}"}]
            recs = list(s.records.values())
            ans = await _reward(srv, s.api_key, {"reward": 1.0})
            out = await _export(srv, [s.id])
            await client.close()
            return recs, ans, out

    recs, ans, out = asyncio.run(go())
    assert [r.parent for r in recs] == [None, recs[0], recs[1]]
    assert recs[0].response.input_tokens.tolist() == PromptBuilder(tok).initial([SYS, USER])
    for prev, nxt in zip(recs, recs[1:]):  # concat: prompt = parent prompt + parent output + suffix
        head = np.concatenate([prev.response.input_tokens, prev.response.output_tokens])
        assert np.array_equal(nxt.response.input_tokens[:len(head)], head)
    assert ans == {"interaction_count": 3, "session_id": "lin-0", "trajectory_id": 0, "trajectory_ready": True,
                   "ready_transition": True}
    (row,) = out["rows"]
    assert row["leaf_id"] == recs[-1].id and row["interaction_ids"] == [r.id for r in recs]
    assert row["outcome_reward"] == 1.0 and row["process_rewards"] is None and row["masked_turns"] == 0
    _check_row(row, recs, handle.weight_version)


def test_retry_forks_and_two_branches_from_one_prefix(upstream):
    handle, _ = upstream

    async def go():
        async with running_proxy(upstream) as srv:
            _, (s,) = srv.proxy.start_session("fork")
            client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0)
            _, a = await _chat(client, [SYS, USER])
            _, a_retry = await _chat(client, [SYS, USER])  # the agent retried the same request
            base = [SYS, USER, a_retry.model_dump()]
            await _chat(client, [*base, {"role": "user", "content": "left branch"}])
            await _chat(client, [*base, {"role": "user", "content": "right branch"}])
            recs = list(s.records.values())
            await _reward(srv, s.api_key, {"rewards": {recs[2].id: 1.0, recs[3].id: 0.0}})
            await client.close()
            return recs, await _export(srv, [s.id])

    recs, out = asyncio.run(go())
    a, a_retry, left, right = recs
    assert a.parent is None and a_retry.parent is None and left.parent is a_retry and right.parent is a_retry
    rows = {r["leaf_id"]: r for r in out["rows"]}
    assert set(rows) == {a.id, left.id, right.id}  # a_retry has children: not a leaf
    _check_row(rows[a.id], [a], handle.weight_version)
    _check_row(rows[left.id], [a_retry, left], handle.weight_version)
    _check_row(rows[right.id], [a_retry, right], handle.weight_version)
    shared = a_retry.response.input_len + a_retry.response.output_len
    assert rows[left.id]["tokens"][:shared] == rows[right.id]["tokens"][:shared]
    # outcome = the leaf's reward after the backward discount over creation order (discount 1):
    # right (last) 0.0, left 1.0 + 0.0, a: 0 + 1.0 (+ the later ones)
    assert rows[right.id]["outcome_reward"] == 0.0 and rows[left.id]["outcome_reward"] == 1.0
    assert rows[a.id]["outcome_reward"] == 1.0
