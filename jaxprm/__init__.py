"""jaxprm: process-reward RL for multi-turn LLM agents, in JAX.

The top-level package re-exports the learner (``jaxprm.learner``, layer 1): pure jitted kernels and
the ``Batch`` pytree. Models, server (sampler, engine, HTTP) and trainer live in submodules
(``jaxprm.models``, ``jaxprm.serve``, ``jaxprm.train``) and are not imported here. The kernels load
on first use, so importing ``jaxprm.modes`` (the kernels' named options) does not load jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxprm.learner import *  # noqa: F403


def __getattr__(name: str) -> Any:
    """The learner's names (``jaxprm.learner.__all__``, also as ``__all__``), loaded on first use."""
    learner = importlib.import_module("jaxprm.learner")
    if name == "__all__":
        return list(learner.__all__)
    if name in learner.__all__:
        value = getattr(learner, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(importlib.import_module("jaxprm.learner").__all__))
