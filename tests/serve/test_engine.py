"""The continuous-batching engine (tiny model, no HTTP): same tokens as the static sampler under any
arrival order, with or without the prefix cache, after preemption; joins mid-batch; cancellation;
pause / update / flush / continue under load; the KV budget; no steady-state recompiles; bf16.

The engine is the one behind the session's test server (its programs compile once for the folder).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprm.serve import Engine, ServerHandle
from jaxprm.serve.engine import _window_buckets
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.sampling import SamplingParams
from jaxprm.serve.static_sampler import StaticSampler

TEXTS = [
    "You are walking on a frozen lake. The goal is to reach the gift without falling into a hole.",
    "Up",
    "Down and left and right and up again, please.",
    "Current observation: P _ _ _ / _ O _ O / _ _ _ O / O _ _ G. Which action? Answer in a fence.",
]


@pytest.fixture(scope="module")
def engine(server):
    return server.app.state.server.engine


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    return [tok.encode(t) for t in TEXTS]


def run(engine, prompts, params, **kw):
    return engine.submit(prompts, params, **kw).result(timeout=120)


def assert_same(got, want, atol=1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=atol)
        np.testing.assert_allclose(g.sampling_logprobs, w.sampling_logprobs, atol=atol)
        assert g.finish_reason == w.finish_reason


def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not engine.scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # let the worker finish its iteration
    assert engine.scheduler.idle


MIXED = [SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
         SamplingParams(max_new_tokens=20, temperature=1.0, seed=1),
         SamplingParams(max_new_tokens=24, temperature=0.8, seed=2, ignore_eos=True),
         SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)]


def test_matches_the_static_sampler_under_any_arrival_order(engine, prompts):
    """Rows decided by prompt, seed and weights only: all at once, in reverse, or each joining the
    running batch after the previous one has started decoding."""
    want = StaticSampler(engine.sampler).generate(prompts, MIXED)
    assert_same(run(engine, prompts, MIXED), want)
    futures, gates, calls_before = [], [], engine.stats.batches
    for p, sp in reversed(list(zip(prompts, MIXED))):
        started, gate = threading.Event(), threading.Event()

        def on_delta(d, e=started, g=gate):  # hold the engine after this request's first decode call
            e.set()
            g.wait(30)

        futures.append(engine.submit([p], [sp], on_delta=on_delta))
        if gates:
            gates[-1].set()  # the previous request goes on only once this one is queued: it joins mid-batch
        assert started.wait(60)
        gates.append(gate)
    gates[-1].set()
    staggered = [f.result(timeout=120)[0] for f in reversed(futures)]
    assert_same(staggered, want)
    calls = list(engine.stats.recent_batch_rows)[-(engine.stats.batches - calls_before):]
    assert max(calls) >= 2  # a later request decoded together with an earlier one
    assert all(c.output_token_versions == [engine.sampler.weight_version] * len(c.token_ids) for c in staggered)


def test_prefix_cache_is_transparent_and_counts_cached_tokens(engine, prompts):
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    first = run(engine, [prompts[0]], [sp])[0]
    follow_up = prompts[0] + first.token_ids + prompts[1]  # the next turn of a conversation
    on = run(engine, [follow_up], [sp])[0]
    assert on.cached_tokens == 16 * ((len(prompts[0]) + len(first.token_ids) - 1) // 16) > 0
    engine.set_prefix_caching(False).result(30)
    try:
        off = run(engine, [follow_up], [sp])[0]
    finally:
        engine.set_prefix_caching(True).result(30)
    assert off.cached_tokens == 0
    assert_same([on], [off])
    # n copies of a new prompt: prefilled once, the copies wait for its blocks
    fresh = prompts[3] + prompts[2]
    before = engine.stats.prefill_tokens
    copies = run(engine, [fresh] * 4, [sp] * 4, choice_index=[0, 1, 2, 3])
    assert engine.stats.prefill_tokens - before < 2 * len(fresh)
    assert [c.cached_tokens for c in copies][1:] == [16 * ((len(fresh) - 1) // 16)] * 3
    assert len({tuple(c.token_ids) for c in copies}) > 1  # choice indices give distinct streams


def test_cancelling_frees_the_blocks(engine, prompts):
    got, gate = threading.Event(), threading.Event()

    def on_delta(d):  # hold the engine until the test has cancelled
        got.set()
        gate.wait(10)

    fut = engine.submit([prompts[0]], [SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)],
                        on_delta=on_delta)
    assert got.wait(60)
    assert fut.cancel()
    gate.set()
    wait_idle(engine)
    assert engine.pool.num_referenced == 0
    engine.pool.check_invariants()
    with pytest.raises(concurrent.futures.CancelledError):
        fut.result()


def test_pause_update_flush_continue_under_load(engine, prompts, tiny):
    model, _ = tiny
    sampler = engine.sampler
    rows = [prompts[i % 4] + [i + 3] for i in range(8)]
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    delivered = []
    first, gate = threading.Event(), threading.Event()

    def on_delta(d):  # called on the engine's thread: it holds the engine until the pause is posted
        delivered.append(len(d.token_ids))
        first.set()
        gate.wait(10)

    v0 = sampler.weight_version
    fut = engine.submit(rows, params, on_delta=on_delta)
    assert first.wait(60)
    paused = engine.pause("in_place")
    gate.set()
    paused.result(30)
    frozen = sum(delivered)
    time.sleep(0.3)
    assert sum(delivered) == frozen and not fut.done()  # nothing runs while paused
    rng = np.random.default_rng(0)
    noisy = jax.tree.map(lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(np.float32),
                         sampler.params)
    v1 = sampler.update_params(noisy)
    engine.flush_cache().result(30)
    engine.resume().result(30)
    try:
        results = fut.result(120)
    finally:
        sampler.update_params(model)
    assert [len(c.token_ids) for c in results] == [24] * 8  # nothing lost, nothing duplicated
    assert sum(delivered) == 8 * 24
    for c in results:
        assert c.output_token_versions == sorted(c.output_token_versions)
        assert set(c.output_token_versions) <= {v0, v1} and c.output_token_versions[-1] == v1
    assert any(c.output_token_versions[0] == v0 for c in results)


def test_pause_abort_returns_partial_outputs_and_later_requests_wait(engine, prompts):
    got, gate = threading.Event(), threading.Event()

    def on_delta(d):
        got.set()
        gate.wait(10)

    sp = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
    fut = engine.submit(prompts[:2], [sp, sp], on_delta=on_delta)
    assert got.wait(60)
    paused = engine.pause("abort")
    gate.set()
    assert paused.result(30) == 2
    aborted = fut.result(30)
    assert [c.finish_reason for c in aborted] == ["abort", "abort"]
    assert all(0 < len(c.token_ids) < 32 for c in aborted)
    queued = engine.submit([prompts[1]], [SamplingParams(max_new_tokens=4, temperature=0)])
    time.sleep(0.3)
    assert not queued.done()
    engine.resume().result(30)
    assert len(queued.result(60)[0].token_ids) >= 1
    wait_idle(engine)
    assert engine.pool.num_referenced == 0


def test_kv_budget_waits_preempts_and_rejects(engine, prompts):
    """A pool of 5 blocks: a request that can never fit is refused; four that fit one or two at a
    time all finish (waiting, preempted and recomputed) with the unconstrained results."""
    small = Engine(engine.sampler, max_batch=4, kv_cache_tokens=80).start()
    try:
        with pytest.raises(ValueError, match="KV blocks"):
            small.submit([[5] * 70], [SamplingParams(max_new_tokens=16)])
        rows = [p[:20] for p in (prompts[0], prompts[3], prompts[0][5:], prompts[3][3:])]
        params = [SamplingParams(max_new_tokens=24, temperature=t, seed=i, ignore_eos=True)
                  for i, t in enumerate((0.0, 1.0, 1.0, 0.0))]
        got = run(small, rows, params)
        assert_same(got, run(engine, rows, params))
        assert small.stats.preemptions >= 1
        wait_idle(small)
        assert small.pool.num_referenced == 0
        small.pool.check_invariants()
    finally:
        small.stop()


def test_a_request_that_can_never_fit_the_kv_pool_gets_a_400_over_http(engine, tiny):
    """A server whose KV pool holds 64 tokens refuses a 70-token prompt with a clear 400 (the
    OpenAI error shape) before anything runs, and stays healthy."""
    _, tok = tiny
    with ServerHandle.from_sampler(engine.sampler, tok, model_name="tiny", kv_cache_tokens=64) as small:
        with httpx.Client(base_url=small.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": [5] * 70, "max_tokens": 8})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "KV blocks" in err["message"] and "kv_cache_bytes" in err["message"] and err["code"] == 400
            assert http.get("/health").status_code == 200
        assert small.engine.pool.num_referenced == 0


def test_steady_state_never_recompiles(engine, prompts):
    def workload():
        sp = [SamplingParams(max_new_tokens=8 + 4 * i, temperature=0.7 * (i % 2), seed=i) for i in range(4)]
        futs = [engine.submit([p], [s]) for p, s in zip(prompts, sp)]
        futs.append(engine.submit(prompts, sp))
        for f in futs:
            f.result(120)

    workload()  # cold
    workload()  # the prompts are cached now: the steady state
    n = engine.num_compilations
    workload()
    assert engine.num_compilations == n


def test_bf16_weights_keep_float32_logprobs(tiny, sampler_kw, prompts, engine):
    model, tok = tiny
    s16 = Sampler(model, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id, dtype="bfloat16",
                  **sampler_kw)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(s16.params))
    eng = Engine(s16, max_batch=4).start()
    try:
        assert eng.runner.pool.k.dtype == jnp.bfloat16
        sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, top_logprobs=2)
        got = run(eng, prompts[:1], [sp])[0]
    finally:
        eng.stop()
    want = run(engine, prompts[:1], [sp])[0]
    assert isinstance(got.logprobs[0], float) and got.token_ids[0] == want.token_ids[0]
    assert abs(got.logprobs[0] - want.logprobs[0]) < 0.05


def test_coarser_window_buckets_give_the_same_tokens(engine, prompts):
    """``window_factor=4`` (the trainer's embedded default) keeps every other window bucket of the
    default x2 ladder and the last one; the tokens and log-probs do not depend on the padding."""
    coarse = Engine(engine.sampler, max_batch=4, window_factor=4).start()
    try:
        assert coarse.window_buckets[-1] == engine.window_buckets[-1]
        assert _window_buckets(1024, 16, 4) == (128, 512, 1024)
        assert _window_buckets(1024, 16) == (128, 256, 512, 1024)
        assert _window_buckets(1024, 16, 1.5) == (128, 192, 288, 432, 656, 1024)  # 992 is within 10%
        assert _window_buckets(2000, 16, 2) == (128, 256, 512, 1024, 2000)
        params = [SamplingParams(max_new_tokens=12, temperature=t, seed=i, ignore_eos=True)
                  for i, t in enumerate((0.0, 1.0, 0.7, 0.0))]
        assert_same(run(coarse, prompts, params), run(engine, prompts, params))
    finally:
        coarse.stop()
    assert engine.window_factor == 2.0  # auto for the tiny model; 1.5 from SMALL_MODEL_PARAMS up
    fine = Engine(engine.sampler, max_batch=4, window_factor=1.5).start()
    try:
        assert fine.window_buckets == _window_buckets(fine.max_len, 16, 1.5)
        assert_same(run(fine, prompts, params), run(engine, prompts, params))
    finally:
        fine.stop()
    with pytest.raises(ValueError, match="window_factor"):
        Engine(engine.sampler, max_batch=4, window_factor=1.2)


def test_shared_prefix_attention_gives_the_same_tokens(engine, prompts):
    """Rows that share a 64-token prompt prefix (4 cached blocks) decode with the shared blocks
    gathered once for the batch (``shared_prefix_attention``, off by default for the tiny model):
    the same tokens and log-probs as the full tables, greedy and seeded; a lone row, and rows
    with nothing in common, take the full-table programs; two groups with their own prefixes
    decode with both gathered once (cascade)."""
    assert not engine.shared_prefix_attention
    common = (prompts[0] + prompts[3]) * 3
    common = common[:64]
    rows = [common + p for p in prompts]
    params = [SamplingParams(max_new_tokens=20, temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate((0.0, 1.0, 0.7, 0.0))]
    shared = Engine(engine.sampler, max_batch=4, shared_prefix_attention=True).start()
    try:
        assert shared.own_window_buckets[:3] == (32, 64, 128)
        run(shared, [rows[0]], params[:1])  # caches the common blocks
        calls = shared.stats.shared_prefix_calls
        assert_same(run(shared, rows, params), run(engine, rows, params))
        assert shared.stats.shared_prefix_calls > calls
        calls = shared.stats.shared_prefix_calls
        assert_same(run(shared, prompts, params), run(engine, prompts, params))
        assert shared.stats.shared_prefix_calls == calls  # no common blocks: full tables
        # cascade: two groups of two rows, each group with its own 64-token prefix
        other = ((prompts[1] + prompts[2]) * 4)[:64]
        groups = [common + prompts[0], common + prompts[1], other + prompts[2], other + prompts[3]]
        run(shared, [groups[2]], params[:1])
        plan = shared._shared_groups
        seen = []
        shared._shared_groups = lambda rows: seen.append(plan(rows)) or seen[-1]
        assert_same(run(shared, groups, params), run(engine, groups, params))
        assert any(sorted((len(m), blocks) for m, blocks in plan) == [(2, 4), (2, 4)] for plan in seen)
    finally:
        shared.stop()


def test_prefill_buckets_by_factor_give_the_same_tokens(engine, prompts):
    """Prefill rows are bucketed 1, 4, 16, ... and chunks 16, 64, ... for the tiny model, and 1, 2,
    4, ... / 16, 32, 64, ... with ``prefill_bucket_factor=2`` (the auto choice from
    SMALL_MODEL_PARAMS up): a burst of 6 rows pads to 16 or to 8 rows, and a long prompt is cut
    into bucket-sized chunks; the tokens do not change."""
    assert engine.prefill_row_buckets[:3] == (1, 4, 16) and engine.scheduler.chunk_buckets[:2] == (16, 64)
    fine = Engine(engine.sampler, max_batch=8, prefill_bucket_factor=2).start()
    try:
        assert fine.prefill_row_buckets[:4] == (1, 2, 4, 8)
        assert fine.scheduler.chunk_buckets[:4] == (16, 32, 64, 128)
        burst = (prompts * 2)[:5] + [prompts[0] * 4]  # the last one prefills in several chunks
        params = [SamplingParams(max_new_tokens=6, temperature=t, seed=i, ignore_eos=True)
                  for i, t in enumerate((0.0, 1.0, 0.7, 0.0, 1.0, 0.0))]
        calls = fine.stats.prefill_calls
        assert_same(run(fine, burst, params), run(engine, burst, params))
        assert fine.stats.prefill_calls > calls
    finally:
        fine.stop()
    with pytest.raises(ValueError, match="prefill_bucket_factor"):
        Engine(engine.sampler, max_batch=4, prefill_bucket_factor=1)
