"""Paged key/value memory: the transformer over a shared pool of fixed-size KV blocks.

A serving engine keeps the keys and values of many sequences in one preallocated pool of blocks
(``PagedKVCache``: ``k, v [L, NB, K, bs, hd]``, ``NB`` blocks of ``bs`` positions each; heads
before positions, so that attention contracts a row's gathered blocks ``[nb, K, bs, hd]`` where they
lie, without a transposed copy of its window) and gives
each sequence a *block table*: entry ``j`` of a row's table is the pool block holding that row's
positions ``j bs .. (j + 1) bs - 1``. Sequences that start with the same tokens can then point at
the same blocks (a prefix cache), and memory is handed out a block at a time.

``paged_hidden_states(model, tokens, positions, cache, block_tables)`` is
``Transformer.hidden_states`` over such a pool:

* ``tokens, positions`` int32 ``[B, T]``; ``block_tables`` int32 ``[B, nb]``. A row sees the
  window of its first ``W = nb bs`` positions, gathered from the pool through its table.
* In each layer, the key/value of entry ``(b, t)`` is first written at block
  ``block_tables[b, positions[b, t] // bs]``, offset ``positions[b, t] % bs``; then the query at
  position ``p`` attends the window slots ``0..p`` of its row (only those). Entries with a negative
  position are not written and attend nothing (finite garbage output): use ``-1`` for padding.
* Positions must be ``< W``. Table entries past a row's length may point at any block (block 0 is
  the engine's never-allocated "null" block): their slots lie beyond the row's positions and are
  never attended.
* The layers run in one ``lax.scan`` over the stacked weights, or, with ``layers`` (the per-layer
  weights of ``unstack_layers``), unrolled over those separate arrays. On XLA:CPU a scan copies each
  layer's weights out of the stacked arrays before every matmul (a dot does not read a slice in
  place), which reads and writes every weight once more per call; at decode batch sizes that copy
  is a large part of the step (about 40% for SmolLM2-135M at batch 1). Unrolled programs take
  longer to compile (about ``L`` times the layer).

This is the same computation as the contiguous ``KVCache`` path (a row's window equals its cache
row), so both give the same logits up to float rounding. The pool is updated in place when the
caller donates it to the jitted program.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxprm.models.config import ModelConfig
from jaxprm.models.rope import rope_cos_sin
from jaxprm.models.transformer import _MASK_VALUE, _layer, rms_norm

__all__ = ["PagedKVCache", "paged_hidden_states", "paged_attention", "kv_bytes_per_token", "unstack_layers"]


def kv_bytes_per_token(config: ModelConfig, dtype: Any = None) -> int:
    """Bytes of key + value memory one position takes over all layers: ``2 L K hd itemsize``."""
    itemsize = jnp.dtype(config.dtype if dtype is None else dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The block pool: ``k, v [L, NB, K, bs, hd]`` (``NB`` blocks of ``bs`` positions)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: Any = None) -> PagedKVCache:
        """An all-zero pool of ``num_blocks`` blocks of ``block_size`` positions."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        dtype = config.dtype if dtype is None else dtype
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[1])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[3])


