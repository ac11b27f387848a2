"""PPO / GRPO clipped policy loss with masked (sum, count) aggregation."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_2d_same, check_choice, check_clip, check_float
from jaxprm.modes import BEHAVIOUR_WEIGHT_MODES, LOSS_AGGREGATIONS

__all__ = ["policy_loss", "policy_loss_terms", "PolicyLossTerms", "LOSS_AGGREGATIONS", "decoupled_policy_loss",
           "behaviour_weights", "BEHAVIOUR_WEIGHT_MODES"]


class PolicyLossTerms(NamedTuple):
    """Per-token pieces of the clipped loss, each ``[B, T]`` (0 where the mask is 0)."""

    pg_loss: jax.Array  # the per-token loss after clipping (and dual clipping)
    ratio: jax.Array  # exp(logprobs - old_logprobs) on active tokens, 0 elsewhere
    clip_mask: jax.Array  # bool: the clipped term won (-A r < -A clip(r))
    dual_clip_mask: jax.Array  # bool: the dual clip capped the loss (c |A| < max(...))
    approx_kl: jax.Array  # k3 estimate of KL(old || new): (r - 1) - log r


def policy_loss_terms(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
) -> PolicyLossTerms:
    """Per-token clipped surrogate (see ``policy_loss``). All inputs ``[B, T]``."""
    check_2d_same(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    check_float("logprobs", logprobs)
    check_clip(eps_clip, eps_clip_higher, c_clip)
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    active = jnp.asarray(mask) > 0
    dtype = jnp.result_type(logprobs, jnp.float32)
    logp = jnp.asarray(logprobs, dtype)
    A = jax.lax.stop_gradient(jnp.asarray(advantages, dtype))
    log_ratio = jnp.where(active, logp - jax.lax.stop_gradient(jnp.asarray(old_logprobs, dtype)), 0.0)
    ratio = jnp.where(active, jnp.exp(log_ratio), 0.0)
    clipped = jnp.clip(ratio, 1.0 - eps_clip, 1.0 + hi)
    loss1 = -A * ratio
    loss2 = -A * clipped
    clip_mask = (jax.lax.stop_gradient(loss1) < jax.lax.stop_gradient(loss2)) & active
    pg = jnp.maximum(loss1, loss2)
    if c_clip is not None:
        loss3 = c_clip * jnp.abs(A)
        dual_clip_mask = (loss3 < jax.lax.stop_gradient(pg)) & active
        pg = jnp.minimum(pg, loss3)
    else:
        dual_clip_mask = jnp.zeros_like(active)
    approx_kl = jnp.where(active, jnp.expm1(log_ratio) - log_ratio, 0.0)
    return PolicyLossTerms(
        pg_loss=jnp.where(active, pg, 0.0),
        ratio=ratio,
        clip_mask=clip_mask,
        dual_clip_mask=dual_clip_mask,
        approx_kl=jax.lax.stop_gradient(approx_kl),
    )


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    agg: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy-gradient loss (PPO / GRPO), differentiable w.r.t. ``logprobs``.

    On active tokens, with ``r = exp(logprobs - old_logprobs)``::

        pg = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))
        pg = min(pg, c_clip |A|)                      # dual clip, if c_clip (> 1) is given

    Aggregation (``agg``), as ``loss = loss_sum / max(loss_count, 1)``:

    * ``"token-mean"``: sum of ``pg`` over active tokens / number of active tokens.
    * ``"seq-mean-token-mean"``: mean over rows with an active token of each row's token mean.
    * ``"seq-mean-token-sum"``: mean over rows with an active token of each row's token sum.

    ``loss_sum`` and ``loss_count`` (and the ``*_sum`` metric numerators, over
    ``n_valid_tokens``) are returned so that microbatches or devices combine exactly: add the
    sums and counts, then divide once.

    Args:
      logprobs: ``[B, T]`` current policy log-probs (prediction positions).
      old_logprobs: ``[B, T]`` behaviour log-probs.
      advantages: ``[B, T]``.
      mask: ``[B, T]`` loss mask: 0/1, or non-negative per-token weights, which weight each
        token's term and count (``tree_value``'s ``1 / leaves`` on a shared turn's flat copies, so
        that the loss equals the packed tree's, where the turn appears once).
    Returns:
      ``(loss, metrics)``: scalar loss; metrics with ``clip_fraction``, ``dual_clip_fraction``,
      ``approx_kl`` (k3, token mean), ``ratio_mean``, ``n_valid_tokens``, ``loss_sum``,
      ``loss_count`` and the sums behind the fractions.
    """
    check_choice("agg", agg, LOSS_AGGREGATIONS)
    t = policy_loss_terms(
        logprobs, old_logprobs, advantages, mask,
        eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip,
    )
    return _aggregate(t, t.pg_loss, mask, agg)


