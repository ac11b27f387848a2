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
from jaxprm.modes import GAE_METHODS

__all__ = ["gae", "GAE_METHODS", "gae_block_size"]

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
    so every weight ``g**(K_t - K_s)`` stays within ``g**-C <= 4``). For ``lam >= 1/2`` the value
    terms telescope (see ``_gae_blocked``): the sum runs over ``rewards + c values`` alone and the
    value at the first active step from ``t`` on is gathered into the output; for smaller ``lam``
    ``v_next`` is gathered first. Gather indices come from each chunk's activity bits (trailing-zero
    counts), never from a sequential search. Across chunks one carry per chunk remains
    (``A_k = L_k + g**n_k A_{k+1}``), combined by ``method``: ``"scan"`` a sequential ``lax.scan``
    (``unroll`` steps per iteration), ``"associative"`` a ``lax.associative_scan`` (O(log) depth),
    ``"cumsum"`` (only ``gamma == lam == 1``, the GRPO default) a reverse cumulative sum. With
    ``g == 1`` the combine is a plain sum and every method uses the blocked cumulative sum (two
    tiny matmul levels), so the methods differ only for ``g < 1``. When all values and bootstraps
    are 0 (GRPO without a critic) the gather is skipped at run time. All methods agree to float32
    rounding (float64 inputs: to float64 rounding).

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


def _all_zero(x: jax.Array) -> jax.Array:
    """``max(x) == 0 == min(x)`` in one variadic reduction (False for NaN)."""
    lo, hi = jax.lax.reduce((x, x), (jnp.array(jnp.inf, x.dtype), jnp.array(-jnp.inf, x.dtype)),
                            lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])), tuple(range(x.ndim)))
    return (lo == 0) & (hi == 0)


