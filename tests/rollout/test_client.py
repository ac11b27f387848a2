"""The generation client against a real scripted HTTP server on 127.0.0.1 (both dialects, faults)."""

import asyncio

import numpy as np
import pytest

from rollout.client import ClientConfig, GenerationClient, GenerationError, SamplingParams, TextOnlyResponseError
from rollout.testing import ServerScript, fixed_text_policy, hashed_action_policy

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


def test_connection_refused_is_retried_then_fails():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(GenerationError, match="ConnectError"):
        run(_one(f"http://127.0.0.1:{port}", "vllm", [1], max_retries=2, backoff_base_s=0.001))


@pytest.mark.parametrize("limit,per_pool", [(3, 8), (6, 2)])
def test_concurrency_limit(serve, tok, limit, per_pool):
    script = ServerScript(policy=fixed_text_policy(tok, "ok"), delay_s=0.05)
    srv = serve(script)

    async def go():
        cfg = ClientConfig(endpoints=(srv.url,), max_concurrency=limit, connections_per_pool=per_pool)
        async with GenerationClient(cfg) as c:
            assert len(c._pools) == -(-limit // per_pool)
            await asyncio.gather(*[c.generate([i + 1], PARAMS) for i in range(4 * limit)])
            assert c._pool_load == [0] * len(c._pools)

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
    from rollout.client import _parse_vllm

    data = {"choices": [{"text": "x", "token_ids": [1], "prompt_token_ids": [9, 9], "finish_reason": "stop",
                         "logprobs": {"token_logprobs": [-0.5], "tokens": ["token_id:1"]}}]}
    assert _parse_vllm(data, require_tokens=True)[5] == [9, 9]
    with pytest.raises(GenerationError, match="finish_reason"):
        _parse_vllm({"choices": [{"text": "x", "finish_reason": "weird"}]}, require_tokens=True)


def test_config_validation():
    with pytest.raises(ValueError, match="dialect"):
        ClientConfig(endpoints=("http://x",), dialect="tgi")
    with pytest.raises(ValueError, match="endpoints"):
        ClientConfig(endpoints=())
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert ClientConfig(endpoints="http://x/").endpoints == ("http://x",)


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
    import socket

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
