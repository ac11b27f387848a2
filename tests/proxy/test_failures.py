"""The failure and concurrency rules of the proxy (docs/design.md), with fault injection: a scorer that raises on one
session, a missing session, a cancelled export, a retried export after consumption, an export during
an in-flight chat on __hitl__, concurrent exports, shutdown with scoring in flight, a scorer that
fails at startup, the stale-session sweep and an upstream failure."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rollout.client import ClientConfig
from rollout.proxy import ProxyConfig, ProxyServer, RecordingProxy
from rollout.proxy.app import create_app
from rollout.testing import ScriptedServer, ServerScript, fixed_text_policy, make_test_tokenizer

from . import proxy_scorers as ps
from .conftest import ADMIN, key_headers, proxy_config, running_proxy

SYS = {"role": "system", "content": "FrozenLake: reach G."}
USER = {"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}


async def _episode(srv, session, turns: int = 1, reward: float | None = 1.0, fork: bool = False):
    async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=session.api_key, max_retries=0) as client:
        msgs = [SYS, USER]
        for i in range(turns):
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            msgs = [*msgs, r.choices[0].message.model_dump(), {"role": "user", "content": f"obs {i}"}]
        if fork:  # a sibling of the last turn: the same history up to it, another observation
            await client.chat.completions.create(model="m", messages=[*msgs[:-3], {"role": "user", "content": "fork"}],
                                                 max_tokens=8)
    if reward is not None:
        srv.proxy.set_reward(session, {"reward": reward})


async def _http_export(srv, body, key=ADMIN):
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(srv.url + "/export_trajectories", json=body, headers=key_headers(key))


def test_a_scorer_failure_rejects_the_group_but_keeps_the_others_stats(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.SlowScorer(delay_s=0.1, fail_session="f-1")]) as srv:
            gid, sessions = srv.proxy.start_session("f", group_size=3)
            await asyncio.gather(*(_episode(srv, s) for s in sessions))
            r = await _http_export(srv, {"session_ids": [s.id for s in sessions], "group_id": gid})
            return r, sessions, len(srv.proxy.store), srv.proxy.stats()

    r, sessions, live, stats = asyncio.run(go())
    assert r.status_code == 200
    out = r.json()
    assert out["rows"] == [] and out["rejected"]["reason"] == "scoring_failed"
    assert out["rejected"]["session_ids"] == ["f-1"] and "injected failure" in out["rejected"]["message"]
    assert set(out["prm_stats"]["sessions"]) == {"f-0", "f-2"}  # the successful members still report
    assert ps.STATE["max_active"] >= 2  # sessions are scored concurrently
    assert live == 0 and all(s.removed for s in sessions)  # removed on scoring failure too
    assert stats["rejected_groups"] == 1


def test_a_missing_session_rejects_the_group_without_scoring(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.TurnIndexScorer()]) as srv:
            gid, sessions = srv.proxy.start_session("m", group_size=2)
            await _episode(srv, sessions[0])
            await _episode(srv, sessions[1], reward=None)  # this agent never set a reward
            r1 = await _http_export(srv, {"session_ids": ["m-0", "m-1"], "group_id": gid})
            _, (other,) = srv.proxy.start_session("n")
            await _episode(srv, other)
            r2 = await _http_export(srv, {"session_ids": ["n-0", "nope-0"]})
            return r1.json(), r2.json(), len(srv.proxy.store)

    out1, out2, live = asyncio.run(go())
    assert out1["rows"] == [] and out1["rejected"]["reason"] == "missing_session"
    assert out1["rejected"]["session_ids"] == ["m-1"] and "no ready trajectory" in out1["rejected"]["message"]
    assert out2["rejected"]["session_ids"] == ["nope-0"] and "unknown session" in out2["rejected"]["message"]
    assert ps.STATE["calls"] == 0 and "prm_stats" not in out1
    assert live == 0  # the present members were consumed and removed


def test_a_retried_export_gets_nothing_and_never_rescores(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.TurnIndexScorer()]) as srv:
            _, (s,) = srv.proxy.start_session("r")
            await _episode(srv, s, turns=2)
            first = (await _http_export(srv, {"session_ids": [s.id], "remove_session": False})).json()
            calls = ps.STATE["calls"]
            second = (await _http_export(srv, {"session_ids": [s.id], "remove_session": False})).json()
            return first, second, calls, s

    first, second, calls, s = asyncio.run(go())
    assert len(first["rows"]) == 1 and calls == 2
    assert second["rows"] == [] and second["rejected"]["reason"] == "missing_session"
    assert ps.STATE["calls"] == calls and "prm_stats" not in second
    assert not s.removed  # remove_session false keeps it


def test_a_cancelled_export_cleans_up_and_spares_a_session_that_reuses_the_id(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.SlowScorer(delay_s=5.0)]) as srv:
            proxy = srv.proxy
            _, (old,) = proxy.start_session("c")
            await _episode(srv, old)
            task = asyncio.create_task(proxy.export({"session_ids": ["c-0"]}))
            while not ps.EVENTS:
                await asyncio.sleep(0.01)
            proxy.store.remove(old)  # e.g. swept while its export is in flight ...
            _, (new,) = proxy.start_session("c")  # ... and the id is reused by a new session
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return old, new, proxy.store.by_id.get("c-0"), dict(ps.STATE), list(ps.EVENTS)

    old, new, current, state, events = asyncio.run(go())
    assert old.removed and current is new and not new.removed
    assert state["active"] == 0 and ("done", "c-0") not in events  # the scorer call was cancelled


def test_concurrent_exports_of_different_groups_and_branch_order(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.TurnIndexScorer(), ps.SlowScorer(delay_s=0.2)]) as srv:
            ga, sa = srv.proxy.start_session("ga", group_size=2)
            gb, sb = srv.proxy.start_session("gb", group_size=2)
            await asyncio.gather(*(_episode(srv, s, turns=2, fork=True) for s in [*sa, *sb]))
            ra, rb = await asyncio.gather(_http_export(srv, {"session_ids": [s.id for s in sa], "group_id": ga}),
                                          _http_export(srv, {"session_ids": [s.id for s in sb], "group_id": gb}))
            return ra.json(), rb.json(), {s.id: s for s in [*sa, *sb]}

    oa, ob, sessions = asyncio.run(go())
    assert {r["session_id"] for r in oa["rows"]} == {"ga-0", "ga-1"} and len(oa["rows"]) == 4
    assert {r["session_id"] for r in ob["rows"]} == {"gb-0", "gb-1"} and len(ob["rows"]) == 4
    assert ps.STATE["max_active"] >= 4  # both exports' sessions were scored at the same time
    # within a session, branches are scored one after the other, in leaf order
    for sid in sessions:
        leaves = [leaf for (kind, (s, leaf, _)) in ((k, v) for k, v in ps.EVENTS if k == "score") if s == sid]
        order = [leaf for i, leaf in enumerate(leaves) if i == 0 or leaves[i - 1] != leaf]
        assert len(order) == 2 and len(set(order)) == 2, leaves


def test_export_during_an_in_flight_hitl_chat():
    tok = make_test_tokenizer()
    script = ServerScript(policy=fixed_text_policy(tok, "```Left```"))

    async def go():
        with ScriptedServer(script, tok) as up:
            cfg = ProxyConfig(upstream=ClientConfig(endpoints=(up.url,), dialect="sglang"), admin_key=ADMIN,
                              default_max_tokens=8)
            async with await ProxyServer.start(cfg, tok) as srv:
                admin = openai.AsyncOpenAI(base_url=srv.base_url, api_key=ADMIN, max_retries=0)
                r1 = await admin.chat.completions.create(model="m", messages=[SYS, USER])
                srv.proxy.set_reward(srv.proxy.store.hitl, {"reward": 1.0})
                script.delay_queue.append(1.0)  # the next chat is slow: in flight during the export
                msgs = [SYS, USER, r1.choices[0].message.model_dump(), {"role": "user", "content": "next"}]
                chat = asyncio.create_task(admin.chat.completions.create(model="m", messages=msgs))
                while srv.proxy.store.hitl.inflight == 0:
                    await asyncio.sleep(0.01)
                ex1 = (await _http_export(srv, {"session_ids": ["__hitl__"]})).json()
                r2 = await chat
                srv.proxy.set_reward(srv.proxy.store.hitl, {"reward": 0.0})
                ex2 = (await _http_export(srv, {"session_ids": ["__hitl__"]})).json()
                await admin.close()
                return r1, r2, ex1, ex2, srv.proxy.store.hitl

    r1, r2, ex1, ex2, hitl = asyncio.run(go())
    assert [r["leaf_id"] for r in ex1["rows"]] == [r1.id]
    assert [r["leaf_id"] for r in ex2["rows"]] == [r2.id]  # it survived the export that ran meanwhile
    assert not hitl.removed and hitl.records[r2.id].parent is hitl.records[r1.id]


def test_shutdown_drains_scoring_then_closes_the_runner_then_the_client(upstream):
    ps.reset()
    prm = {"enabled": True, "scorers": [{"path": "tests.proxy.proxy_scorers.SlowScorer", "kwargs": {"delay_s": 0.5}},
                                        {"path": "tests.proxy.proxy_scorers.ClosingScorer"}]}

    async def go():
        handle, tok = upstream
        srv = await ProxyServer.start(proxy_config(handle.url, prm=prm), tok)
        ps.STATE["proxy"] = srv.proxy
        _, (s,) = srv.proxy.start_session("sd")
        await _episode(srv, s)
        _, (s2,) = srv.proxy.start_session("sd2")
        await _episode(srv, s2)
        first = asyncio.create_task(_http_export(srv, {"session_ids": [s.id]}))
        while not any(k == "start" for k, _ in ps.EVENTS):
            await asyncio.sleep(0.01)
        stop = asyncio.create_task(srv.stop())
        await asyncio.sleep(0.05)
        late = await _http_export(srv, {"session_ids": [s2.id]})
        async with httpx.AsyncClient(timeout=10) as http:
            health = await http.get(srv.url + "/health")
        r = await first
        await stop
        return r, late, health, srv.proxy

    r, late, health, proxy = asyncio.run(go())
    assert r.status_code == 200 and len(r.json()["rows"]) == 1  # drained: the in-flight export finished
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    assert health.status_code == 503
    assert ("aclose", True) in ps.EVENTS  # scorers closed while the upstream client was still open
    assert proxy.client is None and proxy.runner.closing


def test_a_scorer_startup_failure_closes_what_was_opened_and_raises_the_original(upstream):
    ps.reset()
    handle, tok = upstream
    prm = {"enabled": True, "scorers": [{"path": "tests.proxy.proxy_scorers.ClosingScorer"},
                                        {"path": "tests.proxy.proxy_scorers.BrokenScorer"}]}

    async def go():
        with pytest.raises(RuntimeError, match="broken scorer: cannot start"):
            await ProxyServer.start(proxy_config(handle.url, prm=prm), tok)
        proxy = RecordingProxy(proxy_config(handle.url, prm=prm), tok)
        ps.STATE["proxy"] = proxy
        app = create_app(proxy)
        with pytest.raises(RuntimeError, match="broken scorer: cannot start"):
            async with app.router.lifespan_context(app):
                pass
        return proxy

    proxy = asyncio.run(go())
    assert ps.EVENTS.count(("aclose", True)) == 1 and len([e for e in ps.EVENTS if e[0] == "aclose"]) == 2
    assert proxy.client is None and not proxy.started  # the upstream client was closed again


def test_stale_sessions_are_swept(upstream):
    async def go():
        async with running_proxy(upstream, session_timeout_s=0.3, sweep_interval_s=0.05) as srv:
            _, (s,) = srv.proxy.start_session("st")
            await asyncio.sleep(0.8)
            client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="unknown or expired session key"):
                await client.chat.completions.create(model="m", messages=[SYS, USER])
            await client.close()
            return s, srv.proxy.stats()

    s, stats = asyncio.run(go())
    assert s.removed and stats["sessions_swept"] >= 1 and stats["live_sessions"] == 0


def test_an_upstream_failure_is_a_502_and_leaves_no_record():
    tok = make_test_tokenizer()
    script = ServerScript(policy=fixed_text_policy(tok, "```Up```"), fail_statuses=[400])

    async def go():
        with ScriptedServer(script, tok) as up:
            cfg = ProxyConfig(upstream=ClientConfig(endpoints=(up.url,), max_retries=0), admin_key=ADMIN)
            async with await ProxyServer.start(cfg, tok) as srv:
                _, (s,) = srv.proxy.start_session("up")
                client = openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0)
                with pytest.raises(openai.APIStatusError, match="upstream generation failed") as err:
                    await client.chat.completions.create(model="m", messages=[SYS, USER])
                ok = await client.chat.completions.create(model="m", messages=[SYS, USER])
                await client.close()
                return err.value.status_code, s, ok

    status, s, ok = asyncio.run(go())
    assert status == 502 and list(s.records) == [ok.id] and s.inflight == 0


def test_the_client_is_closed_even_when_scorer_cleanup_fails(upstream):
    ps.reset()
    handle, tok = upstream
    prm = {"enabled": True, "scorers": [{"path": "tests.proxy.proxy_scorers.FailingCloseScorer"}]}

    async def go():
        proxy = RecordingProxy(proxy_config(handle.url, prm=prm), tok)
        await proxy.startup()
        client = proxy.client
        with pytest.raises(ExceptionGroup) as err:
            await proxy.shutdown()
        return client, proxy, err.value

    client, proxy, err = asyncio.run(go())
    assert "cannot flush the audit log" in str(err.exceptions[0]) and ("aclose_failed", None) in ps.EVENTS
    assert proxy.client is None and client.is_closed