def _chunk_bits(valid: jax.Array, C: int) -> jax.Array:
    """``int32 [B, n]``: bit ``s`` of chunk ``k`` is ``valid[:, k * C + s]`` (``valid [B, n * C]``)."""
    B, T = valid.shape
    s = jnp.arange(C, dtype=jnp.int32)
    return jnp.sum(valid.reshape(B, T // C, C).astype(jnp.int32) << s, axis=-1, dtype=jnp.int32)


def _next_first(bits: jax.Array, C: int, none: int) -> jax.Array:
    """``int32 [B, n]``: the first active step in the chunks after ``k`` (``none`` if there is none):
    an exclusive suffix minimum over the chunks (a parallel prefix over time-major ``[n, B]``)."""
    B, n = bits.shape
    first = jnp.where(bits != 0, jnp.arange(n, dtype=jnp.int32) * C + _ctz(jnp.where(bits != 0, bits, 1)), none)
    after = jnp.concatenate([first[:, 1:], jnp.full((B, 1), none, jnp.int32)], axis=1)
    return jax.lax.associative_scan(jnp.minimum, after.T, reverse=True, axis=0).T


def _gae_blocked(r, v, act, boot, gamma, lam, C, method, unroll):
    """``[B, T]`` advantages (see ``gae``); ``act`` bool with the last column off.

    With ``F(t)`` the first active step at or after ``t``, ``n(t)`` the active steps from ``t`` on,
    ``e(t, s)`` the active steps in ``[t, s)`` and ``c = (1 - lam) / lam``, the GAE sum
    telescopes (for ``lam >= 1/2``) to::

        a_t = sum_{s >= t, active} g**e(t, s) (r_s + c v_s) - (1 + c) v_F(t) + gamma g**(n(t) - 1) boot

    (0 when no step from ``t`` on is active): one blocked discounted suffix sum of a single array,
    then a gather of ``v`` fused into the output. For ``lam < 1/2`` (``c`` would amplify rounding)
    the per-step ``delta = r - v + gamma v_next`` is summed instead, with ``v_next`` gathered first.
    """
    B, T = r.shape
    dt = r.dtype
    g = gamma * lam
    Tp = -(-T // C) * C
    if Tp != T:  # pad the tail with inactive steps (they change nothing before them)
        pad = ((0, 0), (0, Tp - T))
        r, v, act = jnp.pad(r, pad), jnp.pad(v, pad), jnp.pad(act, pad)
    n = Tp // C
    s = jnp.arange(C, dtype=jnp.int32)
    bits = _chunk_bits(act, C)  # [B, n]
    K = jax.lax.population_count(jnp.right_shift(bits[..., None], s))  # [B, n, C]: actives in [t, chunk end)
    # First active step of the chunks after k (Tp if none).
    next_first = _next_first(bits, C, Tp)
    chunk0 = jnp.arange(n, dtype=jnp.int32)[:, None] * C + s  # [n, C] step index

    def first_at_or_after(shift):
        """Index of the first active step at or after ``t + shift`` (``Tp`` if none), ``[B, n, C]``."""
        rest = jnp.right_shift(bits[..., None], s + shift)
        inside = chunk0 + shift + _ctz(jnp.where(rest != 0, rest, 1))
        return jnp.where(rest != 0, inside, next_first[..., None])

    def gather_v(idx):
        flat = jnp.minimum(idx, Tp - 1).reshape(B, Tp)
        return jnp.take_along_axis(v, flat, axis=1, mode="promise_in_bounds").reshape(B, n, C)

    values_matter = ~(_all_zero(v) & _all_zero(boot))
    telescoped = lam >= 0.5
    c = (1.0 - lam) / lam if telescoped else 0.0
    if telescoped:
        x = jnp.where(act, r + c * v, jnp.zeros((), dt)) if c else jnp.where(act, r, jnp.zeros((), dt))
    else:
        def with_values(_):
            v_next = jnp.where(first_at_or_after(1) < Tp, gather_v(first_at_or_after(1)), boot[:, None, None])
            return jnp.where(act, r - v + gamma * v_next.reshape(B, Tp), 0.0)

        x = jax.lax.cond(values_matter, with_values, lambda _: jnp.where(act, r, jnp.zeros((), dt)), None)
    # The suffix sum S = local + g**K * enter is formed inside each branch, in the output's fusion.
    parts = _suffix_sum(x.reshape(B, n, C), K, g, C, method, unroll)
    if telescoped:
        def add_values(parts):
            idx = first_at_or_after(0)
            has = idx < Tp
            count = K + _reverse_cumsum(jax.lax.population_count(bits))[..., None] - \
                jax.lax.population_count(bits)[..., None]  # actives from t to the row end
            tail = gamma * _powers(g, jnp.maximum(count - 1, 0), dt) * boot[:, None, None]
            return jnp.where(has, _total(parts, K, g) - (1.0 + c) * gather_v(idx) + tail, 0.0)

        S = jax.lax.cond(values_matter, add_values, lambda parts: _total(parts, K, g), parts)
    else:
        S = _total(parts, K, g)
    return S.reshape(B, Tp)[:, :T]


def _suffix_sum(x, K, g, C, method, unroll):
    """Parts ``(local, enter)`` of ``S[t] = sum_{s >= t} g**e(t, s) x[s]`` over whole rows of
    ``x [B, n, C]`` (``K`` the actives in ``[t, chunk end)``; ``S = _total(...)``): one ``[C, C]``
    triangular matmul per chunk for ``local`` (the sum inside the chunk), one carry per chunk."""
    dt = x.dtype
    s = jnp.arange(C)
    tri = (s[:, None] >= s[None, :]).astype(dt)  # tri[s, t] = [s >= t]: a reverse cumsum
    if g == 1.0:
        local = jnp.einsum("bks,st->bkt", x, tri)
        return local, _reverse_affine(local[..., 0], None, method, unroll)
    # Inside a chunk: sum_s g**(K_t - K_s) x_s = g**K_t * tri-sum of x_s g**-K_s, with
    # g**-K_s <= g**-C <= 4 (gae_block_size); one step per chunk needs no matmul.
    gk = _powers(g, K, dt)
    local = x if C == 1 else gk * jnp.einsum("bks,st->bkt", x / gk, tri)
    # Chunk k maps the sum entering it from the right, A, to local + g**K * A.
    return local, _reverse_affine(local[..., 0], gk[..., 0], method, unroll)


def _total(parts, K, g):
    """``local + g**K * enter`` (``enter`` broadcast over each chunk)."""
    local, enter = parts
    return local + (enter[..., None] if g == 1.0 else _powers(g, K, local.dtype) * enter[..., None])


def _powers(g: float, k: jax.Array, dtype) -> jax.Array:
    """``g ** k`` for int ``k >= 0`` (``0 ** 0 = 1``)."""
    if g <= 0.0:
        return (k == 0).astype(dtype)
    if g == 1.0:
        return jnp.ones(k.shape, dtype)
    return jnp.exp(math.log(g) * k.astype(dtype))


def _reverse_affine(start, decay, method, unroll):
    """``A[k] = start[k+1] + decay[k+1] * A[k+1]``, ``A[n-1] = 0`` over ``[B, n]`` (``decay`` None
    means 1). Returns ``A`` (the sum entering each chunk from its right)."""
    B, n = start.shape
    dt = start.dtype
    if n == 1:
        return jnp.zeros_like(start)
    if decay is None:  # gamma * lam == 1: the combine is a plain suffix sum, blocked again
        return _reverse_cumsum(start) - start
    # Shift by one chunk: the map applied before entering chunk k is chunk k+1's.
    st = jnp.concatenate([start[:, 1:], jnp.zeros((B, 1), dt)], axis=1).T  # time-major [n, B]
    dc = None if decay is None else jnp.concatenate([decay[:, 1:], jnp.ones((B, 1), dt)], axis=1).T
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

    def step(a, xs):
        c, d = xs
        a = c + (a if d is None else d * a)
        return a, a

    _, out = jax.lax.scan(step, jnp.zeros((B,), dt), (st, dc), reverse=True, unroll=min(unroll, n))
    return out.T


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
