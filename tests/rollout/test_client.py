"""The generation client against real HTTP servers on 127.0.0.1: the scripted uvicorn server (both
dialects, faults) and raw asyncio servers that count connections, drop them, answer late or with
garbage (the transport's keep-alive, limit, timeout and cancellation behaviour)."""

import asyncio
import contextlib
import gc
import socket
import warnings

import numpy as np
import pytest

from rollout.client import (
    ClientConfig,
    GenerationClient,
    GenerationError,
    SamplingParams,
    ServersUnavailableError,
    TextOnlyResponseError,
    top_entropies,
)
from rollout.testing import ScriptedServer, ServerScript, fixed_text_policy, hashed_action_policy

PARAMS = SamplingParams(max_tokens=32, seed=7)


def run(coro):
    return asyncio.run(coro)


async def _one(url, dialect, prompt, params=PARAMS, **cfg):
    async with GenerationClient(ClientConfig(endpoints=(url,), dialect=dialect, **cfg)) as c:
        return await c.generate(prompt, params), c.stats()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_token_backed_response_both_dialects(serve, tok, dialect):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "```Left```"), weight_version="3"))
    prompt = tok.encode("hello there")
    gen, stats = run(_one(srv.url, dialect, prompt))
    r = gen.response
    assert list(r.input_tokens) == prompt
    assert list(r.output_tokens) == tok.encode("```Left```") + [tok.eos_token_id]
    assert r.output_logprobs.shape == r.output_tokens.shape and np.all(r.output_logprobs < 0)
    assert r.stop_reason == "stop" and gen.text == "```Left```"
    assert r.weight_version == (3 if dialect == "sglang" else None)
    assert stats["requests"] == 1 and stats["prompt_tokens"] == len(prompt)


def test_dialects_agree_on_tokens_and_logprobs(serve, tok):
    srv = serve()
    prompt = tok.encode("same prompt for both")
    a, _ = run(_one(srv.url, "vllm", prompt))
    b, _ = run(_one(srv.url, "sglang", prompt))
    assert np.array_equal(a.response.output_tokens, b.response.output_tokens)
    assert np.array_equal(a.response.output_logprobs, b.response.output_logprobs)


def test_vllm_fallback_to_token_id_strings(serve, tok):
    script = ServerScript(policy=fixed_text_policy(tok, "```Up```"), vllm_token_ids=False)
    srv = serve(script)
    gen, _ = run(_one(srv.url, "vllm", [1, 2, 3]))
    assert list(gen.response.output_tokens) == tok.encode("```Up```") + [tok.eos_token_id]


def test_length_stop_is_truncated(serve, tok):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "a long answer that will not fit")))
    for dialect in ("vllm", "sglang"):
        gen, _ = run(_one(srv.url, dialect, [5, 6], SamplingParams(max_tokens=3)))
        assert gen.response.stop_reason == "length" and gen.response.truncated and gen.response.output_len == 3


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_text_only_server_is_rejected(serve, tok, dialect):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "hi"), text_only=True))
    with pytest.raises(TextOnlyResponseError, match="token-backed"):
        run(_one(srv.url, dialect, [1, 2]))
    gen, _ = run(_one(srv.url, dialect, [1, 2], require_tokens=False))
    assert gen.text == "hi" and gen.response.output_len == 0


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_errors_are_retried(serve, tok, status):
    script = ServerScript(policy=fixed_text_policy(tok, "ok"), fail_statuses=[status, status])
    srv = serve(script)
    gen, stats = run(_one(srv.url, "vllm", [1], max_retries=3, backoff_base_s=0.001))
    assert gen.attempts == 3 and stats["retries"] == 2 and script.requests == 3


def test_retries_are_bounded(serve, tok):
    script = ServerScript(policy=fixed_text_policy(tok, "ok"), fail_statuses=[500] * 10)
    srv = serve(script)
    with pytest.raises(GenerationError, match="after 3 attempts.*500"):
        run(_one(srv.url, "sglang", [1], max_retries=2, backoff_base_s=0.001))
    assert script.requests == 3


def test_client_errors_are_not_retried(serve, tok):
    script = ServerScript(policy=fixed_text_policy(tok, "ok"), fail_statuses=[400])
    srv = serve(script)
    with pytest.raises(GenerationError, match="HTTP 400"):
        run(_one(srv.url, "vllm", [1], backoff_base_s=0.001))
    assert script.requests == 1


