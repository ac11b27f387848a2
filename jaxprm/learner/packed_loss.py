"""The policy loss on tree-packed tokens, equal to the flat rows' loss (``jaxprm.learner.packing``).

The loss stays exact (``pack_advantages`` + ``packed_policy_loss``): a shared token has one ratio
``r`` but one advantage ``A_l`` per leaf ``l`` below it, and the clipped per-token loss is
``pg(A, r) = -A+ f+(r) + A- f-(r)`` with ``f+(r) = min(r, 1 + eps_high)`` and
``f-(r) = max(r, 1 - eps)`` (``min(., c_clip)`` with the dual clip), ``A+ = max(A, 0)``,
``A- = max(-A, 0)``. So ``sum_l w_l pg(A_l, r) = -P f+(r) + N f-(r)`` with
``P = sum_l w_l A_l+`` and ``N = sum_l w_l A_l-``: two numbers per packed token, plus the number
of (token, leaf) pairs for the aggregation denominators and metrics. ``w_l`` is 1 for
``token-mean`` and ``seq-mean-token-sum`` and ``1 / n_l`` (the leaf's active token count) for
``seq-mean-token-mean``. Advantages themselves (KL reward, GAE with per-leaf values,
normalization, process-reward shaping) are computed on the flat rows, where nothing changes.

Per-token arrays here are token-aligned like the ``PackedBatch``'s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_2d_same, check_choice, check_clip, check_float
from jaxprm.learner.loss import loss_metrics
from jaxprm.modes import LOSS_AGGREGATIONS
from jaxprm.learner.packing import PackedBatch

__all__ = ["PackedAdvantages", "pack_advantages", "packed_policy_loss", "packed_logprobs"]


def packed_logprobs(logits: jax.Array, tokens: jax.Array, parents: jax.Array) -> jax.Array:
    """Token-aligned log-probs in a packed row: ``out[r, j] = log_softmax(logits[r, parents[r, j]])
    [tokens[r, j]]`` in float32, 0 where ``parents`` is -1. Shapes: ``[R, L, V], [R, L], [R, L]
    -> [R, L]``."""
    R, L, V = logits.shape
    par = jnp.maximum(parents, 0)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [R, L]
    flat = logits.reshape(R, L * V)
    picked = jnp.take_along_axis(flat, (par * V + tokens.astype(jnp.int32)), axis=1).astype(jnp.float32)
    out = picked - jnp.take_along_axis(lse, par, axis=1)
    return jnp.where(parents >= 0, out, 0.0)


class PackedAdvantages(NamedTuple):
    """Per packed token (``[R, L]``, token-aligned) sums over the flat (token, leaf) pairs."""

    pos: jax.Array  # sum_l w_l max(A_l, 0)
    neg: jax.Array  # sum_l w_l max(-A_l, 0)
    count: jax.Array  # number of (token, leaf) pairs
    n_pos: jax.Array  # pairs with A_l > 0
    n_neg: jax.Array  # pairs with A_l < 0
    row_leaves: jax.Array  # [R] leaves with an active token in each packed row


def pack_advantages(
    advantages: jax.Array, mask: jax.Array, packed: PackedBatch, *, agg: str = "token-mean"
) -> PackedAdvantages:
    """Reduce flat per-(row, position) advantages onto the packed tokens.

    With ``m`` the flat mask (``[B, T]``, e.g. ``loss_mask * row_weights``, or per-token weights
    as ``jaxprm.policy_loss`` takes them) and ``w_b`` = 1, or
    ``1 / sum_t m[b, t]`` for ``agg="seq-mean-token-mean"``: ``pos[j] = sum_{(b, t) -> j} m w_b
    max(A, 0)``, ``neg`` likewise with ``max(-A, 0)``, ``count[j] = sum m``, ``n_pos``/``n_neg``
    the pairs with ``A > 0``/``A < 0``, ``row_leaves[r]`` the flat rows with an active entry
    mapped to packed row ``r``. Segment sums over ``R * L`` slots.
    """
    check_choice("agg", agg, LOSS_AGGREGATIONS)
    check_2d_same(advantages=advantages, mask=mask, flat_index=packed.flat_index)
    check_float("advantages", advantages)
    R, L = packed.tokens.shape
    dt = jnp.result_type(advantages, jnp.float32)
    A = jax.lax.stop_gradient(jnp.asarray(advantages, dt))
    m = jnp.asarray(mask, dt)
    m = jnp.where((m > 0) & (packed.flat_index >= 0), m, 0.0)  # 0/1 or per-token weights
    n_row = jnp.sum(m, axis=1)
    w = 1.0 / jnp.maximum(n_row, 1.0) if agg == "seq-mean-token-mean" else jnp.ones_like(n_row)
    seg = jnp.where(m > 0, packed.flat_index, R * L).reshape(-1)

    def ssum(x):
        return jax.ops.segment_sum(x.reshape(-1), seg, num_segments=R * L + 1)[:-1].reshape(R, L)

    mw = m * w[:, None]
    row_of = jnp.where((n_row > 0) & (packed.flat_rows >= 0), packed.flat_rows, R)
    return PackedAdvantages(
        pos=ssum(mw * jnp.maximum(A, 0.0)),
        neg=ssum(mw * jnp.maximum(-A, 0.0)),
        count=ssum(m),
        n_pos=ssum(m * (A > 0)),
        n_neg=ssum(m * (A < 0)),
        row_leaves=jax.ops.segment_sum(jnp.ones_like(n_row), row_of, num_segments=R + 1)[:-1],
    )


def packed_policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    adv: PackedAdvantages,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    agg: str = "token-mean",
    weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``jaxprm.policy_loss`` of the flat rows, computed on packed tokens (exact).

    With ``r = exp(logprobs - old_logprobs)`` on tokens with ``count > 0``::

        f+ = min(r, 1 + eps_clip_higher);   f- = max(r, 1 - eps_clip)   (min(f-, c_clip) if given)
        loss_sum = sum_j (-pos_j f+ + neg_j f-)

    ``loss_count`` is ``sum count`` for ``token-mean`` and ``sum row_leaves`` for the seq-mean
    modes (whose ``1 / n_l`` weights ``pack_advantages`` already applied). Metrics match
    ``policy_loss`` on the flat rows: ``clip_sum = sum n_pos [r > 1 + eps_high] + n_neg
    [r < 1 - eps]``, ``dual_clip_sum = sum n_neg [max(r, 1 - eps) > c_clip]``, ``approx_kl_sum``
    and ``ratio_sum`` weighted by ``count``, ``n_valid_tokens = sum count``.

    With ``weights`` ``[R, L]`` (per packed token, no gradient: ``jaxprm.behaviour_weights`` of a
    token-level mode) each token's term is multiplied by its weight, which is
    ``jaxprm.decoupled_policy_loss`` of the flat rows when ``old_logprobs`` are the proximal ones
    (a shared token has one weight for all its leaves).

    Args:
      logprobs, old_logprobs: ``[R, L]`` token-aligned (differentiable w.r.t. ``logprobs``).
      adv: from ``pack_advantages`` with the same ``agg``.
    """
    check_choice("agg", agg, LOSS_AGGREGATIONS)
    check_2d_same(logprobs=logprobs, old_logprobs=old_logprobs, pos=adv.pos, neg=adv.neg, count=adv.count)
    check_float("logprobs", logprobs)
    check_clip(eps_clip, eps_clip_higher, c_clip)
    hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    active = adv.count > 0
    dt = jnp.result_type(logprobs, jnp.float32)
    logp = jnp.asarray(logprobs, dt)
    log_ratio = jnp.where(active, logp - jax.lax.stop_gradient(jnp.asarray(old_logprobs, dt)), 0.0)
    ratio = jnp.where(active, jnp.exp(log_ratio), 0.0)
    f_pos = jnp.minimum(ratio, 1.0 + hi)
    f_neg = jnp.maximum(ratio, 1.0 - eps_clip)
    if c_clip is not None:
        dual = jax.lax.stop_gradient(f_neg) > c_clip
        f_neg = jnp.minimum(f_neg, c_clip)
    else:
        dual = jnp.zeros_like(active)
    pg = jnp.where(active, -adv.pos * f_pos + adv.neg * f_neg, 0.0)
    if weights is not None:
        check_2d_same(logprobs=logprobs, weights=weights)
        pg = pg * jax.lax.stop_gradient(jnp.asarray(weights, dt))
    loss_sum = jnp.sum(pg)
    n_valid = jnp.sum(adv.count)
    loss_count = n_valid if agg == "token-mean" else jnp.sum(adv.row_leaves)
    loss = loss_sum / jnp.maximum(loss_count, 1.0)
    r = jax.lax.stop_gradient(ratio)
    clip = adv.n_pos * (r > 1.0 + hi) + adv.n_neg * ((r < 1.0 - eps_clip) & active)
    approx_kl = jnp.where(active, jnp.expm1(log_ratio) - log_ratio, 0.0)
    sums = {
        "clip_sum": jnp.sum(clip),
        "dual_clip_sum": jnp.sum(adv.n_neg * dual),
        "approx_kl_sum": jax.lax.stop_gradient(jnp.sum(adv.count * approx_kl)),
        "ratio_sum": jnp.sum(adv.count * r),
    }
    return loss, loss_metrics(loss_sum, loss_count, n_valid, sums)