def _aggregate(t: PolicyLossTerms, pg_loss: jax.Array, mask: jax.Array, agg: str):
    """``(loss, metrics)`` of the per-token losses ``pg_loss [B, T]`` under ``agg`` (see
    ``policy_loss``), with the clip / KL / ratio sums of ``t``."""
    mask = jnp.asarray(mask).astype(pg_loss.dtype)
    m = jnp.where(mask > 0, mask, 0.0)  # 0/1, or per-token weights (a tree's shared copies: 1 / leaves)
    n_valid = jnp.sum(m)
    row_cnt = jnp.sum(m, axis=1)
    row_sum = jnp.sum(pg_loss * m, axis=1)
    if agg == "token-mean":
        loss_sum, loss_count = jnp.sum(row_sum), n_valid
    else:
        has = row_cnt > 0
        per_row = row_sum / jnp.maximum(row_cnt, 1.0) if agg == "seq-mean-token-mean" else row_sum
        loss_sum = jnp.sum(jnp.where(has, per_row, 0.0))
        loss_count = jnp.sum(has.astype(pg_loss.dtype))
    loss = loss_sum / jnp.maximum(loss_count, 1.0)
    sums = {
        "clip_sum": jnp.sum(t.clip_mask.astype(m.dtype) * m),
        "dual_clip_sum": jnp.sum(t.dual_clip_mask.astype(m.dtype) * m),
        "approx_kl_sum": jnp.sum(t.approx_kl * m),
        "ratio_sum": jax.lax.stop_gradient(jnp.sum(t.ratio * m)),
    }
    return loss, loss_metrics(loss_sum, loss_count, n_valid, sums)


def behaviour_weights(
    proximal_logprobs: jax.Array,
    behave_logprobs: jax.Array,
    mask: jax.Array,
    *,
    cap: float | None = None,
    mode: str = "truncate",
) -> tuple[jax.Array, jax.Array]:
    """Importance weights of the proximal policy over the behaviour policy, ``[B, T]``.

    ``w = exp(proximal_logprobs - behave_logprobs)`` on active tokens (no gradient), then, with a
    ``cap``:

    * ``"truncate"``: ``min(w, cap)`` (token-level truncated importance sampling);
    * ``"mask"``: 0 where ``w > cap`` (AReaL's token mask: the token leaves the numerator, not the
      denominator);
    * ``"mask_sequence"``: 0 on every token of a row whose sequence weight ``prod_t w_t`` is
      above ``cap``.

    Returns ``(weights, capped)``: the weights (0 where the mask is 0) and a bool ``[B, T]``, the
    active tokens the cap changed.
    """
    check_2d_same(proximal_logprobs=proximal_logprobs, behave_logprobs=behave_logprobs, mask=mask)
    check_choice("mode", mode, BEHAVIOUR_WEIGHT_MODES)
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    active = jnp.asarray(mask) > 0
    dtype = jnp.result_type(proximal_logprobs, jnp.float32)
    gap = jnp.where(active, jnp.asarray(proximal_logprobs, dtype) - jnp.asarray(behave_logprobs, dtype), 0.0)
    gap = jax.lax.stop_gradient(gap)
    w = jnp.where(active, jnp.exp(gap), 0.0)
    if cap is None:
        return w, jnp.zeros_like(active)
    if mode == "truncate":
        capped = active & (w > cap)
        return jnp.minimum(w, cap), capped
    if mode == "mask":
        capped = active & (w > cap)
    else:
        capped = active & (jnp.sum(gap, axis=1, keepdims=True) > jnp.log(cap))
    return jnp.where(capped, 0.0, w), capped


