"""Masked normalization of advantages / rewards at batch or group level."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_choice, check_float, check_rank, check_same_shape
from jaxprm.modes import NORM_LEVELS

__all__ = ["normalize", "group_normalize_rewards", "masked_sum_count", "NORM_LEVELS"]



def masked_sum_count(x: jax.Array, mask: jax.Array, axis=None) -> tuple[jax.Array, jax.Array]:
    """``(sum(x * mask), sum(mask))`` over ``axis``: combine across microbatches by adding."""
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(jnp.asarray(x, jnp.float32) * m, axis=axis), jnp.sum(m, axis=axis)


def _segment_sum(x, ids, n):
    return jax.ops.segment_sum(x, ids, num_segments=n)


def normalize(
    x: jax.Array,
    mask: jax.Array | None = None,
    *,
    group_ids: jax.Array | None = None,
    num_groups: int | None = None,
    mean_level: str | None = "batch",
    std_level: str | None = "batch",
    unbiased: bool = True,
    eps: float = 1e-5,
    row_weights: jax.Array | None = None,
    token_weights: jax.Array | None = None,
) -> jax.Array:
    """Masked normalization ``(x - mean) * mask / (std + eps)``.

    * ``mean``: token-weighted mean over the active elements of the level (``"batch"``: all rows;
      ``"group"``: the rows sharing a group id), 0 when no element is active; ``None``: 0.
    * ``std``: root of ``sum(mask * (x - mean)**2) / (n - 1)`` (``/ n`` if not ``unbiased``) over the
      level's active elements, taken around the mean actually subtracted (around 0 when
      ``mean_level is None``). It is 1 when at most one element is active, and 1 for a group made of
      a single row when ``unbiased``. ``std_level=None`` means std 1 and eps 0.
    * Output is 0 wherever ``mask`` is 0 (also when every element is masked).

    Args:
      x: ``[B, T]`` float, or ``[B]`` (one value per row, e.g. outcome rewards).
      mask: 0/1 of the shape of ``x``; ``None`` means all active.
      group_ids: ``[B]`` int in ``[0, num_groups)``; needed for a ``"group"`` level.
      num_groups: static number of group segments (defaults to ``B``).
      row_weights: optional ``[B]``; rows of weight 0 (batch padding) are left out of the group row
        count used by the single-row rule. Their elements should also be masked.
      token_weights: optional ``[B, T]`` weights of the active elements in the mean, the std and
        the element counts (a tree's shared copies: ``1 / leaves``, so a shared turn counts once);
        default 1.
    Returns:
      ``[B, T]`` in the floating dtype of ``x`` (float32 at least).
    """
    check_choice("mean_level", mean_level, NORM_LEVELS)
    check_choice("std_level", std_level, NORM_LEVELS)
    if mask is None:
        mask = jnp.ones(jnp.shape(x), jnp.float32)
    if jnp.ndim(x) == 1:
        check_same_shape(x=x, mask=mask)
        return normalize(
            jnp.asarray(x)[:, None], jnp.asarray(mask)[:, None], group_ids=group_ids, num_groups=num_groups,
            mean_level=mean_level, std_level=std_level, unbiased=unbiased, eps=eps, row_weights=row_weights,
            token_weights=None if token_weights is None else jnp.asarray(token_weights)[:, None],
        )[:, 0]
    check_rank("x", x, 2)
    check_same_shape(x=x, mask=mask)
    if token_weights is not None:
        check_same_shape(x=x, token_weights=token_weights)
    check_float("x", x)
    dtype = jnp.result_type(x, jnp.float32)
    x = jnp.asarray(x, dtype)
    m = jnp.asarray(mask, dtype)
    B = x.shape[0]
    uses_group = "group" in (mean_level, std_level)
    if uses_group:
        if group_ids is None:
            raise ValueError("group_ids is required when mean_level or std_level is 'group'")
        check_rank("group_ids", group_ids, 1)
        if jnp.shape(group_ids)[0] != B:
            raise ValueError(f"group_ids must have shape ({B},), got {jnp.shape(group_ids)}")
        n_seg = B if num_groups is None else int(num_groups)
        gid = jnp.asarray(group_ids, jnp.int32)

    w = 1.0 if token_weights is None else jnp.asarray(token_weights, dtype)
    tw = m * w
    row_sum = jnp.sum(x * tw, axis=1)
    row_cnt = jnp.sum(tw, axis=1)

    # Mean per row.
    if mean_level is None:
        mean_row = jnp.zeros((B,), dtype)
    elif mean_level == "batch":
        total = jnp.sum(row_cnt)
        mean_row = jnp.broadcast_to(jnp.where(total > 0, jnp.sum(row_sum) / jnp.maximum(total, 1), 0.0), (B,))
    else:
        g_sum = _segment_sum(row_sum, gid, n_seg)
        g_cnt = _segment_sum(row_cnt, gid, n_seg)
        mean_row = jnp.where(g_cnt > 0, g_sum / jnp.maximum(g_cnt, 1), 0.0)[gid]

    centered = (x - mean_row[:, None]) * m

    # Std per row.
    if std_level is None:
        std_row = jnp.ones((B,), dtype)
        eps_eff = 0.0
    else:
        sq_row = jnp.sum(centered * centered * w, axis=1)
        ddof = 1.0 if unbiased else 0.0
        if std_level == "batch":
            n = jnp.sum(row_cnt)
            var = jnp.sum(sq_row) / jnp.maximum(n - ddof, 1.0)
            std = jnp.where(n > 1, jnp.sqrt(var), 1.0)
            std_row = jnp.broadcast_to(std, (B,))
        else:
            g_sq = _segment_sum(sq_row, gid, n_seg)
            g_cnt = _segment_sum(row_cnt, gid, n_seg)
            real = jnp.ones((B,), dtype) if row_weights is None else (jnp.asarray(row_weights) > 0).astype(dtype)
            g_rows = _segment_sum(real, gid, n_seg)
            var = g_sq / jnp.maximum(g_cnt - ddof, 1.0)
            single = (g_cnt <= 1) | ((g_rows <= 1) & unbiased)
            std_row = jnp.where(single, 1.0, jnp.sqrt(var))[gid]
        eps_eff = eps
    return centered / (std_row[:, None] + eps_eff)


def group_normalize_rewards(
    rewards: jax.Array,
    group_ids: jax.Array,
    num_groups: int,
    *,
    std: bool = True,
    unbiased: bool = True,
    eps: float = 1e-5,
    weights: jax.Array | None = None,
) -> jax.Array:
    """GRPO outcome-reward normalization over the sequences of each group.

    ``(r - mean_g) / (std_g + eps)`` with mean and (unbiased) std over the group's rows of weight
    > 0; std 1 for a group with at most one row, and ``std=False`` means std 1 and eps 0. Rows with
    weight 0 (padding) get 0.

    Args:
      rewards: ``[B]`` float outcome rewards.
      group_ids: ``[B]`` int in ``[0, num_groups)``.
      num_groups: static number of group segments.
      weights: optional ``[B]`` row weights (0 = padding row).
    Returns:
      ``[B]`` in the rewards' floating dtype (float32 at least).
    """
    check_rank("rewards", rewards, 1)
    check_rank("group_ids", group_ids, 1)
    check_same_shape(rewards=rewards, group_ids=group_ids)
    B = jnp.shape(rewards)[0]
    dt = jnp.result_type(rewards, jnp.float32)
    w = jnp.ones((B,), dt) if weights is None else (jnp.asarray(weights) > 0).astype(dt)
    if weights is not None:
        check_same_shape(rewards=rewards, weights=weights)
    out = normalize(
        jnp.asarray(rewards, dt)[:, None],
        w[:, None],
        group_ids=group_ids,
        num_groups=num_groups,
        mean_level="group",
        std_level="group" if std else None,
        unbiased=unbiased,
        eps=eps,
        row_weights=w,
    )
    return out[:, 0]
