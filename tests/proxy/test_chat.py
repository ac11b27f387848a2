"""The chat route with the official openai SDK: streaming (content, logprobs, usage) recorded like a
plain answer; seeded sessions (start_session's ``seed``) sample reproducibly, retries anew, and a
request's own seed wins; the hot path's refusals (method, size, JSON) keep the OpenAI error shape."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

from rollout.groups import request_seed

from .conftest import admin_headers, key_headers, running_proxy

SYS = {"role": "system", "content": "FrozenLake: reach G."}
USER = {"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}


def test_streamed_turns_are_recorded_and_continue_concat(upstream):
    async def go():
        async with running_proxy(upstream) as srv:
            _, (s,) = srv.proxy.start_session("st")
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
                stream = await client.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=8,
                                                              stream=True, logprobs=True,
                                                              stream_options={"include_usage": True})
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                msgs = [SYS, USER, {"role": "assistant", "content": text}, {"role": "user", "content": "next"}]
                second = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            return s, chunks, text, second

    s, chunks, text, second = asyncio.run(go())
    first, rec2 = list(s.records.values())
    assert chunks[0].id == first.id and all(c.id == first.id for c in chunks)
    assert text == first.text and chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length" if first.response.stop_reason == "length" else "stop"]
    lps = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert np.allclose(lps, first.response.output_logprobs)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == first.response.input_len
    assert usage.completion_tokens == first.response.output_len
    assert rec2.id == second.id and rec2.parent is first  # the streamed text continues the conversation
    head = np.concatenate([first.response.input_tokens, first.response.output_tokens])
    assert np.array_equal(rec2.response.input_tokens[:len(head)], head)


def test_seeded_sessions_sample_reproducibly(upstream):
    async def go():
        async with running_proxy(upstream) as srv:
            async with httpx.AsyncClient(timeout=60) as http:
                starts = [(await http.post(srv.url + "/rl/start_session", headers=admin_headers(),
                                           json={"task_id": f"seed{j}", "group_size": 2, "seed": "7:42"})).json()
                          for j in range(2)]
                bad = await http.post(srv.url + "/rl/start_session", headers=admin_headers(),
                                      json={"task_id": "badseed", "seed": 1.5})
            out = {}
            for j, st in enumerate(starts):
                for i, sess in enumerate(st["sessions"]):
                    async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=sess["session_api_key"],
                                                  max_retries=0) as client:
                        a = await client.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=8)
                        retry = await client.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=8)
                        own = await client.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=8,
                                                                   seed=request_seed("7:42", "b0", 0))
                    session = srv.proxy.store.by_id[sess["session_id"]]
                    out[j, i] = [session.records[c.id] for c in (a, retry, own)]
            return out, bad

    out, bad = asyncio.run(go())
    assert bad.status_code == 400 and "seed must be an integer or a non-empty string" in bad.json()["error"]["message"]
    tokens = {k: [r.response.output_tokens.tolist() for r in recs] for k, recs in out.items()}
    # the same seed, session index and depth sample the same turn (the tiny model is deterministic per seed)
    assert tokens[0, 0] == tokens[1, 0] and tokens[0, 1] == tokens[1, 1]
    a, retry, own = out[0, 0]
    assert (a.depth, a.sibling, retry.sibling, own.sibling) == (0, 0, 1, 2)
    sess0 = out[0, 0][0]
    assert tokens[0, 0][2] == tokens[0, 0][0]  # a request's own seed wins (here: the first turn's seed)
    assert request_seed("7:42", "b0", 0) != request_seed("7:42", "b0", 0, 1) != request_seed("7:42", "b1", 0)
    assert sess0.response.input_tokens.tolist() == out[0, 1][0].response.input_tokens.tolist()


def test_the_hot_path_refuses_with_the_openai_error_shape(upstream):
    async def go():
        async with running_proxy(upstream) as srv:
            _, (s,) = srv.proxy.start_session("hp")
            async with httpx.AsyncClient(timeout=60) as http:
                get = await http.get(srv.url + "/v1/chat/completions", headers=key_headers(s.api_key))
                big = await http.post(srv.url + "/v1/chat/completions", headers=key_headers(s.api_key),
                                      content=b"x" * (65 * 1024 * 1024))
                ok = await http.post(srv.url + "/chat/completions", headers=key_headers(s.api_key),
                                     json={"messages": [SYS, USER], "max_tokens": 4})
                health = await http.get(srv.url + "/health")
            return get, big, ok, health, s

    get, big, ok, health, s = asyncio.run(go())
    assert get.status_code == 405 and get.json()["error"]["type"] == "method_not_allowed"
    assert big.status_code == 413 and "larger than" in big.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion" and list(s.records) == [ok.json()["id"]]
    assert health.status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_both_chat_paths_record(upstream, path):
    async def go():
        async with running_proxy(upstream) as srv:
            _, (s,) = srv.proxy.start_session("p")
            async with httpx.AsyncClient(timeout=60) as http:
                r = await http.post(srv.url + path, headers=key_headers(s.api_key),
                                    json={"messages": [SYS, USER], "max_tokens": 4})
            return r, s

    r, s = asyncio.run(go())
    assert r.status_code == 200 and list(s.records) == [r.json()["id"]]
