"""The learner (layer 1): pure jitted kernels over ``[B, T]`` arrays and the ``Batch`` pytree.

One topic per module: ``rewards`` (outcome placement, KL penalty, turn folding), ``gae``,
``normalize``, ``shaping`` (process-reward shaping), ``loss`` (clipped policy loss),
``advantages`` (the whole reference order as one jitted program), ``batch`` (padding, buckets),
``packing`` (tree-packed batches) and ``packed_loss`` (the exact loss on packed tokens).
Imports jax, chex and numpy only; re-exported by ``jaxprm``.
"""

from jaxprm.learner.advantages import (
    AdvantageConfig,
    AdvantageParams,
    Advantages,
    compute_advantages,
)
from jaxprm.learner.batch import (
    Batch,
    RowData,
    bucket_size,
    pad_rows,
)
from jaxprm.learner.gae import (
    gae,
)
from jaxprm.learner.loss import (
    BEHAVIOUR_WEIGHT_MODES,
    PolicyLossTerms,
    behaviour_weights,
    decoupled_policy_loss,
    policy_loss,
    policy_loss_terms,
)
from jaxprm.learner.normalize import (
    group_normalize_rewards,
    masked_sum_count,
    normalize,
)
from jaxprm.learner.packed_loss import (
    PackedAdvantages,
    pack_advantages,
    packed_logprobs,
    packed_policy_loss,
)
from jaxprm.learner.packing import (
    PackedBatch,
    gather_to_flat,
    pack_rows,
    tree_attention_mask,
)
from jaxprm.learner.rewards import (
    check_uniform_turn_rewards,
    fold_turn_rewards,
    kl_penalty,
    place_outcome_rewards,
    shift_to_prediction,
    transform_outcome_rewards,
)
from jaxprm.learner.shaping import (
    shape_advantages,
    validate_process_rewards,
)
from jaxprm.modes import (
    GAE_METHODS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    NORM_LEVELS,
    SHAPING_MODES,
)

__all__ = [
    "AdvantageConfig",
    "AdvantageParams",
    "Advantages",
    "BEHAVIOUR_WEIGHT_MODES",
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
    "behaviour_weights",
    "bucket_size",
    "check_uniform_turn_rewards",
    "compute_advantages",
    "decoupled_policy_loss",
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
