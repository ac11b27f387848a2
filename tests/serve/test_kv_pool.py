"""KV block bookkeeping, the radix prefix cache and the scheduler, without a model (pure Python)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprm.serve.kv_pool import BlockPool
from jaxprm.serve.prefix_cache import PrefixCache
from jaxprm.serve.sampling import SamplingParams
from jaxprm.serve.scheduler import Scheduler, Sequence, Status

BS = 4


def make(num_blocks=9, enabled=True):
    pool = BlockPool(num_blocks)
    return pool, PrefixCache(pool, BS, enabled=enabled)


def test_pool_hands_out_free_blocks_before_evicting_cached_ones_lru():
    pool, cache = make(5)  # blocks 1..4
    a = pool.allocate(2)
    cache.insert(list(range(8)), a, ready=True)  # two cached blocks
    for b in reversed(a):  # released tail first: the tail is evicted first
        pool.decref(b)
    assert pool.num_available == 4 and pool.num_evictable == 2 and len(cache) == 2
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(a) and len(cache) == 2  # plain free blocks go first
    third = pool.allocate(1)
    assert third == [a[1]] and len(cache) == 1  # then the least recently released cached block
    assert cache.match(list(range(8)))[0] == [a[0]]
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.check_invariants()


def test_evicting_a_node_drops_its_subtree_but_not_blocks_in_use():
    pool, cache = make(9)
    path = pool.allocate(3)
    toks = list(range(12))
    cache.insert(toks, path, ready=True)
    pool.decref(path[0])  # the root block is unreferenced and will be evicted; its children are in use
    pool.allocate(pool.num_free)  # exhaust the plain free blocks
    pool.allocate(1)  # evicts path[0]: the whole path leaves the cache
    assert len(cache) == 0 and cache.match(toks)[0] == []
    assert pool.refcount(path[1]) == 1 and not pool.is_cached(path[1])
    pool.decref(path[1])
    assert pool.num_free == 1  # uncached now: plain free
    pool.check_invariants()


def test_match_stops_at_blocks_still_being_computed_and_flush_empties():
    pool, cache = make(9)
    blocks = pool.allocate(3)
    toks = list(range(100, 112))
    cache.insert(toks, blocks, ready=False)
    assert cache.match(toks) == ([], True)
    cache.mark_ready(blocks[0])
    assert cache.match(toks + [1, 2]) == ([blocks[0]], True)
    cache.mark_ready(blocks[1])
    cache.drop_unready(blocks)  # the owner leaves before computing block 2
    assert cache.match(toks) == (blocks[:2], False)
    assert cache.flush(version=3) == 2 and cache.version == 3 and cache.match(toks) == ([], False)
    assert cache.queries == 3 * 12 + 14 and cache.hits == 4 + 8
    pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=40))
def test_random_sequences_keep_the_books_consistent(ops):
    """Random admit / release of sequences sharing prefixes never leaks or double-frees a block."""
    pool, cache = make(13)
    live: list[list[int]] = []
    for kind, length, prefix in ops:
        if kind < 3:
            toks = [prefix] * (prefix * BS) + list(range(length * BS))
            matched, _ = cache.match(toks, count=False)
            need = len(toks) // BS - len(matched)
            reclaim = sum(pool.refcount(b) == 0 for b in matched)
            if pool.num_available - reclaim < need:
                continue
            for b in matched:
                pool.incref(b)
            blocks = matched + pool.allocate(need)
            cache.insert(toks, blocks, ready=True)
            live.append(blocks)
        elif live:
            for b in reversed(live.pop(0)):
                pool.decref(b)
        pool.check_invariants()
    for blocks in live:
        for b in reversed(blocks):
            pool.decref(b)
    pool.check_invariants()
    assert pool.num_referenced == 0


def seq(i, prompt, max_new):
    return Sequence(seq_id=i, prompt=list(prompt), params=SamplingParams(max_new_tokens=max_new),
                    key_data=np.zeros(2, np.uint32), stop_ids=frozenset())


def step(sched: Scheduler, token=7):
    """Pretend to run one iteration: prefill what is planned, decode one token for ready rows."""
    plan = sched.schedule()
    if plan is not None:
        for s, _, n in plan.rows:
            sched.prefilled(s, n, version=0)
    for s in sched.decode_rows():
        sched.decoded(s, token, -1.0, -1.0, version=0)


def test_scheduler_waits_for_memory_preempts_and_rejects_what_never_fits():
    pool, cache = make(5)  # 4 blocks of 4 = 16 positions
    sched = Scheduler(pool, cache, max_seqs=4, prefill_chunk=8, max_prefill_tokens=16, chunk_buckets=(4, 8),
                      row_buckets=(1, 2))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(0, range(10), 8))  # 17 positions > 16
    a, b, c = seq(1, range(6), 6), seq(2, range(20, 26), 6), seq(3, range(40, 46), 6)  # 11 positions each
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    assert {s.status for s in (a, b)} == {Status.DECODE} and c.status is Status.WAITING  # c waits for memory
    for _ in range(60):
        if all(s.finished for s in (a, b, c)):
            break
        step(sched)
        pool.check_invariants()
    assert all(s.finished and len(s.output) == 6 for s in (a, b, c))
    assert sched.num_preemptions >= 1  # a and b cannot both grow to 3 blocks
    assert pool.num_referenced == 0


def test_identical_prompts_are_prefilled_once():
    pool, cache = make(17)
    sched = Scheduler(pool, cache, max_seqs=4, prefill_chunk=16, max_prefill_tokens=64, chunk_buckets=(16,))
    rows = [seq(i, range(13), 2) for i in range(3)]
    for s in rows:
        sched.add(s)
    plan = sched.schedule()
    assert [r[0] for r in plan.rows] == [rows[0]]  # the copies wait for the shared blocks
    for s, _, n in plan.rows:
        sched.prefilled(s, n, version=0)
    assert sched.schedule() is None  # the copies find all 12 positions cached: nothing to prefill
    assert [s.status for s in rows] == [Status.DECODE] * 3
    assert rows[0].cached_tokens == 0 and rows[1].cached_tokens == rows[2].cached_tokens == 12
    assert rows[1].blocks[:3] == rows[2].blocks[:3] == rows[0].blocks[:3]


def test_a_long_prompt_is_cut_into_bucket_sized_chunks_rather_than_padded():
    """150 pending tokens with chunk buckets 16..256 (x2): 128 now and 22 (bucket 32) later pad 160
    slots, one chunk 256; 22 stay whole (16 + 16 would pad as many), and so do 9 (no bucket below)."""
    pool, cache = make(64)
    sched = Scheduler(pool, cache, max_seqs=4, prefill_chunk=256, max_prefill_tokens=1024,
                      chunk_buckets=(16, 32, 64, 128, 256), row_buckets=(1, 2, 4, 8), cut_padded_chunks=True)
    long, short = seq(0, range(151), 2), seq(1, range(1000, 1010), 2)  # 150 / 9 positions to prefill
    sched.add(long)
    sched.add(short)
    plan = sched.schedule()
    assert [(s.seq_id, n) for s, _, n in plan.rows] == [(0, 128), (1, 9)] and plan.chunk == 128
    for s, _, n in plan.rows:
        sched.prefilled(s, n, version=0)
    plan = sched.schedule()
    assert [(s.seq_id, start, n) for s, start, n in plan.rows] == [(0, 128, 22)] and plan.chunk == 32
    assert sched._chunk_tokens(100) == 100 and sched._chunk_tokens(140) == 128  # 64 + 64 = 128; 128 + 16 < 256
    sched.cut_padded_chunks = False
    assert sched._chunk_tokens(140) == 140
