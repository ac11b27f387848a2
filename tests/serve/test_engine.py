"""BatchingEngine: gathering, ordering, cancellation, failure isolation, shutdown."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from jaxprm.serve.sampler import Sampler, SamplingParams
from jaxprm.serve import BatchingEngine


@pytest.fixture(scope="module")
def sampler(tiny, sampler_kw):
    model, tok = tiny
    return Sampler(model, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id, **sampler_kw)


def test_requests_are_gathered_and_resolved_in_order(sampler, tiny):
    _, tok = tiny
    engine = BatchingEngine(sampler, max_batch=16, collect_window_s=0.2, max_collect_s=1.0).start()
    try:
        sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        prompts = [tok.encode(t) for t in ("Up", "Down", "Left", "Right")]
        futs = [engine.submit([p, p], [sp, sp]) for p in prompts]  # 4 requests x 2 rows
        results = [f.result(timeout=120) for f in futs]
        direct = sampler.generate(prompts, sp)
        for res, d, p in zip(results, direct, prompts):
            assert len(res) == 2 and all(c.prompt_ids == p and c.token_ids == d.token_ids for c in res)
        assert engine.stats.max_rows_in_batch == 8 and engine.stats.batches == 1
    finally:
        engine.stop()


def test_cancelled_requests_are_skipped_and_bad_ones_fail_alone(sampler):
    engine = BatchingEngine(sampler, max_batch=16, collect_window_s=0.2, max_collect_s=1.0)
    engine.start()
    try:
        sp = SamplingParams(max_new_tokens=2, temperature=0.0)
        gate = threading.Event()
        original = sampler.generate

        def slow_generate(*a, **k):  # hold the worker on the first batch so that the rest queue up
            gate.wait(10)
            return original(*a, **k)

        sampler.generate = slow_generate
        # all four land in one collection window; the batch with the bad row fails and is retried
        # request by request, so only the bad request fails
        first = engine.submit([[1, 2]], [sp])
        cancelled = engine.submit([[3, 4]], [sp])
        bad = engine.submit([[1, 10**6]], [sp])  # out of vocabulary: the sampler raises
        good = engine.submit([[5, 6]], [sp])
        assert cancelled.cancel()
        gate.set()
        assert len(first.result(timeout=120)) == 1
        with pytest.raises(ValueError, match="outside"):
            bad.result(timeout=120)
        assert len(good.result(timeout=120)) == 1
        assert cancelled.cancelled()
    finally:
        sampler.__dict__.pop("generate", None)
        engine.stop()
    assert not engine.running
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit([[1]], [sp])


def test_stop_fails_queued_requests(sampler):
    engine = BatchingEngine(sampler)
    engine.start()
    gate = threading.Event()
    original = sampler.generate
    sampler.generate = lambda *a, **k: (gate.wait(10), original(*a, **k))[1]
    try:
        sp = SamplingParams(max_new_tokens=1)
        running = engine.submit([[1]], [sp])
        queued = [engine.submit([[2]], [sp]) for _ in range(3)]
        stopper = threading.Thread(target=engine.stop)
        stopper.start()
        gate.set()
        stopper.join(60)
        assert len(running.result(timeout=60)) == 1
        for f in queued:
            try:
                f.result(timeout=60)
            except RuntimeError as exc:  # either it ran before the stop or it failed cleanly
                assert "stopped" in str(exc)
            except concurrent.futures.CancelledError:
                pass
    finally:
        sampler.__dict__.pop("generate", None)
