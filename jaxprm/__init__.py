"""jaxprm: process-reward RL for multi-turn LLM agents, in JAX.

The top-level package is the array core (layer 1): pure jitted kernels and the ``Batch`` pytree.
Models, sampler, server and trainer live in submodules (``jaxprm.models``, ``jaxprm.sampler``,
``jaxprm.serve``, ``jaxprm.train``) and are not imported here.
"""

from jaxprm.advantages import AdvantageConfig, Advantages, compute_advantages
from jaxprm.batch import Batch, RowData, bucket_size, pad_rows
from jaxprm.gae import gae
from jaxprm.loss import PolicyLossTerms, policy_loss, policy_loss_terms
from jaxprm.normalize import group_normalize_rewards, masked_sum_count, normalize
from jaxprm.rewards import (
    check_uniform_turn_rewards,
    fold_turn_rewards,
    kl_penalty,
    place_outcome_rewards,
    shift_to_prediction,
    transform_outcome_rewards,
)
from jaxprm.shaping import shape_advantages, validate_process_rewards

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
