"""The named options of the learner kernels, in one jax-free module.

Higher layers (the scorers' config, the trainer's YAML schema) validate against these tuples
without importing jax: ``jaxprm`` and ``jaxprm.learner`` load their kernels lazily.
"""

__all__ = ["BEHAVIOUR_WEIGHT_MODES", "GAE_METHODS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "NORM_LEVELS", "SHAPING_MODES"]

#: ``jaxprm.gae(method=...)``.
GAE_METHODS = ("scan", "associative", "cumsum")
#: ``jaxprm.kl_penalty(estimator=...)``: ``d``, ``d^2 / 2``, ``exp(-d) - 1 + d``.
KL_ESTIMATORS = ("k1", "k2", "k3")
#: ``jaxprm.policy_loss(agg=...)``.
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: ``jaxprm.normalize`` mean / std levels (``None``: no centring / std 1).
NORM_LEVELS = ("batch", "group", None)
#: ``jaxprm.shape_advantages(mode=...)``: how process rewards shape advantages (docs/design.md).
SHAPING_MODES = ("additive", "gvpo", "process_weighted")
#: ``jaxprm.decoupled_policy_loss(behave_mode=...)``: how the behaviour importance weight is capped.
BEHAVIOUR_WEIGHT_MODES = ("truncate", "mask", "mask_sequence")
