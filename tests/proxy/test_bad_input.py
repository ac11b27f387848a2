"""Bad input: each a 4xx with a clear message (the OpenAI error shape, so the SDK raises it), the
proxy still healthy afterwards and no session state lost."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from . import proxy_scorers as ps
from .conftest import ADMIN, admin_headers, key_headers, running_proxy

SYS = {"role": "system", "content": "FrozenLake: reach G."}
USER = {"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}


def test_bad_requests_are_4xx_with_clear_messages_and_lose_nothing(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.TurnIndexScorer()]) as srv:
            url = srv.url
            _, (s,) = srv.proxy.start_session("bad")
            _, (t,) = srv.proxy.start_session("other")
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
                first = await client.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=8)
            out: dict[str, tuple[int, str]] = {}
            async with httpx.AsyncClient(timeout=60) as http:
                async def call(name, path, body=None, headers=None, raw=None, method="POST"):
                    if method == "GET":
                        r = await http.get(url + path, headers=headers or {})
                    elif raw is not None:
                        r = await http.post(url + path, content=raw, headers={**(headers or {}),
                                                                             "Content-Type": "application/json"})
                    else:
                        r = await http.post(url + path, json=body, headers=headers or {})
                    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
                    out[name] = (r.status_code, err.get("message", r.text))

                chat = {"model": "m", "messages": [SYS, USER]}
                await call("no_key", "/v1/chat/completions", chat)
                await call("unknown_key", "/v1/chat/completions", chat, key_headers("sk-nope"))
                await call("malformed_json", "/v1/chat/completions", raw=b"{not json", headers=key_headers(s.api_key))
                await call("no_messages", "/v1/chat/completions", {"model": "m"}, key_headers(s.api_key))
                await call("bad_role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
                           key_headers(s.api_key))
                await call("n_2", "/v1/chat/completions", {**chat, "n": 2}, key_headers(s.api_key))
                await call("tools", "/v1/chat/completions", {**chat, "tools": [{"type": "function"}]},
                           key_headers(s.api_key))
                await call("bad_temperature", "/v1/chat/completions", {**chat, "temperature": "hot"},
                           key_headers(s.api_key))
                await call("wrong_admin", "/export_trajectories", {"session_ids": [s.id]}, key_headers("sk-nope"))
                await call("session_key_as_admin", "/export_trajectories", {"session_ids": [s.id]},
                           key_headers(s.api_key))
                await call("reward_unknown_interaction", "/rl/set_reward",
                           {"interaction_id": "chatcmpl-unknown", "reward": 1.0}, key_headers(s.api_key))
                await call("reward_not_a_number", "/rl/set_reward", {"reward": "high"}, key_headers(s.api_key))
                await call("reward_unknown_field", "/rl/set_reward", {"reward": 1.0, "bonus": 2},
                           key_headers(s.api_key))
                await call("reward_nothing", "/rl/set_reward", {}, key_headers(t.api_key))
                await call("export_not_a_list", "/export_trajectories", {"session_ids": "bad-0"}, admin_headers())
                await call("export_bad_field", "/export_trajectories", {"session_ids": [s.id], "discount": "x"},
                           admin_headers())
                await call("start_admin_key", "/rl/start_session", {"task_id": "x", "api_key": ADMIN},
                           admin_headers())
                await call("start_bad_size", "/rl/start_session", {"task_id": "x", "group_size": 0}, admin_headers())
                await call("start_duplicate_ids", "/rl/start_session", {"task_id": "bad"}, admin_headers())
                await call("start_bound_key", "/rl/start_session", {"task_id": "y", "api_key": s.api_key},
                           admin_headers())
                await call("unknown_route", "/v1/embeddings", {"input": "x"}, key_headers(s.api_key))
                # docs/design.md (the proxy): non-concat PRM exports and duplicate ids are refused before anything is claimed
                srv.proxy.set_reward(s, {"reward": 1.0})
                await call("prm_individual", "/export_trajectories", {"session_ids": [s.id], "style": "individual"},
                           admin_headers())
                await call("duplicate_ids", "/export_trajectories", {"session_ids": [s.id, s.id]}, admin_headers())
                # an ended session refuses chats and rewards (410)
                await call("end", "/rl/end_session", {}, key_headers(t.api_key))
                await call("ended_chat", "/v1/chat/completions", chat, key_headers(t.api_key))
                await call("ended_reward", "/rl/set_reward", {"reward": 1.0}, key_headers(t.api_key))
                health = await http.get(url + "/health")
                ok = await http.post(url + "/export_trajectories", json={"session_ids": [s.id]},
                                     headers=admin_headers())
            return out, health, ok.json(), first

    out, health, ok, first = asyncio.run(go())
    expect = {
        "no_key": (401, "missing Authorization"), "unknown_key": (401, "unknown or expired session key"),
        "malformed_json": (400, "not valid JSON"), "no_messages": (400, "messages must be a non-empty list"),
        "bad_role": (400, "messages[0].role must be one of"), "n_2": (400, "n must be 1"),
        "tools": (400, "tools[0] must be"), "bad_temperature": (400, "temperature must be a number"),
        "wrong_admin": (401, "needs the admin key"), "session_key_as_admin": (403, "needs the admin key"),
        "reward_unknown_interaction": (400, "unknown interaction id 'chatcmpl-unknown'"),
        "reward_not_a_number": (400, "reward must be a finite number"),
        "reward_unknown_field": (400, "unknown fields ['bonus']"),
        "reward_nothing": (400, "set_reward needs 'reward'"),
        "export_not_a_list": (400, "session_ids must be a non-empty list"),
        "export_bad_field": (400, "discount has the wrong type"),
        "start_admin_key": (400, "must not be the admin key"), "start_bad_size": (400, "group_size must be an integer"),
        "start_duplicate_ids": (409, "session id 'bad-0' is in use"),
        "start_bound_key": (409, "bound to the unfinished session 'bad-0'"),
        "unknown_route": (404, "no route POST /v1/embeddings"),
        "prm_individual": (400, "not allowed with active process-reward scorers"),
        "duplicate_ids": (400, "duplicate session ids ['bad-0']"),
        "end": (200, ""), "ended_chat": (410, "has ended"), "ended_reward": (410, "has ended"),
    }
    for name, (status, text) in expect.items():
        got_status, got_text = out[name]
        assert got_status == status and text in got_text, (name, out[name])
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # nothing was lost: the session's trajectory is still exported whole after all the refusals
    (row,) = ok["rows"]
    assert row["leaf_id"] == first.id and row["outcome_reward"] == 1.0
    assert ps.STATE["calls"] == 1


def test_the_sdk_raises_the_proxy_messages(upstream):
    async def go():
        async with running_proxy(upstream) as srv:
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="sk-nope", max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError, match="unknown or expired session key"):
                    await client.chat.completions.create(model="m", messages=[SYS, USER])
            _, (s,) = srv.proxy.start_session("sdk")
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
                with pytest.raises(openai.BadRequestError, match="n must be 1"):
                    await client.chat.completions.create(model="m", messages=[SYS, USER], n=2)
                models = await client.models.list()
            return models

    models = asyncio.run(go())
    assert [m.id for m in models.data] == ["jaxprm-proxy"]


def test_passthrough_forwards_unknown_keys_without_recording(upstream):
    async def go():
        async with running_proxy(upstream, passthrough=True) as srv:
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key="anything", max_retries=0) as client:
                r = await client.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=4)
            return r, srv.proxy.stats(), srv.proxy.store.hitl.records

    r, stats, hitl = asyncio.run(go())
    assert r.choices[0].message.role == "assistant" and stats["passthrough"] == 1 and not hitl


def test_refused_turns_leave_no_record(upstream):
    async def go():
        async with running_proxy(upstream, max_context_tokens=64) as srv:
            _, (s,) = srv.proxy.start_session("ctx")
            async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
                with pytest.raises(openai.BadRequestError, match="images and audio are not supported"):
                    await client.chat.completions.create(model="m", messages=[
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
                with pytest.raises(openai.BadRequestError, match="leaves no room for a response"):
                    await client.chat.completions.create(model="m", messages=[SYS, {"role": "user", "content": "x " * 80}])
                parts = await client.chat.completions.create(model="m", max_tokens=4, messages=[
                    {"role": "user", "content": [{"type": "text", "text": "Map:\n"}, {"type": "text", "text": "P G"}]}])
            return s, parts

    s, parts = asyncio.run(go())
    assert list(s.records) == [parts.id] and s.inflight == 0  # only the good turn was recorded
    assert parts.usage.prompt_tokens + parts.usage.completion_tokens <= 64