def test_timeout_then_success(serve, tok):
    script = ServerScript(policy=fixed_text_policy(tok, "ok"), delay_queue=[1.0])
    srv = serve(script)
    gen, stats = run(_one(srv.url, "vllm", [1], timeout_s=0.2, backoff_base_s=0.001))
    assert gen.attempts == 2 and stats["retries"] == 1 and gen.text == "ok"


def test_timeout_exhausts_retries(serve, tok):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "ok"), delay_s=1.0))
    with pytest.raises(GenerationError, match="ReadTimeout"):
        run(_one(srv.url, "vllm", [1], timeout_s=0.1, max_retries=1, backoff_base_s=0.001))


def test_a_refused_connection_waits_for_a_server_then_fails_after_unavailable_timeout_s(free_port):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServersUnavailableError, match=r"down for 1 s .*ConnectError"):
        run(_one(url, "vllm", [1], max_retries=2, backoff_base_s=0.001, unavailable_timeout_s=1.0, probe_base_s=0.05))


def test_a_lost_server_is_marked_down_and_serves_again_only_after_on_recover(tok, free_port):
    """A dead endpoint is marked down on its first refused connection (that request fails over,
    without using a retry), gets no requests while down, and returns only when its health probe and
    the ``on_recover`` hook both succeed (a failing hook keeps it down)."""
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    live_script, back_script = (ServerScript(policy=fixed_text_policy(tok, "ok")) for _ in range(2))

    async def go(live):
        calls = []

        async def hook(ep):
            calls.append(ep)
            if len(calls) == 1:
                raise GenerationError("weights not pushed yet")

        cfg = ClientConfig(endpoints=(dead, live.url), backoff_base_s=0.001, max_retries=0, probe_base_s=60)
        async with GenerationClient(cfg) as c:
            c.on_recover = hook
            before = [await c.generate([1], PARAMS) for _ in range(3)]
            assert c.health.down().keys() == {dead} and c.stats()["failovers"] == 1
            with ScriptedServer(back_script, tok, port=port):
                assert await c.recover() == [dead]  # it answers, but the hook refused: still down
                assert await c.generate([2], PARAMS) and back_script.requests == 0
                assert await c.recover() == []
                after = await asyncio.gather(*[c.generate([3], PARAMS) for _ in range(4)])
            return before, after, calls, c.stats()

    with ScriptedServer(live_script, tok) as live:
        before, after, calls, stats = run(go(live))
    assert [g.attempts for g in before] == [2, 1, 1] and {g.endpoint for g in before} == {live.url}
    assert calls == [dead, dead] and back_script.requests == 2  # the two requests least-loaded routing sent it
    assert sorted(g.endpoint for g in after) == sorted([dead, dead, live.url, live.url])
    assert (stats["marked_down"], stats["recovered"], stats["failed_probes"], stats["down"]) == (1, 1, 1, 0)
    assert stats["retries"] == 0 and stats["failures"] == 0


def test_with_every_server_down_requests_wait_and_go_on_when_one_returns(tok, free_port):
    """The one server dies: a request waits (probing with backoff) instead of failing, and is sent
    again, with the same body and seed, to the restarted server."""
    port = free_port()
    script = ServerScript(policy=hashed_action_policy(tok))

    async def go():
        cfg = ClientConfig(endpoints=(f"http://127.0.0.1:{port}",), probe_base_s=0.05, probe_max_s=0.2,
                           unavailable_timeout_s=30)
        async with GenerationClient(cfg) as c:
            with ScriptedServer(script, tok, port=port):
                first = await c.generate([5, 6], PARAMS)
            waiting = asyncio.ensure_future(c.generate([5, 6], PARAMS))
            await asyncio.sleep(0.5)
            assert not waiting.done() and c.stats()["down"] == 1
            with ScriptedServer(script, tok, port=port):
                again = await waiting
            return first, again, c.stats()

    first, again, stats = run(go())
    assert np.array_equal(first.response.output_tokens, again.response.output_tokens)  # the same seeded sample
    assert again.attempts == 2 and stats["failovers"] == 1 and stats["recovered"] == 1 and stats["failed_probes"] >= 1


@pytest.mark.parametrize("limit", [1, 3])
def test_concurrency_limit(serve, tok, limit):
    script = ServerScript(policy=fixed_text_policy(tok, "ok"), delay_s=0.05)
    srv = serve(script)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,), max_concurrency=limit)) as c:
            await asyncio.gather(*[c.generate([i + 1], PARAMS) for i in range(4 * limit)])
            assert c._outstanding[srv.url] == 0 and c._sem._value == limit

    run(go())
    assert script.requests == 4 * limit and script.max_inflight == limit


