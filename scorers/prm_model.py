"""``PRMModelScorer``: a pretrained process reward model served over HTTP (vLLM pooling style).

Serialization (problem / response format)::

    ids = encode(task_template.format(task=task))[:max_task_tokens]
        + for each of the most recent ``recent_steps`` steps:
              encode(step_template.format(action=..., observation=..., reward=...)) + [step_separator_id]

``task`` is the first user message; a step is an assistant message plus the tool/user messages that
answered it (``reward`` is the turn's env reward as text, empty when unknown). When the ids exceed
``max_input_tokens`` the task prompt is kept (its head, at most ``max_task_tokens``) and the oldest
steps are dropped; if even the newest step does not fit, its tail (ending in the separator) is kept.

Request: ``POST {base_url}{endpoint}`` (default ``/pooling``) with ``{"model": model, "input": ids}``.
Response: ``{"data": [{"data": values}]}`` where ``values`` is either one value per input token
(``[L]`` or ``[L, K]``) or one value per step separator (``[S]`` or ``[S, K]``, as servers that pool
only at a step tag return). With ``K > 1`` column ``label_index`` is used. The values at the
separator positions go through a sigmoid (``apply_sigmoid``, default True; switch it off when the
server already returns probabilities) and give step scores ``c_1..c_S``, aggregated by
``aggregation``::

    last      c_S
    mean      mean(c)
    max       max(c)
    weighted  last_weight * c_S + (1 - last_weight) * mean(c)

Transport errors, timeouts, 429/5xx and malformed bodies are retried (bounded), then the turn is
rejected. Observations: ``step_scores`` (float; mean: number of steps scored) and
``input_truncated`` (boolean; rate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout.types import Interaction
from scorers._http import HTTPScorer
from scorers._trajectory import Step, branch_prefix, split_steps, turn_conversation, with_step_rewards
from scorers.base import PRMMetricObservation, PRMScorerResult

__all__ = ["AGGREGATIONS", "PRMModelScorer", "aggregate_step_scores", "load_tokenizer"]

AGGREGATIONS = ("last", "mean", "max", "weighted")


def aggregate_step_scores(scores: Sequence[float], how: str, *, last_weight: float = 0.5) -> float:
    """Aggregate step scores ``c_1..c_S`` (S >= 1) by ``last`` / ``mean`` / ``max`` / ``weighted``."""
    c = np.asarray(scores, dtype=np.float64).reshape(-1)
    if c.size == 0:
        raise ValueError("no step scores to aggregate")
    if how == "last":
        return float(c[-1])
    if how == "mean":
        return float(c.mean())
    if how == "max":
        return float(c.max())
    if how == "weighted":
        return float(last_weight * c[-1] + (1.0 - last_weight) * c.mean())
    raise ValueError(f"aggregation={how!r}; allowed: {AGGREGATIONS}")


def load_tokenizer(tokenizer: Any) -> Any:
    """An object with ``encode(text)``: returned as is, or a ``tokenizer.json`` path loaded with the
    ``tokenizers`` library."""
    if isinstance(tokenizer, str):
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(tokenizer)
        except Exception as err:  # the tokenizers library does not name the file
            raise ValueError(f"tokenizer={tokenizer!r} could not be loaded as a tokenizer.json: {err}") from None
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have encode(text) -> list[int] or be a tokenizer.json path, got {tokenizer!r}")
    return tokenizer


def _encode(tokenizer: Any, text: str) -> list[int]:
    out = tokenizer.encode(text)
    ids = getattr(out, "ids", out)  # tokenizers.Encoding -> .ids
    return [int(i) for i in ids]


class PRMModelScorer(HTTPScorer):
    """Process score from a served PRM (see the module docstring).

    Kwargs: ``base_url``, ``model``, ``tokenizer`` (object with ``encode`` or a tokenizer.json path)
    and ``step_separator_id`` (required); ``recent_steps`` (10), ``max_input_tokens`` (4096),
    ``max_task_tokens`` (default half of ``max_input_tokens``), ``aggregation`` (``last``),
    ``last_weight`` (0.5), ``apply_sigmoid`` (True), ``label_index`` (-1), ``endpoint``
    (``/pooling``), ``task_template``, ``step_template``, ``include_step_rewards`` (True),
    and the HTTP options ``api_key``, ``timeout_s`` (30), ``max_retries`` (2), ``backoff_s`` (0.5),
    ``max_concurrency`` (16) (``scorers._http.HTTPOptions``).
    """

    name = "prm_model"

    @classmethod
    def reward_range(cls, apply_sigmoid: bool = True, **kwargs: Any) -> tuple[float, float] | None:
        return (0.0, 1.0) if apply_sigmoid else None  # raw server values have no known range

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        step_separator_id: int,
        *,
        recent_steps: int = 10,
        max_input_tokens: int = 4096,
        max_task_tokens: int | None = None,
        aggregation: str = "last",
        last_weight: float = 0.5,
        apply_sigmoid: bool = True,
        label_index: int = -1,
        endpoint: str = "/pooling",
        task_template: str = "{task}\n",
        step_template: str = "{action}\n{observation}{reward}",
        include_step_rewards: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if isinstance(step_separator_id, bool) or not isinstance(step_separator_id, int) or step_separator_id < 0:
            raise ValueError(f"step_separator_id must be a token id (int >= 0), got {step_separator_id!r}")
        for key, v in (("recent_steps", recent_steps), ("max_input_tokens", max_input_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        if max_task_tokens is None:
            max_task_tokens = max_input_tokens // 2
        if isinstance(max_task_tokens, bool) or not isinstance(max_task_tokens, int) or not 0 <= max_task_tokens < max_input_tokens:
            raise ValueError(f"max_task_tokens must be an int in [0, max_input_tokens), got {max_task_tokens!r}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={aggregation!r}; allowed: {AGGREGATIONS}")
        if isinstance(last_weight, bool) or not isinstance(last_weight, (int, float)) or not 0 <= last_weight <= 1:
            raise ValueError(f"last_weight must be in [0, 1], got {last_weight!r}")
        if not isinstance(endpoint, str) or not endpoint.startswith("/"):
            raise ValueError(f"endpoint must be a path starting with '/', got {endpoint!r}")
        for key, tpl, fields in (
            ("task_template", task_template, {"task": ""}),
            ("step_template", step_template, {"action": "", "observation": "", "reward": ""}),
        ):
            try:
                tpl.format(**fields)
            except (KeyError, IndexError, ValueError, AttributeError) as err:
                raise ValueError(f"{key}={tpl!r} is not a valid template with fields {sorted(fields)}: {err}") from None
        self.tokenizer = load_tokenizer(tokenizer)
        super().__init__(base_url, **kwargs)
        self.model = model
        self.step_separator_id = step_separator_id
        self.recent_steps = recent_steps
        self.max_input_tokens = max_input_tokens
        self.max_task_tokens = max_task_tokens
        self.aggregation = aggregation
        self.last_weight = float(last_weight)
        self.apply_sigmoid = bool(apply_sigmoid)
        self.label_index = int(label_index)
        self.endpoint = endpoint
        self.task_template = task_template
        self.step_template = step_template
        self.include_step_rewards = bool(include_step_rewards)

    # -- serialization --------------------------------------------------------------------------
    def _step_text(self, step: Step) -> str:
        reward = "" if step.reward is None or not self.include_step_rewards else f"\nreward: {step.reward:g}"
        return self.step_template.format(action=step.action, observation=step.observation, reward=reward)

    def serialize(self, interaction: Interaction, ctx: Mapping[str, Any] | None) -> tuple[list[int], int, bool]:
        """``(token ids, number of steps in them, truncated?)`` for this turn (no I/O)."""
        task, steps = split_steps(turn_conversation(interaction, ctx))
        if not steps:
            raise ValueError(f"interaction {interaction.id!r}: the conversation has no agent step to score")
        steps = with_step_rewards(steps, branch_prefix(interaction, ctx))
        truncated = len(steps) > self.recent_steps
        steps = steps[-self.recent_steps :]
        task_ids = _encode(self.tokenizer, self.task_template.format(task=task))
        if len(task_ids) > self.max_task_tokens:
            task_ids, truncated = task_ids[: self.max_task_tokens], True
        budget = self.max_input_tokens - len(task_ids)
        kept: list[list[int]] = []
        for step in reversed(steps):
            ids = _encode(self.tokenizer, self._step_text(step)) + [self.step_separator_id]
            if len(ids) <= budget:
                kept.append(ids)
                budget -= len(ids)
                continue
            truncated = True
            if not kept:
                kept.append(ids[-budget:])
            break
        kept.reverse()
        ids = task_ids + [t for chunk in kept for t in chunk]
        return ids, len(kept), truncated

    # -- response -------------------------------------------------------------------------------
    def step_scores(self, ids: Sequence[int], data: Any) -> np.ndarray:
        """Step scores from a pooling response body (raises ``ValueError`` when malformed)."""
        values = np.asarray(data["data"][0]["data"], dtype=np.float64)
        if values.ndim == 2:
            values = values[:, 0] if values.shape[1] == 1 else values[:, self.label_index]
        elif values.ndim != 1:
            raise ValueError(f"pooling values must be [L] or [L, K], got shape {values.shape}")
        sep = np.asarray(ids) == self.step_separator_id
        n_sep = int(sep.sum())
        if values.shape[0] == len(ids):
            picked = values[sep]
        elif values.shape[0] == n_sep:
            picked = values
        else:
            raise ValueError(f"pooling returned {values.shape[0]} values for {len(ids)} tokens / {n_sep} step separators")
        if picked.size == 0 or not np.isfinite(picked).all():
            raise ValueError("no finite step values at the separator positions")
        return 1.0 / (1.0 + np.exp(-picked)) if self.apply_sigmoid else picked

    async def _score(self, interaction: Interaction, ctx: Mapping[str, Any]) -> tuple[float, int, bool]:
        ids, n_steps, truncated = self.serialize(interaction, ctx)
        payload = {"model": self.model, "input": ids}
        scores = await self.http.post_json(self.endpoint, payload, lambda data: self.step_scores(ids, data))
        value = aggregate_step_scores(scores, self.aggregation, last_weight=self.last_weight)
        if not math.isfinite(value):
            raise ValueError(f"PRM score is not finite: {value}")
        return value, int(scores.size), truncated

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> float:
        return (await self._score(interaction, ctx))[0]

    async def evaluate_result(self, interaction: Interaction, ctx: Mapping[str, Any]) -> PRMScorerResult:
        value, n, truncated = await self._score(interaction, ctx)
        return PRMScorerResult(
            reward=value,
            observations=(
                PRMMetricObservation("step_scores", "turn", interaction.id, n, "float", ("mean",)),
                PRMMetricObservation("input_truncated", "turn", interaction.id, truncated, "boolean", ("rate",)),
            ),
        )
