"""Argument checks shared by the kernels: clear errors naming the argument and allowed values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import chex
import jax
import jax.numpy as jnp


def check_choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """Raise ``ValueError`` if ``value`` is not one of ``allowed`` (names both)."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {allowed}")


def check_rank(name: str, x: Any, rank: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``x`` has rank ``rank`` (``chex.assert_rank``)."""
    try:
        chex.assert_rank(x, rank)
    except AssertionError:
        raise ValueError(f"{name} must have rank {rank}, got shape {jnp.shape(x)} (rank {jnp.ndim(x)})") from None


def check_same_shape(**arrays: Any) -> None:
    """Raise ``ValueError`` unless all named arrays share one shape (``chex.assert_equal_shape``)."""
    try:
        chex.assert_equal_shape(list(arrays.values()))
    except AssertionError:
        detail = ", ".join(f"{k}{tuple(jnp.shape(v))}" for k, v in arrays.items())
        raise ValueError(f"shape mismatch: {detail}") from None


def check_2d_same(**arrays: Any) -> None:
    """Each array is ``[B, T]`` and all shapes agree."""
    for k, v in arrays.items():
        check_rank(k, v, 2)
    check_same_shape(**arrays)


def check_float(name: str, x: Any) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``x`` is floating point (``chex.assert_type``)."""
    try:
        chex.assert_type(jnp.asarray(x) if not hasattr(x, "dtype") else x, float)
    except AssertionError:
        raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}") from None


def check_clip(eps_clip: float, eps_clip_higher: float | None, c_clip: float | None) -> None:
    """The PPO clip range ``[1 - eps_clip, 1 + (eps_clip_higher or eps_clip)]`` (both >= 0) and the
    dual clip ``c_clip > 1`` (or ``None``): ``ValueError`` otherwise."""
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(f"c_clip must be > 1 (dual clip), got {c_clip}")
    if eps_clip < 0 or (eps_clip_higher is not None and eps_clip_higher < 0):
        raise ValueError(f"eps_clip / eps_clip_higher must be >= 0, got {eps_clip}, {eps_clip_higher}")


def assert_all(ok: jax.Array, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``all(ok)``.

    Concrete input raises at once. Under ``jit``/``vmap`` the check runs as a host callback, and the
    ``ValueError`` surfaces as a ``jax.errors.JaxRuntimeError`` carrying the same message.
    """
    ok = jnp.all(ok)
    try:
        concrete = bool(ok)
    except jax.errors.ConcretizationTypeError:
        def _raise_if_false(flag):
            if not bool(flag):
                raise ValueError(message)

        jax.debug.callback(_raise_if_false, ok)
        return
    if not concrete:
        raise ValueError(message)


__all__ = ["check_choice", "check_clip", "check_rank", "check_same_shape", "check_2d_same", "check_float", "assert_all", "chex"]