def test_least_outstanding_and_sticky_routing(serve, tok):
    s1 = ServerScript(policy=fixed_text_policy(tok, "ok"), delay_s=0.1)
    s2 = ServerScript(policy=fixed_text_policy(tok, "ok"), delay_s=0.1)
    a, b = serve(s1), serve(s2)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(a.url, b.url))) as c:
            spread = await asyncio.gather(*[c.generate([1], PARAMS) for _ in range(4)])
            sticky = await asyncio.gather(*[c.generate([1], PARAMS, route_key="tree-1") for _ in range(4)])
            c.release("tree-1")
            return [g.endpoint for g in spread], [g.endpoint for g in sticky]

    spread, sticky = run(go())
    assert sorted(spread) == sorted([a.url, a.url, b.url, b.url])
    assert len(set(sticky)) == 1
    assert s1.requests + s2.requests == 8


def test_prompt_echo_mismatch_is_an_error(serve, tok):
    from rollout.dialects import parse_vllm

    data = {"choices": [{"text": "x", "token_ids": [1], "prompt_token_ids": [9, 9], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5], "tokens": ["token_id:1"]}}]}
    assert parse_vllm(data, require_tokens=True)[5] == [9, 9]
    with pytest.raises(GenerationError, match="finish_reason"):
        parse_vllm({"choices": [{"text": "x", "finish_reason": "weird"}]}, require_tokens=True)


def test_config_validation():
    with pytest.raises(ValueError, match="dialect"):
        ClientConfig(endpoints=("http://x",), dialect="tgi")
    with pytest.raises(ValueError, match="endpoints"):
        ClientConfig(endpoints=())
    with pytest.raises(ValueError, match=r"endpoints\[1\]: must start with http:// or https://"):
        ClientConfig(endpoints=("http://x", "x:80"))
    with pytest.raises(ValueError, match="max_concurrency: must be >= 1"):
        ClientConfig(endpoints=("http://x",), max_concurrency=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert ClientConfig(endpoints="http://x/").endpoints == ("http://x",)
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="top_logprobs"):
            SamplingParams(top_logprobs=bad)


def test_cancellation_releases_everything(serve, tok):
    script = ServerScript(policy=hashed_action_policy(tok), delay_s=2.0)
    srv = serve(script)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,), max_concurrency=2)) as c:
            t = asyncio.create_task(c.generate([1, 2], PARAMS, route_key="k"))
            await asyncio.sleep(0.1)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert c._outstanding[srv.url] == 0 and c._sem._value == 2
            return {x for x in asyncio.all_tasks() if x is not asyncio.current_task()}

    assert run(go()) == set()


def test_retry_fails_over_to_another_endpoint(serve, tok):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    script = ServerScript(policy=fixed_text_policy(tok, "ok"))
    live = serve(script)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(dead, live.url), backoff_base_s=0.001)) as c:
            gens = [await c.generate([1], PARAMS, route_key="tree") for _ in range(3)]
            return gens, c._sticky["tree"]

    gens, pinned = run(go())
    assert pinned == live.url and [g.endpoint for g in gens] == [live.url] * 3
    assert gens[0].attempts == 2 and gens[1].attempts == 1 and script.requests == 3


# ---------------------------------------------------------------------- the transport, on raw servers

ANSWER = (b'{"text": "ok", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}, '
          b'"output_token_logprobs": [[-0.5, 5, null]]}}')


def _ok(writer) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(ANSWER), ANSWER))


@contextlib.asynccontextmanager
async def raw_server(handler):
    """An HTTP/1.1 server on 127.0.0.1 written on asyncio streams, on the test's loop.
    ``await handler(head, body, writer, n) -> keep`` answers the ``n``-th request of a connection
    (``keep`` False: close it). Yields ``(url, writers)``, one writer per accepted connection."""
    writers, tasks = [], set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        writers.append(writer)
        tasks.add(asyncio.current_task())
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length) if length else b""
                keep = await handler(head, body, writer, n)
                await writer.drain()
                n += 1
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client went away, or the test is over
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", writers
    finally:
        server.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


def _client(url, **cfg):
    return GenerationClient(ClientConfig(endpoints=(url,), dialect="sglang", backoff_base_s=0.001, **cfg))


