"""jaxprm: process-reward RL for multi-turn LLM agents, in JAX.

The top-level package re-exports the learner (``jaxprm.learner``, layer 1): pure jitted kernels and
the ``Batch`` pytree. Models, server (sampler, engine, HTTP) and trainer live in submodules
(``jaxprm.models``, ``jaxprm.serve``, ``jaxprm.train``) and are not imported here. The kernels load
on first use, so importing ``jaxprm.modes`` (the kernels' named options) does not load jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "AdvantageConfig",
    "Advantages",
    "Batch",
    "GAE_METHODS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "NORM_LEVELS",
    "PackedAdvantages",
    "PackedBatch",
    "PolicyLossTerms",
    "RowData",
    "SHAPING_MODES",
    "bucket_size",
    "check_uniform_turn_rewards",
    "compute_advantages",
    "fold_turn_rewards",
    "gae",
    "gather_to_flat",
    "group_normalize_rewards",
    "kl_penalty",
    "masked_sum_count",
    "normalize",
    "pack_advantages",
    "pack_rows",
    "packed_logprobs",
    "packed_policy_loss",
    "pad_rows",
    "place_outcome_rewards",
    "policy_loss",
    "policy_loss_terms",
    "shape_advantages",
    "shift_to_prediction",
    "transform_outcome_rewards",
    "tree_attention_mask",
    "validate_process_rewards",
]
_EXPORTS = frozenset(__all__)

if TYPE_CHECKING:
    from jaxprm.learner import (
        AdvantageConfig,
        Advantages,
        Batch,
        GAE_METHODS,
        KL_ESTIMATORS,
        LOSS_AGGREGATIONS,
        NORM_LEVELS,
        PackedAdvantages,
        PackedBatch,
        PolicyLossTerms,
        RowData,
        SHAPING_MODES,
        bucket_size,
        check_uniform_turn_rewards,
        compute_advantages,
        fold_turn_rewards,
        gae,
        gather_to_flat,
        group_normalize_rewards,
        kl_penalty,
        masked_sum_count,
        normalize,
        pack_advantages,
        pack_rows,
        packed_logprobs,
        packed_policy_loss,
        pad_rows,
        place_outcome_rewards,
        policy_loss,
        policy_loss_terms,
        shape_advantages,
        shift_to_prediction,
        transform_outcome_rewards,
        tree_attention_mask,
        validate_process_rewards,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module("jaxprm.learner"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
