"""Group filters for process-reward training (layer 4, beside the export that applies them; numpy only).

A *group* is the set of samples drawn for one prompt (a GRPO group, or a PaTR tree's leaves). It is
given in either of two forms:

1. a sequence of samples, each a mapping (or an object with the same attributes)::

       {"reward": float,                 # outcome reward of the sample
        "token_rewards": float [T] | None,   # per-token process rewards (None: none)
        "loss_mask": 0/1 [T] | None,     # active tokens; None: every token_rewards entry is active
        "truncated": bool}               # ended without EOS (optional, default False)

2. a batched mapping (e.g. built from a ``jaxprm.Batch`` on the host)::

       {"rewards": float [G], "token_rewards": float [G, T] (optional),
        "loss_mask": 0/1 [G, T] (optional), "truncated": bool [G] (optional)}

Both filters keep a group when its outcome rewards are *mixed* (not all equal), or when every
reward is ``<= 0`` and some sample has a negative process reward on an active token (the group still
carries a penalty signal). Otherwise the group is rejected, as *all correct* (uniform rewards, all
``> 0``) or *all wrong* (uniform rewards, all ``<= 0``, no penalty).

``filter_mixed_or_penalized_all_wrong_mask_no_eos`` matches an actor that clears the process
rewards of truncated samples (``mask_no_eos_with_zero``): it differs only in the all-wrong test,
where negative process rewards of truncated samples (no EOS) do not count. The mixed-outcome test
always uses every sample's outcome reward, truncated ones included (the reference rule, docs/design.md).

Each call returns a ``FilterDecision`` (truthy when kept) and, given ``counters``, increments the
reference's counters: ``rejected_by_failed_or_perfect`` for every rejected group together with
``rejected_by_all_correct`` or ``rejected_by_all_wrong``, and ``accepted_penalized_all_wrong``;
``accepted_mixed`` counts the mixed groups (see ``FILTER_COUNTERS``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FILTER_COUNTERS",
    "FILTER_REASONS",
    "FilterDecision",
    "GroupSample",
    "filter_mixed_or_penalized_all_wrong",
    "filter_mixed_or_penalized_all_wrong_mask_no_eos",
]

ACCEPTED_MIXED = "accepted_mixed"
ACCEPTED_PENALIZED_ALL_WRONG = "accepted_penalized_all_wrong"
REJECTED_ALL_CORRECT = "rejected_by_all_correct"
REJECTED_ALL_WRONG = "rejected_by_all_wrong"
#: Counted with every rejection (the group's outcomes were uniform: all failed or all perfect).
REJECTED_FAILED_OR_PERFECT = "rejected_by_failed_or_perfect"
#: Every reason a decision can carry.
FILTER_REASONS = (ACCEPTED_MIXED, ACCEPTED_PENALIZED_ALL_WRONG, REJECTED_ALL_CORRECT, REJECTED_ALL_WRONG)
#: Every counter a call increments.
FILTER_COUNTERS = (*FILTER_REASONS, REJECTED_FAILED_OR_PERFECT)


@dataclasses.dataclass(frozen=True)
class GroupSample:
    """One sample of a group (the per-sample form; a mapping with these keys works too)."""

    reward: float
    token_rewards: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    truncated: bool = False


@dataclasses.dataclass(frozen=True)
class FilterDecision:
    """``keep`` and the reason (one of ``FILTER_REASONS``); truthy exactly when kept."""

    keep: bool
    reason: str

    def __bool__(self) -> bool:
        return self.keep


def _field(sample: Any, key: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(key, default)
    return getattr(sample, key, default)


def _normalize(group: Any) -> tuple[np.ndarray, list[np.ndarray | None], list[np.ndarray | None], np.ndarray]:
    """-> rewards [G], per-sample token rewards, per-sample masks, truncated [G]."""
    if isinstance(group, Mapping):
        if "rewards" not in group:
            raise ValueError("a batched group needs 'rewards' [G]; optional: token_rewards, loss_mask, truncated")
        rewards = np.asarray(group["rewards"], dtype=np.float64).reshape(-1)
        g = rewards.shape[0]
        tr = group.get("token_rewards")
        lm = group.get("loss_mask")
        if tr is not None:
            tr = np.asarray(tr, dtype=np.float64)
            if tr.ndim != 2 or tr.shape[0] != g:
                raise ValueError(f"token_rewards must have shape [G={g}, T], got {tr.shape}")
        if lm is not None:
            lm = np.asarray(lm)
            if tr is None or lm.shape != tr.shape:
                raise ValueError(f"loss_mask must have the shape of token_rewards, got {lm.shape}")
        trunc = group.get("truncated")
        truncated = np.zeros(g, dtype=bool) if trunc is None else np.asarray(trunc, dtype=bool).reshape(-1)
        if truncated.shape != (g,):
            raise ValueError(f"truncated must have shape [G={g}], got {truncated.shape}")
        token_rewards = [None if tr is None else tr[i] for i in range(g)]
        masks = [None if lm is None else lm[i] for i in range(g)]
        return rewards, token_rewards, masks, truncated
    if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
        raise TypeError(f"group must be a sequence of samples or a batched mapping, got {type(group).__name__}")
    rewards_l, token_rewards, masks, truncated_l = [], [], [], []
    for i, sample in enumerate(group):
        r = _field(sample, "reward")
        if r is None:
            raise ValueError(f"group[{i}] has no 'reward'")
        rewards_l.append(float(r))
        tr = _field(sample, "token_rewards")
        lm = _field(sample, "loss_mask")
        if tr is not None:
            tr = np.asarray(tr, dtype=np.float64).reshape(-1)
            if lm is not None:
                lm = np.asarray(lm).reshape(-1)
                if lm.shape != tr.shape:
                    raise ValueError(f"group[{i}]: loss_mask shape {lm.shape} != token_rewards shape {tr.shape}")
        token_rewards.append(tr)
        masks.append(lm)
        truncated_l.append(bool(_field(sample, "truncated", False)))
    return np.asarray(rewards_l, dtype=np.float64), token_rewards, masks, np.asarray(truncated_l, dtype=bool)


def _decide(group: Any, *, skip_truncated_penalties: bool,
            counters: MutableMapping[str, int] | None) -> FilterDecision:
    rewards, token_rewards, masks, truncated = _normalize(group)
    if rewards.size == 0:
        raise ValueError("group must hold at least one sample")
    if not np.isfinite(rewards).all():
        raise ValueError("group outcome rewards must be finite")
    mixed = bool((rewards != rewards[0]).any())  # every sample's outcome, truncated ones included
    all_wrong = bool((rewards <= 0).all())
    penalized = False
    if not mixed and all_wrong:
        for i, tr in enumerate(token_rewards):
            if tr is None or (skip_truncated_penalties and truncated[i]):
                continue
            if not np.isfinite(tr).all():
                raise ValueError(f"sample {i}: token_rewards must be finite")
            active = np.ones(tr.shape, dtype=bool) if masks[i] is None else np.asarray(masks[i]).astype(bool)
            if bool(((tr < 0) & active).any()):
                penalized = True
                break
    if mixed:
        decision = FilterDecision(True, ACCEPTED_MIXED)
    elif penalized:
        decision = FilterDecision(True, ACCEPTED_PENALIZED_ALL_WRONG)
    else:
        decision = FilterDecision(False, REJECTED_ALL_WRONG if all_wrong else REJECTED_ALL_CORRECT)
    if counters is not None:
        counters[decision.reason] = counters.get(decision.reason, 0) + 1
        if not decision.keep:
            counters[REJECTED_FAILED_OR_PERFECT] = counters.get(REJECTED_FAILED_OR_PERFECT, 0) + 1
    return decision


def filter_mixed_or_penalized_all_wrong(
    group: Any, *, counters: MutableMapping[str, int] | None = None
) -> FilterDecision:
    """Keep mixed-outcome groups and all-wrong groups that carry a negative process reward.

    ``keep = any(r != r[0]) or (all(r <= 0) and any(p < 0 on an active token))``. See the module
    docstring for the group format. ``counters`` (e.g. a ``collections.Counter``) gets the reason.
    """
    return _decide(group, skip_truncated_penalties=False, counters=counters)


def filter_mixed_or_penalized_all_wrong_mask_no_eos(
    group: Any, *, counters: MutableMapping[str, int] | None = None
) -> FilterDecision:
    """As ``filter_mixed_or_penalized_all_wrong``, except that in the all-wrong test the negative
    process rewards of truncated samples do not count (``mask_no_eos_with_zero`` clears them)."""
    return _decide(group, skip_truncated_penalties=True, counters=counters)


def new_filter_counters() -> collections.Counter[str]:
    """A counter with every reason present (zero), ready to pass as ``counters``."""
    return collections.Counter({r: 0 for r in FILTER_COUNTERS})
