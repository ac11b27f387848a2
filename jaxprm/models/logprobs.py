"""Per-token log-probabilities for the learner (prediction-position convention, float32).

Entry ``t`` of a ``[B, T]`` learner array is about token ``t + 1`` predicted from tokens
``0..t``; the last column has nothing to predict and is 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprm.models.transformer import KVCache, Transformer

__all__ = ["next_token_logprobs", "logprobs_of", "shift_targets", "token_logprobs", "entropy_of"]


def logprobs_of(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``log_softmax(logits)[b, t, targets[b, t]]`` in float32, shape ``[B, T]``.

    ``logits [B, T, V]`` (any float dtype, upcast), ``targets`` int ``[B, T]`` already aligned to
    the logits (use ``shift_targets(tokens)`` to predict the next token). No shift happens here.
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits {logits.shape} must be [B, T, V] and targets {targets.shape} [B, T]")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def next_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """The learner's per-token log-probs: ``out[b, t] = log_softmax(logits[b, t])[tokens[b, t + 1]]``
    in float32, 0 in the last column (prediction positions).

    Shapes: logits ``[B, T, V]`` (any float dtype, upcast), tokens int ``[B, T]`` -> ``[B, T]``. The
    one function every learner path (PPO step, warm start, reference policy) uses.
    """
    lp = logprobs_of(logits[:, :-1], tokens[:, 1:])
    return jnp.pad(lp, ((0, 0), (0, 1)))


def shift_targets(tokens: jax.Array, fill: int = 0) -> jax.Array:
    """``targets[t] = tokens[t + 1]``, last column ``fill``: ``[B, T] -> [B, T]``."""
    return jnp.concatenate([tokens[:, 1:], jnp.full_like(tokens[:, :1], fill)], axis=1)


def entropy_of(logits: jax.Array) -> jax.Array:
    """Entropy ``-sum_v p log p`` of ``softmax(logits)`` per entry, float32 ``[B, T]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(
    model: Transformer, tokens: jax.Array, positions: jax.Array, cache: KVCache | None = None
) -> jax.Array:
    """Log-prob of ``tokens[b, t+1]`` at entry ``t`` (float32 ``[B, T]``, last column 0).

    One full forward (no cache by default, see ``Transformer`` for the padding convention);
    entries whose next token is padding are garbage the caller masks out.
    """
    logits, _ = model(tokens, positions, cache)
    return next_token_logprobs(logits, tokens)
