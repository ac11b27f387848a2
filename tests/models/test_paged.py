"""The transformer over a paged KV pool equals the plain forward (chunked prefill, decode steps,
shuffled block tables, rows sharing prefix blocks), with the layers scanned or unrolled over
per-layer weight copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprm.models import Transformer, tiny_config
from jaxprm.models.paged import PagedKVCache, kv_bytes_per_token, paged_hidden_states, unstack_layers

BS = 4


def _model():
    return Transformer(tiny_config(vocab_size=97), rngs=nnx.Rngs(0))


@jax.jit
def _plain_logits(model, tokens, positions):
    return model(tokens, positions)[0]


@jax.jit(static_argnames="unroll")
def _paged_logits(model, tokens, positions, cache, tables, unroll=False):
    layers = unstack_layers(model) if unroll else None
    hidden, cache = paged_hidden_states(model, tokens, positions, cache, tables, layers=layers)
    return model.logits(hidden), cache


@pytest.mark.parametrize("unroll", [False, True])
def test_chunked_prefill_and_decode_over_shuffled_blocks_match_the_plain_forward(unroll):
    model = _model()
    rng = np.random.default_rng(0)
    B, T = 2, 23
    tokens = rng.integers(0, 97, (B, T))
    positions = np.broadcast_to(np.arange(T), (B, T))
    want = np.asarray(_plain_logits(model, jnp.asarray(tokens), jnp.asarray(positions)))
    cache = PagedKVCache.init(model.config, 20, BS)
    tables = rng.permutation(np.arange(1, 20))[:16].reshape(B, 8)  # 32 positions per row, any blocks
    got = []
    for lo, hi in ((0, 8), (8, 16)) + tuple((t, t + 1) for t in range(16, T)):  # two chunks, then decode
        pos = positions[:, lo:hi].copy()
        logits, cache = _paged_logits(model, jnp.asarray(tokens[:, lo:hi]), jnp.asarray(pos), cache,
                                      jnp.asarray(tables), unroll=unroll)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, atol=2e-5, rtol=1e-5)


def test_padding_is_not_written_and_shared_prefix_blocks_are_only_read():
    model = _model()
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 97, 8)  # two full blocks, computed once by row 0
    tails = rng.integers(0, 97, (2, 5))  # row 1's own continuation after the shared prefix
    cache = PagedKVCache.init(model.config, 12, BS)
    tables = np.array([[1, 2, 3, 4], [1, 2, 5, 6]])  # row 1 shares row 0's prefix blocks
    first = np.stack([prefix, prefix])
    pos = np.stack([np.arange(8), np.full(8, -1)])  # row 1 is padding in this call: writes nothing
    _, cache = _paged_logits(model, jnp.asarray(first), jnp.asarray(pos), cache, jnp.asarray(tables))
    assert not np.asarray(cache.k[:, 5:7]).any()  # row 1's own blocks untouched
    second = np.zeros((2, 8), np.int64)
    second[1, :5] = tails[1]
    pos1 = np.full((2, 8), -1)
    pos1[1, :5] = np.arange(8, 13)
    logits, _ = _paged_logits(model, jnp.asarray(second), jnp.asarray(pos1), cache, jnp.asarray(tables))
    logits = np.asarray(logits)[:, :5]
    seq = np.concatenate([prefix, tails[1]])[None]
    want = np.asarray(_plain_logits(model, jnp.asarray(seq), jnp.asarray(np.arange(13)[None])))[0, 8:]
    np.testing.assert_allclose(np.asarray(logits)[1], want, atol=2e-5, rtol=1e-5)


@jax.jit(static_argnames="unroll")
def _shared_logits(model, tokens, positions, cache, tables, shared_table, shared_len, unroll=False):
    layers = unstack_layers(model) if unroll else None
    hidden, cache = paged_hidden_states(model, tokens, positions, cache, tables, layers=layers,
                                        shared_table=shared_table, shared_len=shared_len)
    return model.logits(hidden), cache


@pytest.mark.parametrize("unroll", [False, True])
def test_decode_over_a_shared_prefix_gathered_once_matches_the_full_tables(unroll):
    """Three rows share 3 prefix blocks (12 positions); decoding with ``shared_table`` (padded to 4
    entries, ``shared_len`` 12) and tables of the positions after it gives the full tables' logits
    and writes the same pool; padding rows (position -1) write nothing."""
    model = _model()
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 97, 12)
    cache = PagedKVCache.init(model.config, 16, BS)
    _, cache = _paged_logits(model, jnp.asarray(prefix[None]), jnp.asarray(np.arange(12)[None]), cache,
                             jnp.asarray([[1, 2, 3, 0]]))
    own = np.array([[4, 5, 0], [6, 7, 0], [8, 9, 0], [0, 0, 0]])  # rows' blocks after the prefix
    full = np.concatenate([np.tile([1, 2, 3], (4, 1)), own], axis=1)
    tails = rng.integers(0, 97, (4, 3))
    ref_cache, shared_cache = cache, cache
    for t in range(3):  # row 0 prefills 12..14 one token at a time, the others only two tokens
        pos = np.array([12 + t, 12 + t, 12 + t if t < 2 else -1, -1])[:, None]
        tok = jnp.asarray(tails[:, t:t + 1])
        want, ref_cache = _paged_logits(model, tok, jnp.asarray(pos), ref_cache, jnp.asarray(full), unroll=unroll)
        got, shared_cache = _shared_logits(model, tok, jnp.asarray(pos), shared_cache, jnp.asarray(own),
                                           jnp.asarray([1, 2, 3, 0]), jnp.int32(12), unroll=unroll)
        np.testing.assert_allclose(np.asarray(got)[:3 if t < 2 else 2], np.asarray(want)[:3 if t < 2 else 2],
                                   atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(shared_cache.k), np.asarray(ref_cache.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(shared_cache.v), np.asarray(ref_cache.v), atol=1e-5)
    seq = np.concatenate([prefix, tails[0]])[None]
    plain = np.asarray(_plain_logits(model, jnp.asarray(seq), jnp.asarray(np.arange(15)[None])))[0, 12:]
    np.testing.assert_allclose(np.asarray(got)[0, 0], plain[2], atol=2e-5, rtol=1e-5)


@jax.jit
def _cascade_logits(model, tokens, positions, cache, tables, shared_table, shared_len, shared_rows):
    hidden, cache = paged_hidden_states(model, tokens, positions, cache, tables, shared_table=shared_table,
                                        shared_len=shared_len, shared_rows=shared_rows)
    return model.logits(hidden), cache


def test_cascade_decode_over_several_group_prefixes_matches_the_full_tables():
    """Two groups of rows (not contiguous in the batch), each sharing its own cached prompt prefix
    (3 and 2 blocks; the table of the shorter padded to 3 entries), a row in no group (full table
    from position 0, crossing into a new block) and a padding row: decoding with the prefixes
    gathered once each (``shared_table [S, ns]``, ``shared_len [S]``, ``shared_rows [S, R]`` with
    an empty slot per group) gives the full tables' logits and writes the same pool."""
    model = _model()
    rng = np.random.default_rng(3)
    p0, p1, lone = rng.integers(0, 97, 12), rng.integers(0, 97, 8), rng.integers(0, 97, 6)
    cache = PagedKVCache.init(model.config, 24, BS)
    prefill = np.zeros((3, 12), np.int64)
    prefill[0], prefill[1, :8], prefill[2, :6] = p0, p1, lone
    pos = np.full((3, 12), -1)
    pos[0], pos[1, :8], pos[2, :6] = np.arange(12), np.arange(8), np.arange(6)
    _, cache = _paged_logits(model, jnp.asarray(prefill), jnp.asarray(pos), cache,
                             jnp.asarray([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 0, 0]]))
    # rows 3, 0: group 0 (blocks 1-3), rows 1-2: group 1 (blocks 4-5), row 4: none, row 5: padding
    members = np.array([[3, 0, -1], [1, 2, -1]])
    own = np.array([[8, 0, 0], [10, 0, 0], [11, 0, 0], [9, 0, 0], [6, 7, 12], [0, 0, 0]])
    full = np.array([[1, 2, 3, 8], [4, 5, 10, 0], [4, 5, 11, 0], [1, 2, 3, 9], [6, 7, 12, 0], [0, 0, 0, 0]])
    start = np.array([12, 8, 8, 12, 6, -1])
    tails = rng.integers(0, 97, (6, 3))
    ref_cache, cascade_cache = cache, cache
    for t in range(3):
        p = np.where(start >= 0, start + t, -1)[:, None]
        tok = jnp.asarray(tails[:, t:t + 1])
        want, ref_cache = _paged_logits(model, tok, jnp.asarray(p), ref_cache, jnp.asarray(full))
        got, cascade_cache = _cascade_logits(model, tok, jnp.asarray(p), cascade_cache, jnp.asarray(own),
                                             jnp.asarray([[1, 2, 3], [4, 5, 0]]), jnp.asarray([12, 8]),
                                             jnp.asarray(members))
        np.testing.assert_allclose(np.asarray(got)[:5], np.asarray(want)[:5], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cascade_cache.k), np.asarray(ref_cache.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cascade_cache.v), np.asarray(ref_cache.v), atol=1e-5)
    seq = np.concatenate([p1, tails[2]])[None]  # row 2's sequence, from its group's prefix on
    plain = np.asarray(_plain_logits(model, jnp.asarray(seq), jnp.asarray(np.arange(11)[None])))[0, 8:]
    np.testing.assert_allclose(np.asarray(got)[2, 0], plain[2], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shared_rows"):
        paged_hidden_states(model, tok, jnp.asarray(p), cache, jnp.asarray(own),
                            shared_table=jnp.asarray([[1, 2, 3], [4, 5, 0]]), shared_len=jnp.asarray([12, 8]))


def test_kv_bytes_per_token():
    c = tiny_config(vocab_size=97)
    assert kv_bytes_per_token(c) == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert kv_bytes_per_token(c, "bfloat16") == kv_bytes_per_token(c) // 2
