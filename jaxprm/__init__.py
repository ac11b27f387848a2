"""jaxprm: process-reward RL for multi-turn LLM agents, in JAX.

The top-level package re-exports the learner (``jaxprm.learner``, layer 1): pure jitted kernels and
the ``Batch`` pytree. Models, server (sampler, engine, HTTP) and trainer live in submodules
(``jaxprm.models``, ``jaxprm.serve``, ``jaxprm.train``) and are not imported here.
"""

from jaxprm.learner import (
    AdvantageConfig,
    Advantages,
    Batch,
    PolicyLossTerms,
    RowData,
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

__all__ = [
    "AdvantageConfig",
    "Advantages",
    "Batch",
    "PolicyLossTerms",
    "RowData",
    "bucket_size",
    "check_uniform_turn_rewards",
    "compute_advantages",
    "fold_turn_rewards",
    "gae",
    "group_normalize_rewards",
    "kl_penalty",
    "masked_sum_count",
    "normalize",
    "pad_rows",
    "place_outcome_rewards",
    "policy_loss",
    "policy_loss_terms",
    "shape_advantages",
    "shift_to_prediction",
    "transform_outcome_rewards",
    "validate_process_rewards",
]
