"""DAPO's rollout-side pieces (Yu et al., 2025): dynamic sampling and the soft overlong punishment.

DAPO's other two pieces, clip-higher and the token-level loss, are learner options
(``ppo.eps_clip_higher``, ``ppo.agg``) that every strategy here uses by default; what makes
``rollout.strategy: dapo`` differ from ``flat`` are the two functions below, wired in
``jaxprm.train.loop`` (see ``jaxprm.train.schema.DAPOConfig``).

* Dynamic sampling keeps only *mixed* groups (outcome rewards not all equal: a group whose
  trajectories all succeed or all fail has zero group-normalised advantage and only dilutes the
  batch), rolling out more tasks until the batch is full again.
* Overlong shaping: for a response of ``L`` tokens under a hard cap ``L_max`` and a buffer ``c``,
  ``R_len(L) = -factor * clip((L - (L_max - c)) / c, 0, 1)``: zero up to ``L_max - c``, then a
  linear ramp to ``-factor`` at the cap (a truncated response). A multi-turn trajectory gets the
  punishment of its longest turn (one turn: DAPO's single-response rule).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxprm.train.config import TrainConfig

__all__ = ["dynamic_sampling", "overlong_buffer", "overlong_penalty", "is_mixed", "shape_overlong", "round_tasks"]


def dynamic_sampling(cfg: TrainConfig) -> bool:
    """Whether dynamic sampling is on (``rollout.dapo.dynamic_sampling``; null: for ``dapo`` only)."""
    on = cfg.rollout.dapo.dynamic_sampling
    return cfg.rollout.strategy == "dapo" if on is None else bool(on)


def round_tasks(tasks_per_round: int, *, tasks_so_far: int, tokens_so_far: int, max_tokens: int | None) -> int:
    """Tasks for the next dynamic-sampling round under a token cap: ``tasks_per_round`` without a
    cap or before any round; ``0`` once ``tokens_so_far >= max_tokens``; else
    ``min(tasks_per_round, ceil((max_tokens - tokens_so_far) / (tokens_so_far / tasks_so_far)))``,
    the tasks the rest of the cap buys at the step's tokens per task so far."""
    if max_tokens is None or tasks_so_far == 0:
        return tasks_per_round
    if tokens_so_far >= max_tokens:
        return 0
    per_task = max(tokens_so_far / tasks_so_far, 1e-9)
    return int(min(tasks_per_round, math.ceil((max_tokens - tokens_so_far) / per_task)))


def overlong_buffer(cfg: TrainConfig) -> int:
    """The overlong buffer in tokens (0: off); null means ``max_new_tokens // 4`` for ``dapo``."""
    buf = cfg.rollout.dapo.overlong_buffer
    if buf is None:
        return cfg.rollout.max_new_tokens // 4 if cfg.rollout.strategy == "dapo" else 0
    return int(buf)


def overlong_penalty(lengths: np.ndarray, max_len: int, buffer: int, factor: float = 1.0) -> np.ndarray:
    """``-factor * clip((L - (max_len - buffer)) / buffer, 0, 1)`` elementwise over response
    lengths ``L`` (any shape); zeros when ``buffer`` is 0."""
    lengths = np.asarray(lengths, np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths)
    return -factor * np.clip((lengths - (max_len - buffer)) / buffer, 0.0, 1.0)


def is_mixed(group: Any) -> bool:
    """Whether a group's training leaves have outcome rewards that are not all equal."""
    return len({float(lf.outcome_reward) for lf in group.leaves}) > 1


def _longest_turn(group: Any, leaf_id: str) -> int:
    return max((len(i.model_response.output_tokens) for i in group.tree.branch(leaf_id)), default=0)


def shape_overlong(groups: Sequence[Any], max_len: int, buffer: int, factor: float) -> tuple[list[Any], dict[str, float]]:
    """Groups whose leaves' outcome rewards carry the overlong punishment of their longest turn
    (copies; the rolled-out groups are not changed), and the row's stats: ``overlong_punished``
    (fraction of trajectories punished) and ``overlong_penalty_mean``."""
    if buffer <= 0:
        return list(groups), {}
    out, penalties = [], []
    for g in groups:
        lengths = np.array([_longest_turn(g, lf.leaf_id) for lf in g.all_leaves])
        pen = dict(zip((lf.leaf_id for lf in g.all_leaves), overlong_penalty(lengths, max_len, buffer, factor)))
        shaped = {lf.leaf_id: dataclasses.replace(lf, outcome_reward=lf.outcome_reward + float(pen[lf.leaf_id]))
                  for lf in g.all_leaves}
        penalties += [pen[lf.leaf_id] for lf in g.leaves]
        out.append(dataclasses.replace(g, leaves=[shaped[lf.leaf_id] for lf in g.leaves],
                                       all_leaves=list(shaped.values())))
    pen_arr = np.asarray(penalties or [0.0])
    return out, {"overlong_punished": float(np.mean(pen_arr < 0)), "overlong_penalty_mean": float(pen_arr.mean())}
