"""Decoder-only transformer (Llama / Qwen2 / Qwen3 families) in Flax NNX, with a KV cache.

Parameters of all layers are stacked along a leading layer axis ``L`` and the layers run in one
``jax.lax.scan``, so the compiled program (and its compile time) does not grow with depth.

Parameter layout (``x @ W`` convention; HF tensor layouts are converted in ``hf_io``):

====================  =====================  =============================================
name                  shape                  note
====================  =====================  =============================================
embed                 [V, D]                 also the LM head when ``tie_embeddings``
layers.attn_norm      [L, D]                 RMSNorm weight before attention
layers.q_proj         [L, D, H, hd]          (+ q_bias [L, H, hd] if ``qkv_bias``)
layers.k_proj         [L, D, K, hd]          (+ k_bias [L, K, hd])
layers.v_proj         [L, D, K, hd]          (+ v_bias [L, K, hd])
layers.q_norm/k_norm  [L, hd]                qwen3 only (``qk_norm``)
layers.o_proj         [L, H, hd, D]          (+ o_bias [L, D] if ``o_bias``)
layers.mlp_norm       [L, D]                 RMSNorm weight before the MLP
layers.gate_proj      [L, D, F]              SwiGLU: down(silu(x gate) * (x up))
layers.up_proj        [L, D, F]
layers.down_proj      [L, F, D]
final_norm            [D]
lm_head               [V, D]                 absent when ``tie_embeddings``
====================  =====================  =============================================

Call convention: ``logits, cache = model(tokens, positions, cache=None)``.

* ``tokens`` int32 ``[B, T]`` (ids are clipped into ``[0, V)``), ``positions`` int32 ``[B, T]``
  absolute positions (RoPE angle and, with a cache, the cache slot).
* Without a cache: query ``t`` attends keys ``s <= t`` (index-causal) whose position is ``>= 0``;
  rows of ``T >= 2 * CAUSAL_CHUNK`` compute it in query chunks that skip the keys after them
  (``causal_attention``: about half the score entries, forward and backward).
  Tree-packed rows (``jaxprm.learner.packing``) pass ``subtree_end`` ``[B, T]`` instead: query
  ``t`` attends key ``s`` iff ``s <= t < subtree_end[b, s]`` (``s`` is on ``t``'s root path), and
  ``positions`` carry each token's depth (its position in the unpacked row) for RoPE. That dense
  mask costs ``O(T^2)`` per packed row; ``query_blocks [B, N, Q]`` with ``key_blocks [B, N, S]``
  (from ``pack_rows``) compute the same attention block-sparsely: block ``n`` of row ``b`` holds
  up to ``Q`` query slots and the ``S`` slots of their common root path (key ``i`` has depth
  ``i``; query ``t`` sees keys ``i <= positions[b, t]``), so the cost is ``N Q S`` per row, about
  the packed tokens times the unpacked row length.
  Padding convention: right-pad rows with any token and any position; causality keeps the padded
  tail from touching the real prefix. Left padding is also possible by giving the pad entries a
  negative position (they are then never attended). Outputs at pad entries are finite garbage.
* With a cache (``KVCache``, slot index == absolute position): each entry's k/v is written at slot
  ``positions[b, t]`` *before* attention, then the query at position ``p`` attends slots
  ``0..p`` of its row (only those). Entries whose position is negative or ``>= S`` (the cache
  length) are not written (dropped), and a query with ``p >= S`` sees all ``S`` slots; such
  entries give finite but meaningless outputs -- keep positions ``< S``. A right-padded prefill
  writes pad k/v at slots past the true length; a decode step writes its own slot before
  attending, so those stale slots are overwritten before they are ever read. Pad entries must not
  reuse a real token's position (use the continuing positions, or -1 to skip the write).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models.config import ModelConfig
from jaxprm.models.lora import lora_delta
from jaxprm.models.rope import apply_rope, rope_cos_sin

__all__ = ["Transformer", "KVCache", "rms_norm", "init_params", "attention", "causal_attention", "block_attention",
           "CAUSAL_CHUNK"]

_MASK_VALUE = float(jnp.finfo(jnp.float32).min)
#: Query chunk of :func:`causal_attention`; a cache-free forward of ``T >= 2 * CAUSAL_CHUNK`` uses it.
CAUSAL_CHUNK = 128


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Key/value cache, ``k, v [L, B, S, K, hd]`` in the parameter dtype; slot index == position."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
        """An all-zero cache for ``batch_size`` rows of up to ``max_len`` positions."""
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size={batch_size} and max_len={max_len} must be positive")
        shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
        dtype = config.dtype if dtype is None else dtype
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def batch_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def max_len(self) -> int:
        return int(self.k.shape[2])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``, statistics in float32, result in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Random initial parameters ``{dotted name: array}``: weights ``N(0, initializer_range^2)``, norm weights 1,
    biases 0 (one compiled program per config, so creating a model is fast)."""
    c = config
    L, D, H, K, hd, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.intermediate_size, c.vocab_size)
    shapes = {
        "embed": (V, D), "lm_head": (V, D),
        "layers.q_proj": (L, D, H, hd), "layers.k_proj": (L, D, K, hd), "layers.v_proj": (L, D, K, hd),
        "layers.o_proj": (L, H, hd, D), "layers.gate_proj": (L, D, F), "layers.up_proj": (L, D, F),
        "layers.down_proj": (L, F, D),
    }
    if c.tie_embeddings:
        del shapes["lm_head"]
    # One random draw sliced into all weights: many separate draws compile far slower on CPU.
    sizes = [math.prod(shape) for shape in shapes.values()]
    flat = c.initializer_range * jax.random.normal(key, (sum(sizes),), jnp.float32)
    offsets = np.cumsum([0, *sizes])
    out = {name: flat[offsets[i]: offsets[i + 1]].reshape(shape).astype(c.dtype)
           for i, (name, shape) in enumerate(shapes.items())}
    ones = {"final_norm": (D,), "layers.attn_norm": (L, D), "layers.mlp_norm": (L, D)}
    zeros = {}
    if c.qk_norm:
        ones.update({"layers.q_norm": (L, hd), "layers.k_norm": (L, hd)})
    if c.qkv_bias:
        zeros.update({"layers.q_bias": (L, H, hd), "layers.k_bias": (L, K, hd), "layers.v_bias": (L, K, hd)})
    if c.o_bias:
        zeros["layers.o_bias"] = (L, D)
    out.update({name: jnp.ones(shape, c.dtype) for name, shape in ones.items()})
    out.update({name: jnp.zeros(shape, c.dtype) for name, shape in zeros.items()})
    return out


