"""PPO / GRPO clipped policy loss with masked (sum, count) aggregation."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_2d_same, check_choice, check_float
from jaxprm.modes import LOSS_AGGREGATIONS

__all__ = ["policy_loss", "policy_loss_terms", "PolicyLossTerms", "LOSS_AGGREGATIONS"]



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
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
    if eps_clip < 0 or (eps_clip_higher is not None and eps_clip_higher < 0):
        raise ValueError(f"eps_clip / eps_clip_higher must be >= 0, got {eps_clip}, {eps_clip_higher}")
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
      mask: ``[B, T]`` loss mask.
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
    m = (jnp.asarray(mask) > 0).astype(t.pg_loss.dtype)
    n_valid = jnp.sum(m)
    row_cnt = jnp.sum(m, axis=1)
    row_sum = jnp.sum(t.pg_loss, axis=1)
    if agg == "token-mean":
        loss_sum, loss_count = jnp.sum(row_sum), n_valid
    else:
        has = row_cnt > 0
        per_row = row_sum / jnp.maximum(row_cnt, 1.0) if agg == "seq-mean-token-mean" else row_sum
        loss_sum = jnp.sum(jnp.where(has, per_row, 0.0))
        loss_count = jnp.sum(has.astype(t.pg_loss.dtype))
    loss = loss_sum / jnp.maximum(loss_count, 1.0)
    sums = {
        "clip_sum": jnp.sum(t.clip_mask.astype(m.dtype)),
        "dual_clip_sum": jnp.sum(t.dual_clip_mask.astype(m.dtype)),
        "approx_kl_sum": jnp.sum(t.approx_kl),
        "ratio_sum": jax.lax.stop_gradient(jnp.sum(t.ratio)),
    }
    return loss, loss_metrics(loss_sum, loss_count, n_valid, sums)


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
