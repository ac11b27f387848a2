"""Token-level generalized advantage estimation over masked, right-padded rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_2d_same, check_choice, check_float, check_rank
from jaxprm.learner.modes import GAE_METHODS

__all__ = ["gae", "GAE_METHODS"]



def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    method: str = "scan",
    bootstrap_values: jax.Array | None = None,
    unroll: int = 16,
) -> tuple[jax.Array, jax.Array]:
    """Masked token-level GAE (AReaL semantics), in prediction positions.

    Backward over ``t = T-2 .. 0`` with running advantage ``a`` (starts 0) and next value ``v``
    (starts ``bootstrap_values``, 0 by default)::

        if mask[t]:  a = rewards[t] + gamma * v - values[t] + gamma * lam * a;  v = values[t]
        else:        a, v unchanged            (prompt / tool / padding positions are skipped)
        advantages[t] = a

    ``advantages[:, T-1] = 0`` and ``returns = advantages + values`` everywhere. Rewards and values
    at masked positions are ignored. A row that ended with EOS bootstraps from 0; pass the value
    at a truncated row's last position as ``bootstrap_values`` to bootstrap it.

    ``method="scan"`` is a sequential ``lax.scan``; ``method="associative"`` composes the per-step
    affine maps ``(a, v) -> M_t (a, v) + c_t`` with ``lax.associative_scan`` (O(log T) depth);
    ``method="cumsum"`` (only for ``gamma == lam == 1``, the GRPO default) uses the telescoped
    closed form ``a_t = sum_{s >= t} mask_s r_s + v_boot - v_first(t)``, where ``v_first(t)`` is
    the value at the first active position at or after ``t`` (0 and no bootstrap if none): two
    vectorized reverse scans instead of a sequential loop. All agree to float32 rounding.

    Args:
      rewards, values, mask: ``[B, T]`` (mask 0/1, any numeric dtype).
      gamma, lam: discount and GAE lambda.
      bootstrap_values: optional ``[B]`` value after the last column.
    Returns:
      ``(advantages, returns)``, each ``[B, T]`` in the floating dtype of ``rewards``/``values``.
    """
    check_choice("method", method, GAE_METHODS)
    check_2d_same(rewards=rewards, values=values, mask=mask)
    check_float("rewards", rewards)
    dtype = jnp.result_type(rewards, values, jnp.float32)
    rewards = jnp.asarray(rewards, dtype)
    values = jnp.asarray(values, dtype)
    m = jnp.asarray(mask) > 0
    B, T = rewards.shape
    if bootstrap_values is None:
        boot = jnp.zeros((B,), dtype)
    else:
        check_rank("bootstrap_values", bootstrap_values, 1)
        if jnp.shape(bootstrap_values) != (B,):
            raise ValueError(f"bootstrap_values must have shape ({B},), got {jnp.shape(bootstrap_values)}")
        boot = jnp.asarray(bootstrap_values, dtype)
    if T == 0:
        return rewards, values
    if method == "cumsum" and not (gamma == 1.0 and lam == 1.0):
        raise ValueError(f"method='cumsum' needs gamma == lam == 1, got gamma={gamma}, lam={lam}")
    fn = {"scan": _gae_scan, "associative": _gae_associative, "cumsum": _gae_cumsum}[method]
    adv_head = fn(rewards[:, :-1], values[:, :-1], m[:, :-1], boot, gamma, lam, unroll)
    advantages = jnp.pad(adv_head, ((0, 0), (0, 1)))
    return advantages, advantages + values


def _gae_scan(r, v, m, boot, gamma, lam, unroll):
    def step(carry, x):
        a, nv = carry
        r_t, v_t, m_t = x
        new_a = r_t + gamma * nv - v_t + gamma * lam * a
        a = jnp.where(m_t, new_a, a)
        nv = jnp.where(m_t, v_t, nv)
        return (a, nv), a

    init = (jnp.zeros_like(boot), boot)
    xs = (r.T, v.T, m.T)  # scan over time: [T-1, B]
    _, adv = jax.lax.scan(step, init, xs, reverse=True, unroll=max(1, min(unroll, max(r.shape[1], 1))))
    return adv.T


def _gae_associative(r, v, m, boot, gamma, lam, unroll):
    del unroll
    # Step t maps (a, nv) -> (p a + q nv + c0, s nv + c1): an upper-triangular affine map.
    #   masked:  p = gamma*lam, q = gamma, s = 0, c0 = r - v, c1 = v
    #   skipped: p = 1, q = 0, s = 1, c0 = c1 = 0
    one = jnp.ones_like(r)
    zero = jnp.zeros_like(r)
    p = jnp.where(m, gamma * lam * one, one)
    q = jnp.where(m, gamma * one, zero)
    s = jnp.where(m, zero, one)
    c0 = jnp.where(m, r - v, zero)
    c1 = jnp.where(m, v, zero)

    def compose(first, second):
        # ``first`` acts on the state before ``second`` (it is later in time): second o first.
        p1, q1, s1, a1, b1 = first
        p2, q2, s2, a2, b2 = second
        return (p2 * p1, p2 * q1 + q2 * s1, s2 * s1, p2 * a1 + q2 * b1 + a2, s2 * b1 + b2)

    P, Q, S, C0, C1 = jax.lax.associative_scan(compose, (p, q, s, c0, c1), reverse=True, axis=1)
    del P, S, C1
    return Q * boot[:, None] + C0


def _gae_cumsum(r, v, m, boot, gamma, lam, unroll):
    del gamma, lam, unroll
    T1 = r.shape[1]
    if T1 == 0:
        return r
    tail = jax.lax.cumsum(jnp.where(m, r, 0.0), axis=1, reverse=True)
    # Index of the first active position at or after t (T1 if none).
    first = jax.lax.cummin(jnp.where(m, jnp.arange(T1, dtype=jnp.int32), T1), axis=1, reverse=True)
    # Keep XLA from fusing the window reductions into their consumers (it would recompute them).
    tail, first = jax.lax.optimization_barrier((tail, first))
    has = first < T1
    v_first = jnp.take_along_axis(v, jnp.minimum(first, T1 - 1), axis=1)
    return jnp.where(has, tail + boot[:, None] - v_first, 0.0)