class DecoderLayers(nnx.Module):
    """All ``L`` decoder layers' parameters, stacked on a leading layer axis (see module docs)."""

    def __init__(self, config: ModelConfig, params: dict[str, jax.Array]):
        for name in self.PARAM_NAMES:
            value = params.get(f"layers.{name}")
            setattr(self, name, None if value is None else nnx.Param(value))
        # LoRA adapters (``jaxprm.models.lora.add_lora``): {target: stacked nnx.LoRA}, and their scale
        self.lora: nnx.Dict | None = None
        self.lora_scale = 0.0

    PARAM_NAMES = ("attn_norm", "q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "q_norm",
                   "k_norm", "o_proj", "o_bias", "mlp_norm", "gate_proj", "up_proj", "down_proj")

    def stacked(self) -> dict[str, jax.Array]:
        """The present parameters as a dict of arrays with leading axis ``L`` (scan input)."""
        return {n: getattr(self, n)[...] for n in self.PARAM_NAMES if getattr(self, n) is not None}

    def adapters(self) -> dict[str, dict[str, jax.Array]]:
        """``{target: {"lora_a": [L, in, r], "lora_b": [L, r, out]}}`` (empty without LoRA)."""
        if self.lora is None:
            return {}
        return {t: {"lora_a": m.lora_a[...], "lora_b": m.lora_b[...]} for t, m in self.lora.items()}