def test_keep_alive_reuses_connections_up_to_the_limit_and_sends_the_headers():
    seen = []

    async def handler(head, body, writer, n):
        seen.append((head, body))
        await asyncio.sleep(0.02)
        _ok(writer)
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            async with _client(url, max_concurrency=3, api_key="k") as c:
                gens = await asyncio.gather(*[c.generate([i + 1], PARAMS) for i in range(12)])
                await c.check_health()
            return gens, len(conns)

    gens, n_conns = run(go())
    assert [g.response.output_tokens.tolist() for g in gens] == [[5]] * 12 and n_conns == 3
    head, body = seen[0]
    assert head.startswith(b"POST /generate HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in head
    assert b"Content-Type: application/json\r\n" in head and b'"input_ids":[' in body
    assert seen[-1][0].startswith(b"GET /health HTTP/1.1\r\n") and seen[-1][1] == b""


def test_a_connection_dropped_as_it_is_reused_is_sent_once_more_a_cut_answer_is_an_error():
    async def handler(head, body, writer, n):
        if b'"input_ids":[9]' in body:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nonly a part")
            return False
        _ok(writer)
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            async with _client(url, max_retries=0) as c:
                first = await c.generate([1], PARAMS)
                conns[0].transport.abort()  # the server drops the idle connection ...
                await asyncio.sleep(0.05)
                later = await c.generate([1], PARAMS)  # ... the client saw it: a new connection
                conns[1].transport.abort()  # dropped just as it is reused (the client has not seen it yet):
                racing = await c.generate([1], PARAMS)  # sent once more, on a fresh connection, no retry
                with pytest.raises(GenerationError, match="after 1 attempts: ClientPayloadError"):
                    await c.generate([9], PARAMS)  # a cut answer is not resent (max_retries=0)
                return [first, later, racing], c.stats(), len(conns)

    gens, stats, n_conns = run(go())
    assert [g.attempts for g in gens] == [1, 1, 1] and stats["retries"] == 0 and n_conns == 3


def test_a_late_body_times_out_garbage_is_retried_and_a_closed_client_refuses():
    async def handler(head, body, writer, n):
        if b'"input_ids":[7]' in body:  # the head at once, the body too late
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 200\r\n\r\n{")
            await writer.drain()
            await asyncio.sleep(1.0)
            return False
        if b'"input_ids":[8]' in body:
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            return False
        _ok(writer)
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            c = _client(url, timeout_s=0.2, max_retries=1)
            with pytest.raises(GenerationError, match=r"after 2 attempts: ReadTimeout: no complete answer within 0.2"):
                await c.generate([7], PARAMS)
            with pytest.raises(GenerationError, match="2 attempts: ClientResponseError: 400.*Bad status line") as e:
                await c.generate([8], PARAMS)
            assert "\n" not in str(e.value)
            ok = await c.generate([1], PARAMS)
            await c.aclose()
            assert c.is_closed
            with pytest.raises(GenerationError, match="the generation client is closed"):
                await c.generate([1], PARAMS)
            return ok, c.stats(), len(conns)

    ok, stats, n_conns = run(go())
    assert ok.attempts == 1 and stats["requests"] == 5 and stats["failures"] == 2 and n_conns == 5


def test_cancellation_closes_only_the_cancelled_connection():
    async def handler(head, body, writer, n):
        await asyncio.sleep(0.3 if b'"input_ids":[1]' in body else 0.0)
        _ok(writer)
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            async with _client(url, max_concurrency=4) as c:
                doomed = asyncio.create_task(c.generate([1], PARAMS))
                sibling = asyncio.create_task(c.generate([1], PARAMS))
                await asyncio.sleep(0.1)
                doomed.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await doomed
                kept = await sibling  # the other request on the shared session is untouched
                after = [await c.generate([2], PARAMS) for _ in range(2)]  # on the sibling's connection
                assert c._outstanding[url] == 0 and c._sem._value == 4 and not c.is_closed
                left = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
                for _ in range(100):  # the server sees the cancelled request's connection close
                    if any(w.transport.is_closing() for w in conns):
                        break
                    await asyncio.sleep(0.02)
                n_closed = sum(w.transport.is_closing() for w in conns)
            return kept, after, len(conns), n_closed, left

    kept, after, n_conns, n_closed, left = run(go())
    assert kept.attempts == 1 and [g.attempts for g in after] == [1, 1]
    assert n_conns == 2 and n_closed == 1  # the cancelled request's connection was closed, not reused
    assert all("raw_server" in repr(t) or "serve" in repr(t) for t in left)


def test_one_session_per_event_loop(serve, tok):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "ok")))
    c = GenerationClient(ClientConfig(endpoints=(srv.url,)))  # built outside any loop
    with warnings.catch_warnings():  # the idle connections of an ended loop are closed by the GC
        warnings.simplefilter("ignore", ResourceWarning)
        first = run(c.generate([1], PARAMS))
        second = run(c.generate([2], PARAMS))  # a new loop: a new session (the ended loop's is closed)
        assert first.text == second.text == "ok" and len(c._sessions) == 1
        run(c.aclose())
        assert c.is_closed and not c._sessions
        gc.collect()


