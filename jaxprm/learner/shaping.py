"""Process-reward advantage shaping (direct mode): applied after GAE and normalization."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import assert_all, check_2d_same, check_choice, check_float
from jaxprm.modes import SHAPING_MODES

__all__ = ["shape_advantages", "validate_process_rewards", "SHAPING_MODES"]



def validate_process_rewards(process_rewards: jax.Array, mask: jax.Array, *, mode: str) -> jax.Array:
    """``bool [B]``: the row's process rewards are valid for ``mode``.

    Every mode needs finite rewards on active tokens; ``process_weighted`` needs them in [0, 1].
    Jittable, never raises: use it to filter or report inside your own jitted code.
    """
    check_choice("mode", mode, SHAPING_MODES)
    p = jnp.asarray(process_rewards)
    active = jnp.asarray(mask) > 0
    ok = jnp.abs(p) < jnp.inf  # finite
    if mode == "process_weighted":
        ok = ok & (p >= 0) & (p <= 1)
    return jnp.all(ok | ~active, axis=-1)


def shape_advantages(
    advantages: jax.Array,
    process_rewards: jax.Array,
    mask: jax.Array,
    *,
    mode: str,
    negative_scale: float = 0.2,
    zero_penalty: float = 0.4,
    zero_eps: float = 1e-6,
    validate: bool = True,
) -> jax.Array:
    """Combine outcome advantages ``A`` with process rewards ``p`` (both ``[B, T]``, prediction
    positions, ``p`` already multiplied by the mask).

    * ``"additive"``: ``A + p``.
    * ``"gvpo"``: where ``p < 0`` on an active token: ``A < -zero_eps -> (1 + negative_scale) A``;
      ``|A| <= zero_eps -> -zero_penalty``; ``A > zero_eps -> 0``. Elsewhere ``A`` is unchanged.
    * ``"process_weighted"``: on active tokens (``p`` must be in [0, 1]): ``A >= 0 -> A p``;
      ``A < 0 -> p`` if ``p > 0`` else ``A``. Masked positions keep ``A``.

    With ``validate=True`` a process reward that is not finite, or outside [0, 1] for
    ``process_weighted``, on an active token raises ``ValueError`` (eagerly), or under ``jit`` a
    ``jax.errors.JaxRuntimeError`` carrying the same message (a host callback). ``validate=False``
    skips the check (see ``validate_process_rewards`` for a jittable flag).

    Returns:
      ``[B, T]`` in the dtype of ``advantages`` (float32 at least).
    """
    check_choice("mode", mode, SHAPING_MODES)
    check_2d_same(advantages=advantages, process_rewards=process_rewards, mask=mask)
    check_float("advantages", advantages)
    check_float("process_rewards", process_rewards)
    dtype = jnp.result_type(advantages, jnp.float32)
    A = jnp.asarray(advantages, dtype)
    p = jnp.asarray(process_rewards, dtype)
    active = jnp.asarray(mask) > 0
    if validate:
        # One fused reduction (no [B, T] flag array): is any active reward invalid?
        bad = ~(jnp.abs(p) < jnp.inf)  # non-finite (a compare: XLA's is-finite is not vectorized)
        if mode == "process_weighted":
            bad = bad | (p < 0) | (p > 1)
        ok = jnp.max(jnp.where(active & bad, 1.0, 0.0)) == 0
        rule = "in [0, 1]" if mode == "process_weighted" else "finite"
        assert_all(ok, f"shape_advantages(mode={mode!r}): process_rewards must be {rule} on every "
                        "active token (mask > 0)")
    if mode == "additive":
        return A + p
    if mode == "gvpo":
        penalized = active & (p < 0)
        shaped = jnp.where(A < -zero_eps, (1.0 + negative_scale) * A,
                           jnp.where(A > zero_eps, jnp.zeros_like(A), -zero_penalty * jnp.ones_like(A)))
        return jnp.where(penalized, shaped, A)
    shaped = jnp.where(A >= 0, A * p, jnp.where(p > 0, p, A))
    return jnp.where(active, shaped, A)