def _layer(config: ModelConfig, x, p, cos, sin, attend, lora_scale: float = 0.0):
    """One pre-norm decoder layer on ``x [B, T, D]``; ``attend(q, k, v) -> [B, T, H, hd]``.

    ``p["lora"]`` (optional) holds this layer's adapters ``{target: {"lora_a", "lora_b"}}``: each
    adds ``lora_scale * nnx.LoRA(x_in)`` to its projection (``jaxprm.models.lora``)."""
    c = config
    lora = p.get("lora", {})

    def project(name: str, spec: str, x_in):
        y = jnp.einsum(spec, x_in, p[name])
        if name in lora:
            flat = x_in.reshape(*x_in.shape[:2], -1)
            y = y + lora_delta(flat, lora[name], lora_scale).reshape(y.shape).astype(y.dtype)
        return y

    h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
    q = project("q_proj", "btd,dhk->bthk", h)
    k = project("k_proj", "btd,dhk->bthk", h)
    v = project("v_proj", "btd,dhk->bthk", h)
    if c.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if c.qk_norm:
        q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn = attend(q, k, v)
    o = project("o_proj", "bthk,hkd->btd", attn)
    if c.o_bias:
        o = o + p["o_bias"]
    x = x + o
    h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
    gate = project("gate_proj", "btd,df->btf", h)
    up = project("up_proj", "btd,df->btf", h)
    return x + project("down_proj", "btf,fd->btd", jax.nn.silu(gate) * up)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    ``q [B, T, H, hd]``, ``k, v [B, S, K, hd]`` (``H = K G``), boolean ``mask [B, T, S]``:
    ``softmax(q k^T / sqrt(hd) masked) v`` with scores and softmax in float32; fully masked rows
    give a uniform (finite) average. Returns ``[B, T, H, hd]`` in ``q.dtype``.
    """
    B, T, H, hd = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(B, T, H, hd)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, chunk: int = CAUSAL_CHUNK
                     ) -> jax.Array:
    """Causal :func:`attention` computed in query chunks that skip the keys after them.

    ``q [B, T, H, hd]``, ``k, v [B, T, K, hd]``, ``key_valid [B, T]`` (False: a padding key). Query
    chunk ``[a, e)`` (``e = min(a + chunk, T)``) attends keys ``[0, e)`` with the mask
    ``s <= t and key_valid[b, s]``, so the scores above the diagonal's chunks are never formed: with
    ``n = T / chunk`` chunks the score tensors hold ``(n + 1) / 2n`` of ``T^2`` entries, forward and
    backward. Equal to ``attention(q, k, v, causal & key_valid)`` up to float rounding.
    """
    T = q.shape[1]
    outs = []
    for a in range(0, T, chunk):
        e = min(a + chunk, T)
        mask = (jnp.arange(a, e)[None, :, None] >= jnp.arange(e)[None, None, :]) & key_valid[:, None, :e]
        outs.append(attention(q[:, a:e], k[:, :e], v[:, :e], mask))
    return jnp.concatenate(outs, axis=1)


def block_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, query_blocks: jax.Array,
                    key_blocks: jax.Array) -> jax.Array:
    """Block-sparse tree attention over packed rows (see the module docstring).

    ``q [B, T, H, hd]``, ``k, v [B, T, K, hd]``, ``positions [B, T]`` (depths), ``query_blocks
    [B, N, Q]`` and ``key_blocks [B, N, S]`` slot indices into ``T`` (-1 = none). Each query slot
    must appear in exactly one block; slots in no block get 0. Returns ``[B, T, H, hd]``.
    """
    B, T, H, hd = q.shape
    _, N, Q = query_blocks.shape
    S = key_blocks.shape[-1]
    qi = jnp.maximum(query_blocks, 0).reshape(B, N * Q)
    ki = jnp.maximum(key_blocks, 0).reshape(B, N * S)
    take = jax.vmap(lambda x, i: x[i])
    qb = take(q, qi).reshape(B * N, Q, H, hd)
    kb = take(k, ki).reshape(B * N, S, *k.shape[2:])
    vb = take(v, ki).reshape(B * N, S, *v.shape[2:])
    qpos = take(positions, qi).reshape(B, N, Q)
    mask = (jnp.arange(S)[None, None, None, :] <= qpos[..., None]) & (key_blocks[:, :, None, :] >= 0) \
        & (query_blocks[..., None] >= 0)
    out = attention(qb, kb, vb, mask.reshape(B * N, Q, S)).reshape(B, N * Q, H, hd)
    dest = jnp.where(query_blocks >= 0, query_blocks, T).reshape(B, N * Q)
    put = jax.vmap(lambda o, d: jnp.zeros((T, H, hd), o.dtype).at[d].set(o, mode="drop"))
    return put(out, dest)


class Transformer(nnx.Module):
    """Decoder-only transformer; see the module docstring for shapes and the cache convention.

    ``remat=True`` rematerializes each layer in the backward pass (less activation memory).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, remat: bool = False):
        self.config = config
        self.remat = remat
        params = init_params(config, rngs.params())
        self.embed = nnx.Param(params["embed"])
        self.layers = DecoderLayers(config, params)
        self.final_norm = nnx.Param(params["final_norm"])
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None, *,
        subtree_end: jax.Array | None = None, query_blocks: jax.Array | None = None,
        key_blocks: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """``(logits float32 [B, T, V], updated cache or None)``."""
        hidden, cache = self.hidden_states(tokens, positions, cache, subtree_end=subtree_end,
                                           query_blocks=query_blocks, key_blocks=key_blocks)
        return self.logits(hidden), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits ``[..., V]`` from final hidden states ``[..., D]`` (already normed)."""
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...d,vd->...v", hidden, head, preferred_element_type=jnp.float32)

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None, *,
        subtree_end: jax.Array | None = None, query_blocks: jax.Array | None = None,
        key_blocks: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Final-normed hidden states ``[B, T, D]`` (param dtype) and the updated cache.

        ``model.logits(h)`` turns (a gather of) them into logits: a sampler can project only the
        last prompt position instead of materializing ``[B, T, V]``. ``subtree_end`` (no cache
        only) selects the tree-packed mask ``s <= t < subtree_end[b, s]``; ``query_blocks`` with
        ``key_blocks`` the same attention block-sparsely (``block_attention``).
        """
        c = self.config
        if tokens.ndim != 2 or positions.shape != tokens.shape:
            raise ValueError(
                f"tokens {tokens.shape} and positions {positions.shape} must both be [B, T]"
            )
        tokens = tokens.astype(jnp.int32)
        positions = positions.astype(jnp.int32)
        B, T = tokens.shape
        x = jnp.take(self.embed[...], tokens, axis=0, mode="clip")
        cos, sin = rope_cos_sin(c, positions)
        params = self.layers.stacked()
        scale = self.layers.lora_scale
        if self.layers.lora is not None:
            params["lora"] = self.layers.adapters()

        if subtree_end is not None and (cache is not None or subtree_end.shape != tokens.shape):
            raise ValueError(f"subtree_end {subtree_end.shape} must be [B, T] like tokens {tokens.shape} "
                             "and needs cache=None")
        if (query_blocks is None) != (key_blocks is None) or (query_blocks is not None and (
                cache is not None or query_blocks.shape[:2] != key_blocks.shape[:2] or query_blocks.shape[0] != B)):
            raise ValueError("query_blocks [B, N, Q] and key_blocks [B, N, S] go together and need cache=None")
        if cache is None:
            if query_blocks is not None:
                qb, kb = query_blocks.astype(jnp.int32), key_blocks.astype(jnp.int32)

                def attend(q, k, v):
                    return block_attention(q, k, v, positions, qb, kb)
            elif subtree_end is None and T >= 2 * CAUSAL_CHUNK:  # long rows: skip the keys after each query chunk
                key_valid = positions >= 0

                def attend(q, k, v):
                    return causal_attention(q, k, v, key_valid)
            else:
                idx = jnp.arange(T)
                mask = (idx[None, :, None] >= idx[None, None, :]) & (positions[:, None, :] >= 0)
                if subtree_end is not None:
                    mask = mask & (idx[None, :, None] < subtree_end.astype(jnp.int32)[:, None, :])

                def attend(q, k, v):
                    return attention(q, k, v, mask)

            def body(x, p):
                return _layer(c, x, p, cos, sin, attend, scale), None

            if self.remat:
                body = jax.checkpoint(body)
            x, _ = jax.lax.scan(body, x, params)
        else:
            if cache.k.shape[:2] != (c.num_layers, B):
                raise ValueError(
                    f"cache has layers/batch {cache.k.shape[:2]}, expected {(c.num_layers, B)}"
                )
            S = cache.max_len
            slots = jnp.arange(S)
            mask = slots[None, None, :] <= positions[:, :, None]
            # Out-of-range positions write to slot S, which mode="drop" discards.
            write = jnp.where((positions >= 0) & (positions < S), positions, S)
            rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))

            def body(carry, xs):
                x, ck, cv = carry
                p, layer = xs
                new = {}

                def attend(q, k, v):
                    new["k"] = ck.at[layer, rows, write].set(k.astype(ck.dtype), mode="drop")
                    new["v"] = cv.at[layer, rows, write].set(v.astype(cv.dtype), mode="drop")
                    keys = new["k"][layer].astype(k.dtype)
                    values = new["v"][layer].astype(v.dtype)
                    return attention(q, keys, values, mask)

                x = _layer(c, x, p, cos, sin, attend, scale)
                return (x, new["k"], new["v"]), None

            (x, ck, cv), _ = jax.lax.scan(
                body, (x, cache.k, cache.v), (params, jnp.arange(c.num_layers))
            )
            cache = KVCache(k=ck, v=cv)
        return rms_norm(x, self.final_norm[...], c.rms_norm_eps), cache

    def num_params(self) -> int:
        """Total parameter count."""
        return sum(int(x.size) for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
