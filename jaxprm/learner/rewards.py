"""Reward placement and per-token reward terms, in prediction positions.

All ``[B, T]`` arrays follow the prediction-position convention of docs/design.md: entry ``t`` concerns
token ``t+1``. ``shift_to_prediction`` is the single edge where token-aligned data is moved there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import assert_all, check_2d_same, check_choice, check_float, check_rank
from jaxprm.modes import KL_ESTIMATORS

__all__ = [
    "shift_to_prediction",
    "place_outcome_rewards",
    "transform_outcome_rewards",
    "kl_penalty",
    "KL_ESTIMATORS",
    "fold_turn_rewards",
    "check_uniform_turn_rewards",
    "mask_run_turn_ids",
]

KL_CLAMP = 10.0


def shift_to_prediction(x: jax.Array) -> jax.Array:
    """Token-aligned -> prediction positions along the last axis.

    ``out[..., t] = x[..., t+1]`` for ``t < T-1`` and ``out[..., T-1] = 0``.

    Args:
      x: ``[..., T]`` array (any dtype), ``T >= 1``.
    Returns:
      ``[..., T]`` array of the same dtype.
    """
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"x must have rank >= 1, got shape {x.shape}")
    pad = [(0, 0)] * (x.ndim - 1) + [(0, 1)]
    return jnp.pad(x[..., 1:], pad)


def transform_outcome_rewards(
    rewards: jax.Array, *, scale: float = 1.0, bias: float = 0.0, clip: float = 20.0
) -> jax.Array:
    """``clip((r + bias) * scale, -clip, clip)`` elementwise (AReaL's reward transform).

    Args:
      rewards: ``[B]`` float outcome rewards.
    Returns:
      ``[B]`` float32.
    """
    check_rank("rewards", rewards, 1)
    r = jnp.asarray(rewards, jnp.result_type(rewards, jnp.float32))
    return jnp.clip((r + bias) * scale, -clip, clip)


def place_outcome_rewards(rewards: jax.Array, seq_lens: jax.Array, T: int) -> jax.Array:
    """Scatter one outcome reward per row to its last prediction position.

    ``out[b, max(seq_lens[b] - 2, 0)] = rewards[b]``, zero elsewhere. Index ``seq_len - 2`` is the
    prediction position of the last token (``seq_len - 1``) of the row.

    Args:
      rewards: ``[B]`` float.
      seq_lens: ``[B]`` int, number of real tokens per row.
      T: static sequence length.
    Returns:
      ``[B, T]`` in the rewards' floating dtype (float32 at least).
    """
    check_rank("rewards", rewards, 1)
    check_rank("seq_lens", seq_lens, 1)
    if jnp.shape(rewards) != jnp.shape(seq_lens):
        raise ValueError(f"rewards{jnp.shape(rewards)} and seq_lens{jnp.shape(seq_lens)} differ")
    idx = jnp.clip(jnp.asarray(seq_lens, jnp.int32) - 2, 0, T - 1)
    onehot = jnp.arange(T, dtype=jnp.int32)[None, :] == idx[:, None]
    r = jnp.asarray(rewards, jnp.result_type(rewards, jnp.float32))
    return jnp.where(onehot, r[:, None], jnp.zeros((), r.dtype))


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, *, estimator: str = "k1") -> jax.Array:
    """Per-token KL estimate between the policy and the reference, clamped to [-10, 10].

    With ``d = logprobs - ref_logprobs``: k1 ``d``; k2 ``d**2 / 2``; k3 ``exp(-d) - 1 + d``.
    The learner uses ``-kl_ctl * kl_penalty(...)`` as a per-token reward.

    Args:
      logprobs, ref_logprobs: float arrays of equal shape (normally ``[B, T]``).
      estimator: one of ``"k1"``, ``"k2"``, ``"k3"``.
    Returns:
      Array of the input shape, in the input's floating dtype (at least float32).
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_float("logprobs", logprobs)
    check_float("ref_logprobs", ref_logprobs)
    if jnp.shape(logprobs) != jnp.shape(ref_logprobs):
        raise ValueError(f"logprobs{jnp.shape(logprobs)} and ref_logprobs{jnp.shape(ref_logprobs)} differ")
    d = jnp.asarray(logprobs) - jnp.asarray(ref_logprobs)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        kl = jnp.expm1(-d) + d
    return jnp.clip(kl, -KL_CLAMP, KL_CLAMP)


def _turn_stats(token_rewards, mask, turn_ids):
    """Per-position max/min of the turn's reward over its active positions, and whether the
    position is its turn's last active position. Segment reductions: O(B*T). Shapes ``[B, T]``."""
    B, T = token_rewards.shape
    active = (mask > 0) & (turn_ids >= 0)
    # One segment per (row, turn); inactive positions go to a dump segment B*T.
    seg = jnp.where(active, jnp.arange(B)[:, None] * T + jnp.clip(turn_ids, 0, T - 1), B * T)
    seg = seg.reshape(-1)
    r = token_rewards.reshape(-1)
    n = B * T + 1
    tmax = jax.ops.segment_max(r, seg, num_segments=n)[seg].reshape(B, T)
    tmin = jax.ops.segment_min(r, seg, num_segments=n)[seg].reshape(B, T)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T)).reshape(-1)
    last = jax.ops.segment_max(pos, seg, num_segments=n)[seg].reshape(B, T)
    is_last = active & (last == jnp.arange(T)[None, :])
    return active, tmax, tmin, is_last


