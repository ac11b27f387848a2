"""Streaming (SSE) with the official OpenAI SDK and SGLang's /generate, client disconnects, the RL
control endpoints, cached-token usage and /metrics, over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = ("You are walking on a frozen lake. The goal is to reach the gift without falling into a hole. "
          "Which way do you go?")


def sse_events(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sdk_streamed_completion_equals_the_whole_answer(client, http):
    kw = dict(prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7, logprobs=1)
    whole = http.post("/v1/completions", json=dict(kw, ignore_eos=True, return_token_ids=True)).json()["choices"][0]
    stream = client.completions.create(model="tiny", stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    text, ids, lps, finish, usage, versions = "", [], [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.text
            ids += ch.model_extra["token_ids"]
            versions += ch.model_extra["output_token_versions"]
            lps += ch.logprobs.token_logprobs if ch.logprobs else []
            finish = ch.finish_reason or finish
    assert text == whole["text"] and ids == whole["token_ids"] and finish == "length"
    np.testing.assert_allclose(lps, whole["logprobs"]["token_logprobs"], atol=1e-5)
    assert versions == whole["output_token_versions"] and len(versions) == 16
    assert usage.completion_tokens == 16 and usage.prompt_tokens == len(whole["prompt_token_ids"])
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt was just served


def test_sdk_streamed_chat_applies_stop_strings_like_the_whole_answer(client, http):
    msgs = [{"role": "user", "content": "Which action? Think first."}]
    base = dict(model="tiny", messages=msgs, max_tokens=32, temperature=1.0, seed=21)
    full = http.post("/v1/chat/completions", json=dict(base, ignore_eos=True)).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), "degenerate sample text"
    whole = http.post("/v1/chat/completions", json=dict(base, ignore_eos=True, stop=[stop], logprobs=True,
                                                        return_token_ids=True)).json()["choices"][0]
    stream = client.chat.completions.create(stream=True, stop=[stop], logprobs=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}, **base)
    role, text, ids, lps, finish = None, "", [], [], None
    for chunk in stream:
        ch = chunk.choices[0]
        role = role or ch.delta.role
        text += ch.delta.content or ""
        ids += ch.model_extra.get("token_ids") or []
        lps += [x.logprob for x in ch.logprobs.content] if ch.logprobs and ch.logprobs.content else []
        finish = ch.finish_reason or finish
    assert role == "assistant" and text == whole["message"]["content"] == full[: full.index(stop)]
    assert ids == whole["token_ids"] and finish == "stop" == whole["finish_reason"]
    np.testing.assert_allclose(lps, [x["logprob"] for x in whole["logprobs"]["content"]], atol=1e-5)


def test_generate_streams_cumulative_outputs(http, tiny):
    _, tok = tiny
    ids = tok.encode(PROMPT)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 10, "temperature": 0.5, "seed": 3,
                                                  "ignore_eos": True}, "return_logprob": True}
    whole = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json=dict(body, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and len(events) >= 3
    last = events[-2]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    meta = last["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 10} and meta["completion_tokens"] == 10
    assert [x[1] for x in meta["output_token_logprobs"]] == whole["output_ids"]
    assert meta["cached_tokens"] > 0  # the prompt was served just before
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
    assert len(meta["output_token_versions"]) == 10


def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while (engine.scheduler.num_waiting or engine.scheduler.num_running) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not (engine.scheduler.num_waiting or engine.scheduler.num_running)


def test_client_disconnect_cancels_the_request(server, http):
    """While generation is paused in place, a non-streamed and a streamed request whose clients go
    away are removed from the engine (their KV blocks freed), and nothing is left to resume."""
    engine = server.app.state.server.engine
    assert http.post("/pause_generation", json={"mode": "in_place"}).json()["success"]
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 32}, timeout=0.5)
        with httpx.Client(base_url=server.url, timeout=30) as h:
            with h.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "stream": True}) as r:
                first = next(r.iter_lines())
                assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
        assert wait_idle(engine)
        assert engine.pool.num_referenced == 0
    finally:
        assert http.post("/continue_generation").json()["success"]


def test_pause_continue_flush_and_metrics(server, http):
    engine = server.app.state.server.engine

    async def during_pause():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            assert (await c.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
            reqs = [asyncio.ensure_future(c.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=8, seed=i,
                                                                              ignore_eos=True))) for i in range(4)]
            await asyncio.sleep(0.3)
            assert not any(r.done() for r in reqs) and engine.paused
            flushed = (await c.post("/flush_cache")).json()
            assert flushed["success"] and flushed["num_flushed_blocks"] >= 0
            assert (await c.post("/continue_generation")).json() == {"success": True}
            return [(await r).json() for r in reqs]

    outs = asyncio.run(during_pause())
    assert [o["usage"]["completion_tokens"] for o in outs] == [8] * 4
    cached = sorted(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and cached[-1] > 0  # after the flush one prefills, the others share its blocks
    r = http.post("/pause_generation", json={"mode": "retract"})
    assert r.status_code == 400 and "mode" in r.json()["error"]["message"]
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("jaxprm:num_requests_running", "jaxprm:num_requests_waiting", "jaxprm:prompt_tokens",
                 "jaxprm:generation_tokens", "jaxprm:prefix_cache_queries", "jaxprm:prefix_cache_hits",
                 "jaxprm:time_to_first_token_seconds", "jaxprm:decode_batch_size", "jaxprm:kv_cache_usage_perc"):
        assert name in families, name
    gen = [s.value for s in families["jaxprm:generation_tokens"].samples if s.name.endswith("_total")]
    assert gen and gen[0] >= 32
    assert "jaxprm:prompt_tokens_total" in text and "jaxprm:time_to_first_token_seconds_bucket" in text
