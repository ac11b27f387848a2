"""The background warm-up: a server started with ``warmup`` compiles, while it already serves, every
decode and prefill program that requests within its limit can meet, so that requests at any
concurrency afterwards compile nothing."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from jaxprm.serve import ServerHandle
from jaxprm.serve.programs import num_compilations
from jaxprm.serve.warmup import warmup_plan

# a pool size no other test uses: the programs compiled here cannot come from another test
KW = dict(sampler_kwargs=dict(batch_buckets=(1, 4, 8), max_batch=8, prompt_buckets=(32, 128),
                              new_token_buckets=(16, 32)), kv_cache_tokens=2032)


def test_warmup_plan_orders_windows_from_the_shortest_with_decode_first(tiny):
    model, tok = tiny
    with ServerHandle.start(model, tok, **KW) as server:
        engine = server.engine
        plan = warmup_plan(engine)
        windows = [item[-1] for item in plan]
        assert windows == sorted(windows) and set(windows) == set(engine.window_buckets)
        first = [item for item in plan if item[-1] == engine.window_buckets[0]]
        assert [item[0] for item in first] == ["decode"] * len(engine.batch_buckets) + ["prefill"] * (
            len(first) - len(engine.batch_buckets))
        assert {item[1] for item in first if item[0] == "decode"} == set(engine.batch_buckets)
        assert all(r * c <= engine.scheduler.max_prefill_tokens or r == 1 for _, r, c, _ in
                   (item for item in plan if item[0] == "prefill"))
        assert warmup_plan(engine, 100) == first  # the first window holds 100 positions
        with pytest.raises(ValueError, match="max_len"):
            warmup_plan(engine, 0)


def test_requests_after_the_warmup_compile_nothing(tiny):
    """Cascade decode on (the tiny model's default is off): rows that share a >= 64-token prompt
    prefix decode through the one-group cascade programs, which the warm-up prepared too."""
    model, tok = tiny
    common = "The quick brown fox jumps over the lazy dog. " * 3
    assert 64 <= len(tok.encode(common)) <= 96
    with ServerHandle.start(model, tok, warmup=True, warmup_max_len=128, shared_prefix_attention=True,
                            **KW) as server:
        warm = server.app.state.server.warmup
        plan = warmup_plan(server.engine, 128)
        assert warm is not None and warm.total == len(plan)
        assert {item[0] for item in plan} == {"decode", "prefill", "cascade"}
        with httpx.Client(base_url=server.url, timeout=120) as http:
            assert http.get("/health").json()["warmup_programs"][1] == warm.total  # served meanwhile
            assert warm.wait(300) and warm.error is None and warm.done == warm.total
            assert http.get("/health").json()["warmup_programs"] == [warm.total, warm.total]
            before = num_compilations()

            def complete(i: int) -> None:
                prompt = (common if i % 2 else "") + f"request {i} " * (1 + i % 3)
                r = http.post("/v1/completions", json=dict(model="jaxprm", prompt=prompt, max_tokens=16,
                                                           temperature=0, ignore_eos=True))
                assert r.status_code == 200, r.text

            calls = server.engine.stats.shared_prefix_calls
            for c in (1, 3, 8):
                with concurrent.futures.ThreadPoolExecutor(c) as pool:
                    list(pool.map(complete, range(c)))
            assert server.engine.stats.shared_prefix_calls > calls  # the cascade programs ran
            assert num_compilations() == before


def test_warmup_stops_with_the_server(tiny):
    model, tok = tiny
    server = ServerHandle.start(model, tok, warmup=True, **KW)
    warm = server.app.state.server.warmup
    server.stop()
    t0 = time.perf_counter()
    assert warm.wait(120) and warm.done <= warm.total
    assert time.perf_counter() - t0 < 120
