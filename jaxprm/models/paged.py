"""Paged key/value memory: the transformer over a shared pool of fixed-size KV blocks.

A serving engine keeps the keys and values of many sequences in one preallocated pool of blocks
(``PagedKVCache``: ``k, v [L, NB, K, bs, hd]``, ``NB`` blocks of ``bs`` positions each; heads
before positions, so that a row's gathered window is ``[K, W, hd]`` and attention needs no transpose
of the keys and values) and gives
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

__all__ = ["PagedKVCache", "paged_hidden_states", "paged_attention", "kv_bytes_per_token"]


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


def paged_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention over gathered windows.

    ``q [B, T, H, hd]``, ``keys, values [B, K, W, hd]`` (``H = K G``), boolean ``mask [B, T, W]``:
    ``softmax(q k^T / sqrt(hd) masked) v``, scores and softmax in float32 (fully masked rows give a
    finite average). Returns ``[B, T, H, hd]`` in ``q.dtype``. Same as ``transformer.attention``
    with the keys in heads-major layout.
    """
    B, T, H, hd = q.shape
    K = keys.shape[1]
    qg = q.reshape(B, T, K, H // K, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, values)
    return out.reshape(B, T, H, hd)


def paged_hidden_states(model, tokens: jax.Array, positions: jax.Array, cache: PagedKVCache,
                        block_tables: jax.Array) -> tuple[jax.Array, PagedKVCache]:
    """Final-normed hidden states ``[B, T, D]`` and the updated pool (see the module docstring).

    ``model`` is a ``jaxprm.models.Transformer``; ``model.logits(h)`` turns (a gather of) the hidden
    states into float32 logits.
    """
    c = model.config
    if tokens.ndim != 2 or positions.shape != tokens.shape:
        raise ValueError(f"tokens {tokens.shape} and positions {positions.shape} must both be [B, T]")
    if block_tables.ndim != 2 or block_tables.shape[0] != tokens.shape[0]:
        raise ValueError(f"block_tables {block_tables.shape} must be [B, nb] with B = {tokens.shape[0]}")
    if cache.k.shape[0] != c.num_layers:
        raise ValueError(f"pool has {cache.k.shape[0]} layers, the model {c.num_layers}")
    tokens = tokens.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    B, T = tokens.shape
    NB, bs, K, hd = cache.num_blocks, cache.block_size, c.num_kv_heads, c.head_dim
    W = block_tables.shape[1] * bs
    x = jnp.take(model.embed[...], tokens, axis=0, mode="clip")
    cos, sin = rope_cos_sin(c, positions)
    params = model.layers.stacked()

    valid = positions >= 0
    safe = jnp.clip(positions, 0, W - 1)
    # Where each entry's k/v goes; padding entries (negative position) target block NB (dropped).
    write_block = jnp.where(valid, jnp.take_along_axis(block_tables, safe // bs, axis=1), NB)
    write_off = safe % bs
    slots = jnp.arange(W)
    mask = (slots[None, None, :] <= positions[:, :, None]) & valid[:, :, None]

    def body(carry, xs):
        x, ck, cv = carry
        p, layer = xs
        new = {}

        def window(pool):  # [NB, K, bs, hd] -> the rows' windows [B, K, W, hd]
            return pool[block_tables].transpose(0, 2, 1, 3, 4).reshape(B, K, W, hd)

        def attend(q, k, v):
            # k, v [B, T, K, hd] are written at (block, head, offset) before attention reads them
            new["k"] = ck.at[layer, write_block[:, :, None], jnp.arange(K), write_off[:, :, None]].set(
                k.astype(ck.dtype), mode="drop")
            new["v"] = cv.at[layer, write_block[:, :, None], jnp.arange(K), write_off[:, :, None]].set(
                v.astype(cv.dtype), mode="drop")
            keys = window(new["k"][layer]).astype(k.dtype)
            values = window(new["v"][layer]).astype(v.dtype)
            return paged_attention(q, keys, values, mask)

        x = _layer(c, x, p, cos, sin, attend)
        return (x, new["k"], new["v"]), None

    (x, ck, cv), _ = jax.lax.scan(body, (x, cache.k, cache.v), (params, jnp.arange(c.num_layers)))
    return rms_norm(x, model.final_norm[...], c.rms_norm_eps), PagedKVCache(k=ck, v=cv)