def mask_run_turn_ids(mask: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """``turn_ids`` where a row has any; else the row's runs of the loss mask as turns.

    A row whose active positions carry no turn id (``turn_ids < 0`` everywhere, e.g. a batch built
    without turn ids) gets ``id = (number of runs of mask > 0 started at or before t) - 1`` on its
    active positions and ``-1`` elsewhere, as the reference does. ``[B, T] -> [B, T]`` int32.
    """
    active = mask > 0
    tid = jnp.asarray(turn_ids, jnp.int32)
    starts = active & ~jnp.pad(active[:, :-1], ((0, 0), (1, 0)))
    runs = jnp.where(active, jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1, -1)
    has_ids = jnp.any(active & (tid >= 0), axis=1, keepdims=True)
    return jnp.where(has_ids, tid, runs)


def check_uniform_turn_rewards(token_rewards, mask, turn_ids, *, atol: float = 1e-6) -> jax.Array:
    """``bool [B]``: every turn of the row carries one reward value on all its active positions."""
    active, tmax, tmin, _ = _turn_stats(jnp.asarray(token_rewards, jnp.float32), mask,
                                        mask_run_turn_ids(mask, turn_ids))
    ok = jnp.where(active, (tmax - tmin) <= atol, True)
    return jnp.all(ok, axis=-1)


def fold_turn_rewards(
    rewards: jax.Array, token_rewards: jax.Array, mask: jax.Array, turn_ids: jax.Array
) -> jax.Array:
    """Folded process rewards: add each turn's (uniform) reward once, at its last active position.

    ``out[b, t] = rewards[b, t] + token_rewards[b, t] * [t is the last active position of turn
    turn_ids[b, t]]``. The result feeds GAE, so the process reward flows into returns.

    A turn whose reward is not uniform over its active positions is rejected with ``ValueError``
    (under ``jit`` the check is a host callback and surfaces as ``JaxRuntimeError`` with the same
    message; ``check_uniform_turn_rewards`` gives the per-row flags without raising).

    Args:
      rewards: ``[B, T]`` float, the rewards GAE will see (outcome, KL).
      token_rewards: ``[B, T]`` float process rewards in prediction positions.
      mask: ``[B, T]`` loss mask.
      turn_ids: ``[B, T]`` int turn id per prediction position (``-1`` off-turn); a row without any
        falls back to the runs of its loss mask (:func:`mask_run_turn_ids`).
    Returns:
      ``[B, T]`` float32.
    """
    check_2d_same(rewards=rewards, token_rewards=token_rewards, mask=mask, turn_ids=turn_ids)
    dt = jnp.result_type(rewards, token_rewards, jnp.float32)
    tr = jnp.asarray(token_rewards, dt)
    active, tmax, tmin, is_last = _turn_stats(tr, mask, mask_run_turn_ids(mask, turn_ids))
    uniform = jnp.where(active, (tmax - tmin) <= 1e-6, True)
    assert_all(uniform, "fold_turn_rewards: a turn's process reward is not uniform over the turn; "
                "folded mode (token_rewards_as_adv=False) needs one reward per turn")
    return jnp.asarray(rewards, dt) + jnp.where(is_last, tr, jnp.zeros((), dt))