def test_probe_tells_a_server_that_does_not_answer_from_one_that_refuses_token_ids(serve, tok):
    slow = serve(ServerScript(policy=fixed_text_policy(tok, "ok"), delay_s=1.0))
    refusing = serve(ServerScript(policy=fixed_text_policy(tok, "ok"), text_only=True))

    async def probe(url):
        async with GenerationClient(ClientConfig(endpoints=(url,), timeout_s=0.1)) as c:
            await c.probe_token_io([1, 2])

    with pytest.raises(GenerationError, match="did not answer a one-token token-id request: .*ReadTimeout") as info:
        run(probe(slow.url))
    assert "does not accept" not in str(info.value)
    with pytest.raises(GenerationError, match="does not accept token-in/token-out requests"):
        run(probe(refusing.url))


# ---------------------------------------------------------------------------- top logprobs, entropy


def _entropy64(lps):
    lps = np.asarray(lps, dtype=np.float64)
    p = np.exp(lps) / np.exp(lps).sum()
    return float(-(p * np.log(p)).sum())


def _tops_by_position(prompt, out, n):
    """Token i's alternatives: n log-probs whose spread shrinks with i (rising entropy)."""
    return [[-(j * 3.0 / (1 + i)) - 0.1 * j * j for j in range(n)] for i in range(len(out))]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("n", [1, 5, 20])
def test_entropies_of_the_top_n_alternatives(serve, tok, dialect, n):
    script = ServerScript(policy=fixed_text_policy(tok, "```Left``` and more"), top_logprobs=_tops_by_position)
    srv = serve(script)
    prompt = tok.encode("entropy please")
    gen, _ = run(_one(srv.url, dialect, prompt, SamplingParams(max_tokens=32, seed=7, top_logprobs=n)))
    out = list(gen.response.output_tokens)
    want = [_entropy64(row) for row in _tops_by_position(prompt, out, n)]
    assert gen.entropies is not None and len(gen.entropies) == len(out) > 3
    np.testing.assert_allclose(gen.entropies, want, rtol=1e-12, atol=1e-12)
    if n > 1:
        assert all(a < b for a, b in zip(gen.entropies, gen.entropies[1:]))  # the script's rising spread
    else:
        assert gen.entropies == [0.0] * len(out)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_entropies_absent_unless_requested(serve, tok, dialect):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "```Up```"), top_logprobs=_tops_by_position))
    gen, _ = run(_one(srv.url, dialect, [3, 4, 5]))
    assert gen.entropies is None


def test_payload_asks_for_top_logprobs_in_both_dialects():
    from rollout.dialects import request_body

    p = SamplingParams(top_logprobs=7)
    assert request_body("vllm", None, [1], p)[1]["logprobs"] == 7
    assert request_body("vllm", None, [1], SamplingParams())[1]["logprobs"] == 1
    path, body = request_body("sglang", None, [1], p)
    assert path == "/generate" and body["top_logprobs_num"] == 7 and body["return_logprob"] is True
    assert "top_logprobs_num" not in request_body("sglang", None, [1], SamplingParams())[1]


def test_entropy_parsing_of_real_server_shapes():
    """vLLM's dicts (with None entries and -inf alternatives) and SGLang's triples (None rows)."""
    from rollout.dialects import parse_sglang, parse_vllm

    tops = [{"token_id:1": -0.1, "token_id:7": -2.5, "token_id:9": float("-inf")}, None]
    data = {"choices": [{"text": "x", "token_ids": [1, 2], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.1, -0.3], "tokens": ["token_id:1", "token_id:2"],
                                      "top_logprobs": tops}}]}
    got = parse_vllm(data, require_tokens=True, top_n=3)[6]
    h = top_entropies(got)
    assert h[0] == pytest.approx(_entropy64([-0.1, -2.5]), abs=1e-12) and np.isnan(h[1])
    assert parse_vllm(data, require_tokens=True)[6] is None  # not asked for: not parsed
    sdata = {"text": "x", "output_ids": [1, 2], "meta_info": {
        "finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.1, 1, None], [-0.3, 2, None]],
        "output_top_logprobs": [[[-0.1, 1, None], [-1.0, 4, None]], None]}}
    h = top_entropies(parse_sglang(sdata, require_tokens=True, top_n=2)[6])
    assert h[0] == pytest.approx(_entropy64([-0.1, -1.0]), abs=1e-12) and np.isnan(h[1])
