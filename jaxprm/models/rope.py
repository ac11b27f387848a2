"""Rotary position embeddings with the Hugging Face conventions.

Frequencies: ``inv_freq[i] = 1 / theta ** (2 i / hd)`` for ``i < hd/2``, then modified by the rope
scaling type (``linear``: divided by ``factor``; ``llama3``: wavelength-dependent division with a
smooth band; ``yarn``: interpolation/extrapolation blend plus a cos/sin ``attention_factor``).
Rotation: the "rotate half" layout (the two halves of each head are the pair coordinates, not
interleaved pairs): ``x * cos + rotate_half(x) * sin`` with ``cos = cos([f, f])``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxprm.models.config import ModelConfig

__all__ = ["rope_frequencies", "rope_cos_sin", "apply_rope"]


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """``(inv_freq float32 [hd/2], attention_factor)`` for the config's RoPE (numpy, float32 math
    as in transformers)."""
    dim = config.head_dim
    base = np.float32(config.rope_theta)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(base, exponents, dtype=np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq).astype(np.float32)
        smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(config, pos_freqs)
    raise ValueError(f"rope_type={kind!r} is not supported")


def _yarn(config: ModelConfig, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN frequencies and attention factor (transformers' ``_compute_yarn_parameters``)."""
    s = config.rope_scaling
    dim, base = config.head_dim, config.rope_theta
    original = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
    inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` float32 ``[B, T, hd]`` for int positions ``[B, T]`` (any sign; finite)."""
    inv_freq, attention_factor = rope_frequencies(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, N, hd]`` by ``cos, sin [B, T, hd]``: ``x cos + rotate_half(x) sin``,
    with ``rotate_half([a, b]) = [-b, a]``; computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    half = xf.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)
