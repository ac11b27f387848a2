"""jaxprm: process-reward RL for multi-turn LLM agents, in JAX.

The top-level package re-exports the learner (``jaxprm.learner``, layer 1): pure jitted kernels and
the ``Batch`` pytree. Models, server (sampler, engine, HTTP) and trainer live in submodules
(``jaxprm.models``, ``jaxprm.serve``, ``jaxprm.train``) and are not imported here. The kernels load
on first use, so importing ``jaxprm.learner.modes`` (the named options) does not load jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxprm import learner as _learner

__all__ = list(_learner.__all__)

if TYPE_CHECKING:
    from jaxprm.learner import (
        AdvantageConfig,
        Advantages,
        Batch,
        GAE_METHODS,
        KL_ESTIMATORS,
        LOSS_AGGREGATIONS,
        NORM_LEVELS,
        PolicyLossTerms,
        RowData,
        SHAPING_MODES,
        bucket_size,
        check_uniform_turn_rewards,
        compute_advantages,
        fold_turn_rewards,
        gae,
        group_normalize_rewards,
        kl_penalty,
        masked_sum_count,
        normalize,
        pad_rows,
        place_outcome_rewards,
        policy_loss,
        policy_loss_terms,
        shape_advantages,
        shift_to_prediction,
        transform_outcome_rewards,
        validate_process_rewards,
    )


def __getattr__(name: str) -> Any:
    if name in _learner._EXPORTS:
        value = getattr(_learner, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
