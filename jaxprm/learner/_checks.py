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
    """Raise ``ValueError`` naming ``name`` unless ``x`` has rank ``rank``."""
    ndim = jnp.ndim(x)
    if ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {jnp.shape(x)} (rank {ndim})")


def check_same_shape(**arrays: Any) -> None:
    """Raise ``ValueError`` unless all named arrays share one shape."""
    shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items()}
    if len(set(shapes.values())) > 1:
        detail = ", ".join(f"{k}{s}" for k, s in shapes.items())
        raise ValueError(f"shape mismatch: {detail}")


def check_2d_same(**arrays: Any) -> None:
    """Each array is ``[B, T]`` and all shapes agree; floats are floating point."""
    for k, v in arrays.items():
        check_rank(k, v, 2)
    check_same_shape(**arrays)


def check_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")


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


__all__ = ["check_choice", "check_rank", "check_same_shape", "check_2d_same", "check_float", "assert_all", "chex"]
