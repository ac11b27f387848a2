"""``compute_advantages``: the whole reward -> advantage pipeline as one jitted program."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxprm.fields import require
from jaxprm.learner.batch import Batch
from jaxprm.learner.gae import GAE_METHODS, gae
from jaxprm.learner.normalize import NORM_LEVELS, group_normalize_rewards, normalize
from jaxprm.learner.rewards import KL_ESTIMATORS, fold_turn_rewards, kl_penalty, place_outcome_rewards, transform_outcome_rewards
from jaxprm.learner.shaping import SHAPING_MODES, shape_advantages
from jaxprm.learner.tree_credit import (anchor_state_advantages, node_values, sibling_advantages,
                                        tree_value_advantages, turn_to_tokens)

__all__ = ["AdvantageConfig", "AdvantageParams", "Advantages", "compute_advantages", "ESTIMATORS"]

#: ``advantage.estimator``: how the outcome is credited over a group's (tree of) turns.
ESTIMATORS = ("leaf_grpo", "tree_value", "sibling", "anchor_state")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageParams:
    """The reward processing, GAE and normalization options of ``compute_advantages``: everything
    of :class:`AdvantageConfig` but the process-reward shaping (the trainer's ``advantage`` YAML
    section is these fields; it takes the shaping from ``prm.advantage_shaping``).

    Attributes:
      reward_scale, reward_bias, reward_clip: outcome transform ``clip((r + bias) * scale, ±clip)``
        (``reward_scale`` finite and != 0, ``reward_clip`` > 0).
      group_reward_norm: normalize outcome rewards within each group (GRPO) after the transform.
      group_reward_std: divide by the group std in that normalization (Dr.GRPO sets False).
      kl_ctl: coefficient of the per-token KL reward ``-kl_ctl * KL(old, ref)`` (0 disables it).
      kl_estimator: ``"k1" | "k2" | "k3"``.
      gamma, lam: GAE discount and lambda, in [0, 1].
      gae_method: ``"auto"`` (``"cumsum"`` when ``gamma == lam == 1``; else ``"associative"`` on an
        accelerator backend, ``"scan"`` on the CPU: see ``gae_method_for``),
        ``"scan" | "associative" | "cumsum"``.
      adv_mean_level, adv_std_level: advantage normalization levels (``"batch" | "group" | None``).
      adv_unbiased, adv_eps: unbiased std and epsilon of that normalization.
      estimator: how the outcome is credited to the tokens (``jaxprm.learner.tree_credit``;
        ``tree_value``, ``sibling`` and ``anchor_state`` need the batch's ``turn_*`` arrays):
        ``"leaf_grpo"`` (default): the (group-normalized) outcome of each leaf on all its tokens.
        ``"tree_value"``: TreeRL's ``((V(n) - V(root)) + (V(n) - V(parent))) / sqrt(L(n))`` per turn
        in place of the outcome's GAE term (the KL reward keeps its own), each shared turn's flat
        copies weighted ``1 / L(n)`` in the normalization and the loss (``Advantages.loss_weights``)
        so that it counts once, as in the packed tree; ``group_reward_norm`` applies to the
        outcomes first.
        ``"sibling"``: leaf_grpo plus, on each turn, the sibling term of the segment it is in.
        ``"anchor_state"``: leaf_grpo plus ``anchor_weight`` times GiGPO's step advantage (the
        turn's ``anchor_gamma``-discounted return of the environment's rewards, normalized among
        the group's turns that started from the same state).
      anchor_weight, anchor_gamma: omega and the step return's discount of ``anchor_state``.
      tree_eps: the epsilon of the sibling and step-group normalizations.
      token_rewards_as_adv: True = direct mode (process rewards shape advantages after GAE and
        normalization, never enter returns). False = folded mode (each turn's uniform process reward
        is added once at its last prediction position before GAE; ``shaping_mode`` is unused).
      mask_no_eos_with_zero: zero the outcome and process rewards of truncated rows.
    """

    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    group_reward_norm: bool = False
    group_reward_std: bool = True
    kl_ctl: float = 0.0
    kl_estimator: Literal[KL_ESTIMATORS] = "k1"
    gamma: float = 1.0
    lam: float = 1.0
    gae_method: Literal[("auto", *GAE_METHODS)] = "auto"
    adv_mean_level: Literal["batch", "group"] | None = "batch"  # NORM_LEVELS
    adv_std_level: Literal["batch", "group"] | None = "batch"
    adv_unbiased: bool = True
    adv_eps: float = 1e-5
    estimator: Literal[ESTIMATORS] = "leaf_grpo"
    anchor_weight: float = 1.0
    anchor_gamma: float = 0.95
    tree_eps: float = 1e-6
    token_rewards_as_adv: bool = True
    mask_no_eos_with_zero: bool = False

    def __post_init__(self) -> None:
        owner = type(self)
        for name, allowed in (("kl_estimator", KL_ESTIMATORS), ("gae_method", ("auto", *GAE_METHODS)),
                              ("estimator", ESTIMATORS),
                              ("adv_mean_level", NORM_LEVELS), ("adv_std_level", NORM_LEVELS)):
            value = getattr(self, name)
            require(value in allowed, name, f"{value!r} is not supported; allowed values: {allowed}", owner)
        for name in ("adv_eps", "kl_ctl", "anchor_weight", "tree_eps"):
            v = getattr(self, name)
            require(_real(v) and math.isfinite(v) and v >= 0, name, f"must be a finite number >= 0, got {v!r}", owner)
        v = self.reward_clip
        require(_real(v) and math.isfinite(v) and v > 0, "reward_clip", f"must be a finite number > 0, got {v!r}", owner)
        v = self.reward_scale
        require(_real(v) and math.isfinite(v) and v != 0, "reward_scale", f"must be finite and != 0, got {v!r}", owner)
        for name in ("gamma", "lam", "anchor_gamma"):
            v = getattr(self, name)
            require(_real(v) and 0 <= v <= 1, name, f"must be in [0, 1], got {v!r}", owner)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig(AdvantageParams):
    """Static options of ``compute_advantages`` (hashable: one compilation per config): its
    :class:`AdvantageParams` and the shaping of direct process rewards.

    Attributes:
      shaping_mode: ``None`` (ignore process rewards) or ``"additive" | "gvpo" | "process_weighted"``.
      negative_scale, zero_penalty, zero_eps: gvpo parameters (finite, >= 0).
      validate: check process rewards (finite; in [0, 1] for process_weighted) with a clear error.
    """

    shaping_mode: Literal[SHAPING_MODES] | None = None
    negative_scale: float = 0.2
    zero_penalty: float = 0.4
    zero_eps: float = 1e-6
    validate: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self)
        require(self.shaping_mode in (None, *SHAPING_MODES), "shaping_mode",
                f"{self.shaping_mode!r} is not supported; allowed values: {(None, *SHAPING_MODES)}", owner)
        for name in ("negative_scale", "zero_penalty", "zero_eps"):
            v = getattr(self, name)
            require(_real(v) and math.isfinite(v) and v >= 0, name, f"must be a finite number >= 0, got {v!r}", owner)
        require(not (self.shaping_mode in ("gvpo", "process_weighted") and not self.token_rewards_as_adv),
                "shaping_mode", f"{self.shaping_mode!r} needs token_rewards_as_adv=True (direct process "
                "advantages); folded mode adds each turn's reward before GAE and has no shaping step", owner)
        require(not (self.shaping_mode == "process_weighted" and self.mask_no_eos_with_zero), "shaping_mode",
                "'process_weighted' rejects mask_no_eos_with_zero=True "
                "(zeroed rewards would erase the negative advantages of truncated rows)", owner)

    @classmethod
    def from_params(cls, params: AdvantageParams, **shaping: Any) -> AdvantageConfig:
        """``params``' :class:`AdvantageParams` fields (from any subclass, e.g. the trainer's
        ``advantage`` section) with the shaping fields ``shaping``."""
        return cls(**{f.name: getattr(params, f.name) for f in dataclasses.fields(AdvantageParams)}, **shaping)


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Advantages(NamedTuple):
    """Outputs of ``compute_advantages``; ``[B, T]`` in prediction positions unless noted."""

    advantages: jax.Array  # final advantages for the policy loss
    returns: jax.Array  # GAE returns (critic targets)
    rewards: jax.Array  # per-token rewards GAE saw: KL reward + outcome (+ folded process)
    kl_rewards: jax.Array  # -kl_ctl * KL, 0 off the mask
    outcome_rewards: jax.Array  # [B] transformed (and group-normalized) outcome rewards
    token_advantages: jax.Array  # process rewards used for shaping (0 in folded mode)
    advantages_gae: jax.Array  # GAE advantages before normalization
    advantages_normalized: jax.Array  # after normalization, before shaping
    loss_weights: jax.Array  # [B, T] the loss mask to train with: loss_mask, times 1 / L(n) under tree_value


def gae_method_for(gamma: float, lam: float, backend: str | None = None) -> str:
    """The GAE method ``gae_method="auto"`` picks: ``"cumsum"`` when ``gamma == lam == 1`` (all
    methods then run the same blocked cumulative sum); otherwise the parallel-prefix
    ``"associative"`` on an accelerator (on an H200 it beats the sequential scan from T = 512 up,
    4-55x at T >= 8192: ``benchmarks/results/gae_break_even_h200.json``) and ``"scan"`` on the CPU
    (there neither is consistently ahead, within 1.4x either way: ``gae_break_even_cpu.json``).
    ``backend``: default ``jax.default_backend()``."""
    if gamma == 1.0 and lam == 1.0:
        return "cumsum"
    return "scan" if (backend or jax.default_backend()) == "cpu" else "associative"


def _gae_method(config: AdvantageConfig) -> str:
    if config.gae_method != "auto":
        return config.gae_method
    return gae_method_for(config.gamma, config.lam)


def _compute_advantages(batch: Batch, config: AdvantageConfig) -> Advantages:
    B, T = batch.tokens.shape
    # float32 math; float64 only when the batch is float64 (x64 reference runs).
    dt = jnp.result_type(batch.old_logprobs, batch.process_rewards, batch.outcome_rewards, jnp.float32)
    mask = batch.loss_mask.astype(dt)
    weights = batch.row_weights.astype(dt)
    truncated = batch.truncated.astype(bool)

    # 1. Outcome rewards: transform, optional GRPO group normalization, truncation zeroing.
    r = transform_outcome_rewards(
        batch.outcome_rewards.astype(dt), scale=config.reward_scale, bias=config.reward_bias, clip=config.reward_clip
    )
    if config.group_reward_norm:
        r = group_normalize_rewards(
            r, batch.group_ids, batch.num_groups, std=config.group_reward_std, weights=weights
        )
    keep = (~truncated if config.mask_no_eos_with_zero else jnp.ones((B,), bool)) & (weights > 0)
    r = jnp.where(keep, r, 0.0)

    # 2. KL reward on active tokens, then the outcome at the last prediction position.
    if config.kl_ctl > 0:
        kl = kl_penalty(batch.old_logprobs.astype(dt), batch.ref_logprobs.astype(dt),
                        estimator=config.kl_estimator)
        kl_rewards = -config.kl_ctl * kl * mask
    else:
        kl_rewards = jnp.zeros((B, T), dt)
    tree = config.estimator == "tree_value"
    # tree_value credits the outcome per turn (below) instead of through GAE
    rewards = kl_rewards + (0.0 if tree else place_outcome_rewards(r, batch.seq_lens, T))

    # 3. Process rewards (already in prediction positions); zero for truncated rows if asked.
    proc = batch.process_rewards.astype(dt) * mask * keep[:, None]
    use_process = config.shaping_mode is not None or not config.token_rewards_as_adv
    if use_process and not config.token_rewards_as_adv:
        rewards = fold_turn_rewards(rewards, proc, mask, batch.turn_ids)
        token_adv = jnp.zeros_like(proc)
    else:
        token_adv = proc if config.shaping_mode is not None else jnp.zeros_like(proc)

    # 4. GAE; truncated rows bootstrap from the value at their last position.
    values = batch.values.astype(dt)
    last = jnp.clip(batch.seq_lens - 1, 0, T - 1)
    boot = jnp.where(truncated, jnp.take_along_axis(values, last[:, None], axis=1)[:, 0], 0.0)
    adv_gae, returns = gae(rewards, values, mask, gamma=config.gamma, lam=config.lam,
                           method=_gae_method(config), bootstrap_values=boot)

    # 4b. Tree credit over the turns (jaxprm.learner.tree_credit).
    copy_weights = None
    if config.estimator != "leaf_grpo":
        credit, copy_weights = _tree_credit(batch, r, config, dt)
        adv_gae = adv_gae + credit * mask
        if tree:
            returns = returns + credit * mask

    # 5. Advantage normalization, then direct process-reward shaping.
    adv_norm = normalize(
        adv_gae, mask, group_ids=batch.group_ids, num_groups=batch.num_groups,
        mean_level=config.adv_mean_level, std_level=config.adv_std_level,
        unbiased=config.adv_unbiased, eps=config.adv_eps, row_weights=weights, token_weights=copy_weights,
    )
    if config.token_rewards_as_adv and config.shaping_mode is not None:
        adv = shape_advantages(
            adv_norm, token_adv, mask, mode=config.shaping_mode, negative_scale=config.negative_scale,
            zero_penalty=config.zero_penalty, zero_eps=config.zero_eps, validate=config.validate,
        )
    else:
        adv = adv_norm
    return Advantages(
        advantages=adv, returns=returns, rewards=rewards, kl_rewards=kl_rewards, outcome_rewards=r,
        token_advantages=token_adv, advantages_gae=adv_gae, advantages_normalized=adv_norm,
        loss_weights=batch.loss_mask.astype(dt) if copy_weights is None else batch.loss_mask.astype(dt) * copy_weights,
    )


def _tree_credit(batch: Batch, r: jax.Array, config: AdvantageConfig, dt) -> tuple[jax.Array, jax.Array | None]:
    """The estimator's per-token term ``[B, T]`` and, for ``tree_value``, the copies' weights."""
    nodes = batch.turn_nodes
    B, D = nodes.shape
    N = B * D
    nodes = jnp.where(batch.row_weights[:, None] > 0, nodes, -1)
    if config.estimator == "tree_value":
        adv, w = tree_value_advantages(r, nodes, batch.group_ids, num_groups=batch.num_groups, num_nodes=N)
        w_tok = turn_to_tokens(w, batch.turn_ids)
        return turn_to_tokens(adv, batch.turn_ids), jnp.where(batch.loss_mask > 0, w_tok, 1.0)
    if config.estimator == "sibling":
        return turn_to_tokens(sibling_advantages(r, nodes, num_nodes=N, eps=config.tree_eps), batch.turn_ids), None
    # anchor_state: the turn's discounted return, normalized in its step group (copies weighted 1 / L)
    g = config.anchor_gamma
    tr = jnp.where(nodes >= 0, batch.turn_rewards.astype(dt), 0.0)
    returns = [tr[:, D - 1]]
    for d in range(D - 2, -1, -1):
        returns.append(tr[:, d] + g * returns[-1])
    G = jnp.stack(returns[::-1], axis=1)
    _, leaves = node_values(r, nodes, num_nodes=N)
    copy_w = jnp.where(nodes >= 0, 1.0 / jnp.maximum(leaves[jnp.maximum(nodes, 0)], 1.0), 0.0)
    states = jnp.where(nodes >= 0, batch.turn_states, -1)
    step = anchor_state_advantages(G, states, num_states=N, weights=copy_w, eps=config.tree_eps)
    return config.anchor_weight * turn_to_tokens(step, batch.turn_ids), None


_compute_advantages_jit = jax.jit(_compute_advantages, static_argnames=("config",))


def compute_advantages(batch: Batch, config: AdvantageConfig = AdvantageConfig()) -> Advantages:
    """Rewards -> advantages for one ``Batch``, in one jitted program (reference order).

    1. ``r = clip((r + bias) * scale, ±clip)``; optional per-group normalization over real rows;
       with ``mask_no_eos_with_zero`` truncated rows get ``r = 0`` (and no process reward).
    2. ``rewards = -kl_ctl * KL(old_logprobs, ref_logprobs) * mask``, plus ``r`` at index
       ``seq_len - 2`` of each row.
    3. Folded mode: each turn's uniform process reward is added at its last prediction position.
    4. ``advantages, returns = gae(rewards, values, mask)``; truncated rows bootstrap from their
       last value. Then the ``estimator``'s tree credit is added per turn (``tree_value``: the
       outcome was left out of step 2's rewards; ``sibling`` / ``anchor_state``: on top of it).
    5. ``normalize`` the advantages (levels from the config), then (direct mode)
       ``shape_advantages`` with the process rewards.

    Compiles once per (shape, config); ``config`` must be an ``AdvantageConfig`` (hashable).

    Returns:
      ``Advantages`` (``advantages``, ``returns``, the intermediate arrays and ``loss_weights``,
      the mask the loss should take).
    """
    if not isinstance(config, AdvantageConfig):
        raise TypeError(f"config must be an AdvantageConfig, got {type(config).__name__}")
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a jaxprm.Batch, got {type(batch).__name__}")
    if config.estimator != "leaf_grpo" and (batch.turn_nodes is None or batch.turn_states is None
                                            or batch.turn_rewards is None):
        raise ValueError(f"estimator={config.estimator!r} needs the batch's turn_nodes, turn_states and "
                         "turn_rewards (rows exported with their turns: rollout.export, or RowData.turn_nodes)")
    return _compute_advantages_jit(batch, config)