def paged_attention(q: jax.Array, key_blocks: jax.Array, value_blocks: jax.Array, mask: jax.Array,
                    shared: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """Grouped-query softmax attention over each row's gathered blocks.

    ``q [B, T, H, hd]``; ``key_blocks, value_blocks [B, nb, K, bs, hd]`` (row ``b``'s window of
    ``W = nb bs`` positions as its table's blocks, ``H = K G``); boolean ``mask [B, T, W]``:
    ``softmax(q k^T / sqrt(hd) masked) v``, scores and softmax in float32 (fully masked rows give a
    finite average). Returns ``[B, T, H, hd]`` in ``q.dtype``. Same as ``transformer.attention``
    over the window; the blocks are contracted where they lie (no transposed copy of the window),
    and the ``T G`` queries of a key/value head form one matrix.

    ``shared = (shared_keys, shared_values [S, ns, K, bs, hd], shared_rows [S, R], shared_slot [B],
    shared_mask [S, R, T, ns bs])`` (cascade attention): the blocks of ``S`` prefixes, each common
    to a group of rows and gathered once for the batch. ``shared_rows[g]`` lists group ``g``'s rows
    (``-1``: an empty slot), ``shared_slot[b]`` is row ``b``'s place ``g R + r`` in it (``-1``: in
    no group). Each group's queries attend its prefix in one matrix product per key/value head
    (the prefix's keys and values read once, not once per row); the two partial softmaxes (prefix,
    own window) are merged exactly by their maxima and sums, ``out = (e^{m1-m} o1 + e^{m2-m} o2) /
    (e^{m1-m} l1 + e^{m2-m} l2)``, so the result is the attention over the concatenation.
    """
    B, T, H, hd = q.shape
    _, nb, K, bs, _ = key_blocks.shape
    G, W = H // K, nb * bs
    qg = q.reshape(B, T, K, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, hd)
    scores = jnp.einsum("bkqd,bnksd->bkqns", qg, key_blocks, preferred_element_type=jnp.float32)
    scores = scores.reshape(B, K, T, G, W) * (hd ** -0.5)
    scores = jnp.where(mask[:, None, :, None, :], scores, _MASK_VALUE)
    if shared is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(value_blocks.dtype)
        out = jnp.einsum("bkqns,bnksd->bkqd", probs.reshape(B, K, T * G, nb, bs), value_blocks)
        return out.reshape(B, K, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, H, hd)

    shared_keys, shared_values, shared_rows, shared_slot, shared_mask = shared
    S, ns = shared_keys.shape[:2]
    R = shared_rows.shape[1]
    # own window: [B, K, T G, nb, bs]
    own_mask = jnp.broadcast_to(mask[:, None, :, None, :], (B, 1, T, G, W)).reshape(B, 1, T * G, nb, bs)
    own_scores = scores.reshape(B, K, T * G, nb, bs)
    m_own = jnp.max(own_scores, axis=(-2, -1))
    p_own = jnp.where(own_mask, jnp.exp(own_scores - m_own[..., None, None]), 0.0)
    l_own = p_own.sum(axis=(-2, -1))
    o_own = jnp.einsum("bkqns,bnksd->bkqd", p_own.astype(value_blocks.dtype), value_blocks,
                       preferred_element_type=jnp.float32)
    # each group's queries against its own prefix: [S, R, K, T G, ns, bs]
    qs = qg[jnp.clip(shared_rows, 0, B - 1)]
    s2 = jnp.einsum("grkqd,gnksd->grkqns", qs, shared_keys, preferred_element_type=jnp.float32) * (hd ** -0.5)
    m2_mask = jnp.broadcast_to(shared_mask[:, :, None, :, None, :], (S, R, 1, T, G, ns * bs)).reshape(
        S, R, 1, T * G, ns, bs)
    s2 = jnp.where(m2_mask, s2, _MASK_VALUE)
    m_sh = jnp.max(s2, axis=(-2, -1))
    p_sh = jnp.where(m2_mask, jnp.exp(s2 - m_sh[..., None, None]), 0.0)
    l_sh = p_sh.sum(axis=(-2, -1))
    o_sh = jnp.einsum("grkqns,gnksd->grkqd", p_sh.astype(shared_values.dtype), shared_values,
                      preferred_element_type=jnp.float32)
    # back to rows (a row in no group: an empty prefix state)
    slot = jnp.clip(shared_slot, 0, S * R - 1)
    grouped = (shared_slot >= 0)[:, None, None]
    m_sh = jnp.where(grouped, m_sh.reshape(S * R, K, T * G)[slot], _MASK_VALUE)
    l_sh = jnp.where(grouped, l_sh.reshape(S * R, K, T * G)[slot], 0.0)
    o_sh = jnp.where(grouped[..., None], o_sh.reshape(S * R, K, T * G, hd)[slot], 0.0)
    top = jnp.maximum(m_sh, m_own)
    a_sh, a_own = jnp.exp(m_sh - top), jnp.exp(m_own - top)
    den = a_sh * l_sh + a_own * l_own
    out = (a_sh[..., None] * o_sh + a_own[..., None] * o_own) / jnp.where(den > 0, den, 1.0)[..., None]
    out = out.astype(q.dtype)
    return out.reshape(B, K, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, H, hd)


def _gather_blocks(pool: jax.Array, rows: jax.Array) -> jax.Array:
    """``pool [L, NB, K, bs, hd]`` viewed as ``[L NB, ...]``, rows ``layer NB + block`` (in bounds)."""
    flat = pool.reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])
    return flat.at[rows].get(mode="promise_in_bounds")


