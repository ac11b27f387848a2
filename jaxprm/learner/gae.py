"""Token-level generalized advantage estimation over masked, right-padded rows.

The recursion is sequential in time, but XLA moves data fastest in a few wide passes, so every
method runs *blocked*: the time axis is cut into chunks of ``C`` steps (``[B, T] -> [B, T/C, C]``,
a free reshape, no transpose), each chunk is solved locally with one small triangular matmul, and
only one number per chunk is carried across chunks. The methods differ in how that carry is
combined (sequential, parallel prefix, or the ``gamma == lam == 1`` closed form).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_2d_same, check_choice, check_float, check_rank

__all__ = ["gae", "GAE_METHODS", "gae_block_size"]

GAE_METHODS = ("scan", "associative", "cumsum")
_MAX_BLOCK = 16  # chunk length; the activity bits of a chunk fit an int32
_MAX_SCALE = 4.0  # largest (gamma*lam)**-C allowed inside a chunk (bounds the rounding growth)


def gae_block_size(gamma: float, lam: float) -> int:
    """The chunk length ``C`` used for ``gamma * lam``: the largest of 16, 8, 4, 2, 1 with
    ``(gamma * lam) ** -C <= 4`` (16 for ``gamma * lam >= 0.917``; 1 when it is 0)."""
    g = float(gamma) * float(lam)
    if g >= 1.0:
        return _MAX_BLOCK
    if g <= 0.0:
        return 1
    c = _MAX_BLOCK
    while c > 1 and -c * math.log(g) > math.log(_MAX_SCALE):
        c //= 2
    return c


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

    Closed form used by every method, with ``g = gamma * lam``, ``e(t, s)`` the number of active
    positions in ``[t, s)`` and ``v_next(s)`` the value at the first active position after ``s``
    (``bootstrap_values`` if none)::

        a_t = sum_{s >= t, mask[s]} g**e(t, s) * (rewards[s] - values[s] + gamma * v_next(s))

    Time is cut into chunks of ``C = gae_block_size(gamma, lam)`` steps. Inside a chunk the sum is
    one ``[C, C]`` triangular matmul over ``x_s g**-K_s`` (``K`` = active count to the chunk end,
    so every weight ``g**(K_t - K_s)`` stays within ``g**-C <= 4``); ``v_next`` is one gather whose
    index comes from each chunk's activity bits. Across chunks one carry per chunk remains
    (``A_k = L_k + g**n_k A_{k+1}``), combined by ``method``: ``"scan"`` a sequential ``lax.scan``
    (``unroll`` steps per iteration), ``"associative"`` a ``lax.associative_scan`` (O(log) depth),
    ``"cumsum"`` (only ``gamma == lam == 1``, the GRPO default) a reverse cumulative sum. When all
    values and bootstraps are 0 (GRPO without a critic) the gather is skipped at run time. All
    methods agree to float32 rounding (float64 inputs: to float64 rounding).

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
    # The last column is never active: its advantage is the initial carry, 0.
    active = (jnp.asarray(mask) > 0) & (jnp.arange(T) < T - 1)[None, :]
    advantages = _gae_blocked(rewards, values, active, boot, float(gamma), float(lam),
                              gae_block_size(gamma, lam), method, max(1, int(unroll)))
    return advantages, advantages + values


def _ctz(x: jax.Array) -> jax.Array:
    """Trailing zero count of nonzero int32 ``x`` (popcount of the bits below the lowest set bit)."""
    return jax.lax.population_count((x & (-x)) - 1)


def _gae_blocked(r, v, act, boot, gamma, lam, C, method, unroll):
    """``[B, T]`` advantages (see ``gae``); ``act`` bool with the last column off."""
    B, T = r.shape
    dt = r.dtype
    g = gamma * lam
    Tp = -(-T // C) * C
    if Tp != T:  # pad the tail with inactive steps (they change nothing before them)
        pad = ((0, 0), (0, Tp - T))
        r, v, act = jnp.pad(r, pad), jnp.pad(v, pad), jnp.pad(act, pad)
    n = Tp // C
    s = jnp.arange(C, dtype=jnp.int32)
    a3 = act.reshape(B, n, C)
    # Activity bits of each chunk, and K[t] = active steps in [t, chunk end).
    bits = jnp.sum(a3.astype(jnp.int32) << s, axis=-1, dtype=jnp.int32)  # [B, n]
    K = jax.lax.population_count(jnp.right_shift(bits[..., None], s))  # [B, n, C]

    def deltas_with_values(_):
        # v_next(t): the value at the first active step after t (bootstrap if none).
        first = _ctz(jnp.where(bits != 0, bits, 1))  # first active offset of each chunk
        first_v = jnp.take_along_axis(v.reshape(B, n, C), first[..., None], axis=2, mode="promise_in_bounds")[..., 0]
        has = bits != 0
        # Value entering chunk k from the right: first active value in chunks > k, else boot.
        enter = _reverse_last_valid(first_v, has, boot, method, unroll)  # [B, n]
        later = jnp.right_shift(bits[..., None], s + 1)  # actives after t in the chunk
        offset = s + 1 + _ctz(jnp.where(later != 0, later, 1))
        inside = jnp.take_along_axis(v.reshape(B, n, C), jnp.minimum(offset, C - 1), axis=2,
                                     mode="promise_in_bounds")
        v_next = jnp.where(later != 0, inside, enter[..., None]).reshape(B, Tp)
        return jnp.where(act, r - v + gamma * v_next, 0.0)

    def deltas_without_values(_):
        # All values and bootstraps are 0: v_next is 0 too.
        return jnp.where(act, r, jnp.zeros((), dt))

    needs_values = jnp.any(act & (v != 0)) | jnp.any(boot != 0)
    d3 = jax.lax.cond(needs_values, deltas_with_values, deltas_without_values, None).reshape(B, n, C)

    tri = (s[:, None] >= s[None, :]).astype(dt)  # tri[s, t] = [s >= t]: a reverse cumsum
    if g == 1.0:
        local = jnp.einsum("bks,st->bkt", d3, tri)
        adv = local + _reverse_affine(local[..., 0], None, method, unroll)[..., None]
    else:
        # Inside a chunk: sum_s g**(K_t - K_s) d_s = g**K_t * tri-sum of d_s g**-K_s, with
        # g**-K_s <= g**-C <= 4 (gae_block_size); one step per chunk needs no matmul.
        gk = _powers(g, K, dt)
        local = d3 if C == 1 else gk * jnp.einsum("bks,st->bkt", d3 / gk, tri)
        # Chunk k maps the advantage entering it from the right, A, to local + g**K * A.
        enter = _reverse_affine(local[..., 0], gk[..., 0], method, unroll)
        adv = local + gk * enter[..., None]
    return adv.reshape(B, Tp)[:, :T]


def _powers(g: float, k: jax.Array, dtype) -> jax.Array:
    """``g ** k`` for small int ``k >= 0`` (``0 ** 0 = 1``)."""
    if g <= 0.0:
        return (k == 0).astype(dtype)
    return jnp.exp(math.log(g) * k.astype(dtype))


def _reverse_affine(start, decay, method, unroll):
    """``A[k] = start[k+1] + decay[k+1] * A[k+1]``, ``A[n-1] = 0`` over ``[B, n]`` (``decay`` None
    means 1). Returns ``A`` (the advantage entering each chunk from its right)."""
    B, n = start.shape
    dt = start.dtype
    if n == 1:
        return jnp.zeros_like(start)
    # Shift by one chunk: the map applied before entering chunk k is chunk k+1's.
    st = jnp.concatenate([start[:, 1:], jnp.zeros((B, 1), dt)], axis=1).T  # time-major [n, B]
    dc = None if decay is None else jnp.concatenate([decay[:, 1:], jnp.ones((B, 1), dt)], axis=1).T
    if method == "cumsum":  # gamma == lam == 1: a reverse cumulative sum, blocked again
        return _reverse_cumsum(jnp.concatenate([start[:, 1:], jnp.zeros((B, 1), dt)], axis=1))
    if method == "associative":
        if dc is None:
            dc = jnp.ones_like(st)

        def compose(later, earlier):
            # ``later`` is applied first (it is to the right in time): earlier o later.
            d1, c1 = later
            d2, c2 = earlier
            return d2 * d1, c2 + d2 * c1

        _, out = jax.lax.associative_scan(compose, (dc, st), reverse=True, axis=0)
        return out.T
    return _scan_affine(st, dc, unroll).T


def _reverse_cumsum(x):
    """``out[:, k] = sum_{j >= k} x[:, j]`` for ``[B, n]``: ``[C, C]`` triangular matmuls per block of
    ``C = 16`` columns, recursing on the block totals (a few tiny levels)."""
    B, n = x.shape
    C = _MAX_BLOCK
    if n <= C:
        i = jnp.arange(n)
        return x @ (i[:, None] >= i[None, :]).astype(x.dtype)
    m = -(-n // C)
    xp = jnp.pad(x, ((0, 0), (0, m * C - n))).reshape(B, m, C)
    i = jnp.arange(C)
    local = jnp.einsum("bks,st->bkt", xp, (i[:, None] >= i[None, :]).astype(x.dtype))
    tot = local[..., 0]
    after = _reverse_cumsum(tot) - tot  # sum over the blocks to the right
    return (local + after[..., None]).reshape(B, m * C)[:, :n]


def _scan_affine(st, dc, unroll):
    """Sequential ``A[k] = st[k] + dc[k] * A[k+1]`` over time-major ``[n, B]`` (``dc`` None: 1)."""
    n, B = st.shape

    def step(a, x):
        c, d = x
        a = c + (a if d is None else d * a)
        return a, a

    _, out = jax.lax.scan(step, jnp.zeros((B,), st.dtype), (st, dc), reverse=True, unroll=min(unroll, n))
    return out


def _reverse_last_valid(x, valid, boot, method, unroll):
    """``out[k]`` = ``x`` at the first valid chunk ``> k`` (``boot`` if none), over ``[B, n]``."""
    B, n = x.shape
    xs = jnp.concatenate([x[:, 1:], jnp.zeros((B, 1), x.dtype)], axis=1).T
    vs = jnp.concatenate([valid[:, 1:], jnp.zeros((B, 1), bool)], axis=1).T
    if method == "associative":
        def pick(later, earlier):
            x1, v1 = later
            x2, v2 = earlier
            return jnp.where(v2, x2, x1), v1 | v2

        out, found = jax.lax.associative_scan(pick, (xs, vs), reverse=True, axis=0)
        return jnp.where(found, out, boot[None, :]).T

    def step(cur, inp):
        xv, ok = inp
        cur = jnp.where(ok, xv, cur)
        return cur, cur

    _, out = jax.lax.scan(step, boot, (xs, vs), reverse=True, unroll=min(unroll, n))
    return out.T
