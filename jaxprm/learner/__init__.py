"""The learner (layer 1): pure jitted kernels over ``[B, T]`` arrays and the ``Batch`` pytree.

One topic per module: ``rewards`` (outcome placement, KL penalty, turn folding), ``gae``,
``normalize``, ``shaping`` (process-reward shaping), ``loss`` (clipped policy loss),
``advantages`` (the whole reference order as one jitted program) and ``batch`` (padding, buckets).
Imports jax, chex and numpy only; re-exported by ``jaxprm``. ``modes`` holds the named options
(no jax).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names -> defining module. Loaded on first use (PEP 562), so that ``jaxprm.learner.modes`` (the
# named options, no jax) can be imported by layers that must not load jax.
_EXPORTS = {
    "AdvantageConfig": "jaxprm.learner.advantages",
    "Advantages": "jaxprm.learner.advantages",
    "Batch": "jaxprm.learner.batch",
    "GAE_METHODS": "jaxprm.learner.modes",
    "KL_ESTIMATORS": "jaxprm.learner.modes",
    "LOSS_AGGREGATIONS": "jaxprm.learner.modes",
    "NORM_LEVELS": "jaxprm.learner.modes",
    "PolicyLossTerms": "jaxprm.learner.loss",
    "RowData": "jaxprm.learner.batch",
    "SHAPING_MODES": "jaxprm.learner.modes",
    "bucket_size": "jaxprm.learner.batch",
    "check_uniform_turn_rewards": "jaxprm.learner.rewards",
    "compute_advantages": "jaxprm.learner.advantages",
    "fold_turn_rewards": "jaxprm.learner.rewards",
    "gae": "jaxprm.learner.gae",
    "group_normalize_rewards": "jaxprm.learner.normalize",
    "kl_penalty": "jaxprm.learner.rewards",
    "masked_sum_count": "jaxprm.learner.normalize",
    "normalize": "jaxprm.learner.normalize",
    "pad_rows": "jaxprm.learner.batch",
    "place_outcome_rewards": "jaxprm.learner.rewards",
    "policy_loss": "jaxprm.learner.loss",
    "policy_loss_terms": "jaxprm.learner.loss",
    "shape_advantages": "jaxprm.learner.shaping",
    "shift_to_prediction": "jaxprm.learner.rewards",
    "transform_outcome_rewards": "jaxprm.learner.rewards",
    "validate_process_rewards": "jaxprm.learner.shaping",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from jaxprm.learner.advantages import AdvantageConfig, Advantages, compute_advantages
    from jaxprm.learner.batch import Batch, RowData, bucket_size, pad_rows
    from jaxprm.learner.gae import gae
    from jaxprm.learner.loss import PolicyLossTerms, policy_loss, policy_loss_terms
    from jaxprm.learner.modes import GAE_METHODS, KL_ESTIMATORS, LOSS_AGGREGATIONS, NORM_LEVELS, SHAPING_MODES
    from jaxprm.learner.normalize import group_normalize_rewards, masked_sum_count, normalize
    from jaxprm.learner.rewards import check_uniform_turn_rewards, fold_turn_rewards, kl_penalty, place_outcome_rewards, shift_to_prediction, transform_outcome_rewards
    from jaxprm.learner.shaping import shape_advantages, validate_process_rewards


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