def unstack_layers(model) -> tuple[dict[str, jax.Array], ...]:
    """The decoder layers' weights as ``L`` dicts of separate arrays (``layers`` of
    ``paged_hidden_states``): ``out[i][name] = model.layers.<name>[i]``. Jit it: it copies every
    layer weight once."""
    stacked = model.layers.stacked()
    return tuple({name: w[i] for name, w in stacked.items()} for i in range(model.config.num_layers))


def paged_hidden_states(model, tokens: jax.Array, positions: jax.Array, cache: PagedKVCache,
                        block_tables: jax.Array, *, layers: tuple[dict[str, jax.Array], ...] | None = None,
                        shared_table: jax.Array | None = None, shared_len: jax.Array | None = None,
                        shared_rows: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache]:
    """Final-normed hidden states ``[B, T, D]`` and the updated pool (see the module docstring).

    ``model`` is a ``jaxprm.models.Transformer``; ``model.logits(h)`` turns (a gather of) the hidden
    states into float32 logits. ``layers`` (``unstack_layers(model)``, same values as the model's
    layers): run the layers unrolled over these arrays instead of a scan over the stacked ones.

    Shared prefixes (cascade decode of rows that start with cached blocks common to their group):
    ``shared_table [S, ns]`` holds, per group ``g``, the blocks of positions
    ``0 .. shared_len[g] - 1`` (``shared_len [S]`` int32, multiples of ``bs``; entries past them are
    ignored), and ``shared_rows [S, R]`` the rows of each group (``-1``: an empty slot; a row in no
    group keeps a table of its positions from 0). A grouped row's ``block_tables`` entries then map
    the positions *after* its group's prefix (entry ``j``: positions ``shared_len[g] + j bs ..``).
    Each prefix is gathered once for the batch instead of once per row, and its group's queries
    attend it together (``paged_attention``); a grouped row's positions must be ``>= shared_len[g]``
    (the shared blocks are read, never written) and ``< shared_len[g] + nb bs``. Same result as the
    full tables up to float rounding. One prefix for every row: ``shared_table [ns]`` and a scalar
    ``shared_len`` (``shared_rows`` omitted).
    """
    c = model.config
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must both be [B, T]")
    if block_tables.ndim != 2 or block_tables.shape[0] != tokens.shape[0]:
        raise ValueError(f"block_tables {block_tables.shape} must be [B, nb] with B = {tokens.shape[0]}")
    if cache.k.shape[0] != c.num_layers:
        raise ValueError(f"pool has {cache.k.shape[0]} layers, the model {c.num_layers}")
    if layers is not None and len(layers) != c.num_layers:
        raise ValueError(f"layers has {len(layers)} entries, the model {c.num_layers} layers")
    tokens = tokens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    B, T = tokens.shape
    NB, bs, K = cache.num_blocks, cache.block_size, c.num_kv_heads
    W = block_tables.shape[1] * bs
    x = jnp.take(model.embed[...], tokens, axis=0, mode="clip")
    cos, sin = rope_cos_sin(c, positions)

    if (shared_table is None) != (shared_len is None):
        raise ValueError("give shared_table and shared_len together")
    if shared_table is None:
        base = jnp.zeros((B,), jnp.int32)
    else:
        shared_table = jnp.asarray(shared_table, jnp.int32)
        shared_len = jnp.asarray(shared_len, jnp.int32)
        if shared_table.ndim == 1:  # one prefix for every row
            if shared_rows is not None:
                raise ValueError("shared_rows needs shared_table [S, ns] and shared_len [S]")
            shared_table, shared_len = shared_table[None], shared_len.reshape(1)
            shared_rows = jnp.arange(B, dtype=jnp.int32)[None]
        if shared_table.ndim != 2 or shared_len.shape != shared_table.shape[:1]:
            raise ValueError(f"shared_table {shared_table.shape} must be [S, ns] and shared_len {shared_len.shape} [S]")
        if shared_rows is None or jnp.ndim(shared_rows) != 2 or jnp.shape(shared_rows)[0] != shared_table.shape[0]:
            raise ValueError(f"give shared_rows [S, R] (S = {shared_table.shape[0]}) with shared_table [S, ns]")
        shared_rows = jnp.asarray(shared_rows, jnp.int32)
        S, R = shared_rows.shape
        member = shared_rows >= 0
        target = jnp.where(member, shared_rows, B).reshape(-1)  # B: dropped
        shared_slot = jnp.full((B,), -1, jnp.int32).at[target].set(jnp.arange(S * R, dtype=jnp.int32), mode="drop")
        group = jnp.where(shared_slot >= 0, shared_slot // R, 0)
        base = jnp.where(shared_slot >= 0, shared_len[group], 0)
    valid = positions >= base[:, None]
    rel = positions - base[:, None]  # the slot of a position in the row's own window
    safe = jnp.clip(rel, 0, W - 1)
    # Where each entry's k/v goes; padding entries (negative position) target block NB (dropped).
    write_block = jnp.where(valid, jnp.take_along_axis(block_tables, safe // bs, axis=1), NB)
    write_off = safe % bs
    slots = jnp.arange(W)
    mask = (slots[None, None, :] <= rel[:, :, None]) & valid[:, :, None]
    if shared_table is not None:
        ns = shared_table.shape[1]
        # slot j of group g's prefix: its rows see it iff j < shared_len[g] (and the entry is real)
        in_prefix = jnp.arange(ns * bs)[None, :] < shared_len[:, None]  # [S, ns bs]
        row_valid = valid[jnp.clip(shared_rows, 0, B - 1)] & member[:, :, None]  # [S, R, T]
        shared_mask = row_valid[:, :, :, None] & in_prefix[:, None, None, :]
        shared_blocks = shared_table.reshape(-1)

    def layer(x, ck, cv, p, i):
        new = {}

        def attend(q, k, v):
            # k, v [B, T, K, hd] are written at (block, head, offset) before attention reads them
            new["k"] = ck.at[i, write_block[:, :, None], jnp.arange(K), write_off[:, :, None]].set(
                k.astype(ck.dtype), mode="drop")
            new["v"] = cv.at[i, write_block[:, :, None], jnp.arange(K), write_off[:, :, None]].set(
                v.astype(cv.dtype), mode="drop")
            # The rows' blocks [B, nb, K, bs, hd] of this layer, gathered from the whole pool seen as
            # [L NB, K, bs, hd] (no slice of the layer first: XLA:CPU gathers about 2x faster so).
            rows = (block_tables + i * NB).reshape(-1)
            key_blocks = _gather_blocks(new["k"], rows).reshape(B, -1, K, bs, c.head_dim).astype(k.dtype)
            value_blocks = _gather_blocks(new["v"], rows).reshape(B, -1, K, bs, c.head_dim).astype(v.dtype)
            shared = None
            if shared_table is not None:
                shape = (S, ns, K, bs, c.head_dim)
                shared = (_gather_blocks(new["k"], shared_blocks + i * NB).reshape(shape).astype(k.dtype),
                          _gather_blocks(new["v"], shared_blocks + i * NB).reshape(shape).astype(v.dtype),
                          shared_rows, shared_slot, shared_mask)
            return paged_attention(q, key_blocks, value_blocks, mask, shared)

        x = _layer(c, x, p, cos, sin, attend)
        return x, new["k"], new["v"]

    ck, cv = cache.k, cache.v
    if layers is not None:
        for i, p in enumerate(layers):
            x, ck, cv = layer(x, ck, cv, p, i)
    else:
        def body(carry, xs):
            return layer(*carry, *xs), None

        (x, ck, cv), _ = jax.lax.scan(body, (x, ck, cv), (model.layers.stacked(), jnp.arange(c.num_layers)))
    return rms_norm(x, model.final_norm[...], c.rms_norm_eps), PagedKVCache(k=ck, v=cv)