def decoupled_policy_loss(
    logprobs: jax.Array,
    proximal_logprobs: jax.Array,
    behave_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    agg: str = "token-mean",
    behave_cap: float | None = None,
    behave_mode: str = "truncate",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO (AReaL): the clipped loss around a proximal policy, importance-weighted from
    the behaviour policy that sampled the tokens.

    On active tokens, with ``r = exp(logprobs - proximal_logprobs)`` and ``w`` the
    ``behaviour_weights(proximal_logprobs, behave_logprobs, cap=behave_cap, mode=behave_mode)``::

        pg = w * max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))   # (dual clip as policy_loss)

    aggregated as ``policy_loss`` (``agg``). When the proximal and behaviour log-probs are the same
    array (synchronous training) ``w = 1`` and this is ``policy_loss(logprobs, behave_logprobs,
    ...)`` exactly. All inputs ``[B, T]``.

    Returns ``(loss, metrics)``: ``policy_loss``'s metrics (clip fraction and approx KL against the
    proximal policy) plus ``behave_gap_sum`` / ``behave_gap_max`` (``|proximal - behave|`` summed
    and largest over active tokens), ``behave_capped_sum`` (tokens the cap changed) and their
    means ``behave_gap`` / ``behave_capped_fraction``.
    """
    check_choice("agg", agg, LOSS_AGGREGATIONS)
    t = policy_loss_terms(logprobs, proximal_logprobs, advantages, mask,
                          eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip)
    w, capped = behaviour_weights(proximal_logprobs, behave_logprobs, mask, cap=behave_cap, mode=behave_mode)
    loss, metrics = _aggregate(t, t.pg_loss * w.astype(t.pg_loss.dtype), mask, agg)
    active = jnp.asarray(mask) > 0
    gap = jnp.where(active, jnp.abs(jnp.asarray(proximal_logprobs, w.dtype) - jnp.asarray(behave_logprobs, w.dtype)), 0.0)
    gap = jax.lax.stop_gradient(gap)
    n = jnp.maximum(metrics["n_valid_tokens"], 1.0)
    extra = {"behave_gap_sum": jnp.sum(gap), "behave_gap_max": jnp.max(gap, initial=0.0),
             "behave_capped_sum": jnp.sum(capped.astype(w.dtype))}
    extra["behave_gap"] = extra["behave_gap_sum"] / n
    extra["behave_capped_fraction"] = extra["behave_capped_sum"] / n
    return loss, {**metrics, **extra}


def loss_metrics(loss_sum: jax.Array, loss_count: jax.Array, n_valid: jax.Array,
                 sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The loss's metrics: the (sum, count) numerators that combine across microbatches and
    devices (``loss_sum``, ``loss_count``, ``n_valid_tokens``, ``clip_sum``, ``dual_clip_sum``,
    ``approx_kl_sum``, ``ratio_sum``) and their ratios over the valid tokens (``clip_fraction``,
    ``dual_clip_fraction``, ``approx_kl``, ``ratio_mean``)."""
    denom = jnp.maximum(n_valid, 1.0)
    return {
        "loss_sum": jax.lax.stop_gradient(loss_sum),
        "loss_count": loss_count,
        "n_valid_tokens": n_valid,
        **sums,
        "clip_fraction": sums["clip_sum"] / denom,
        "dual_clip_fraction": sums["dual_clip_sum"] / denom,
        "approx_kl": sums["approx_kl_sum"] / denom,
        "ratio_mean": sums["ratio_sum"] / denom,
    }
