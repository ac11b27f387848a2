"""``LengthBudgetScorer``: 1.0 for a turn within its output-token budget, else 0.0 (no dependencies)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.types import Interaction
from scorers.base import BaseScorer, PRMMetricObservation, PRMScorerResult

__all__ = ["LengthBudgetScorer"]


class LengthBudgetScorer(BaseScorer):
    """Score a turn ``1.0`` when ``output_len <= max_output_tokens``, else ``0.0``.

    The values lie in [0, 1], so the scorer suits ``process_weighted`` shaping. The budget is
    independent of the generation limit. Observations per turn: ``within_budget`` (boolean;
    count, rate) and ``output_tokens`` (float; mean).
    """

    name = "length_budget"

    @classmethod
    def reward_range(cls, **kwargs: Any) -> tuple[float, float]:
        return (0.0, 1.0)

    def __init__(self, max_output_tokens: int, **kwargs: Any) -> None:
        if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int) or max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be an int >= 1, got {max_output_tokens!r}")
        super().__init__(**kwargs)
        self.max_output_tokens = max_output_tokens

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> float:
        return 1.0 if interaction.output_len <= self.max_output_tokens else 0.0

    def prepare_result(self, interaction: Interaction, result: Any, ctx: Mapping[str, Any]) -> PRMScorerResult:
        return PRMScorerResult(
            reward=result,
            observations=(
                PRMMetricObservation(
                    "within_budget", "turn", interaction.id, bool(result >= 1.0), "boolean", ("count", "rate")
                ),
                PRMMetricObservation("output_tokens", "turn", interaction.id, interaction.output_len, "float", ("mean",)),
            ),
        )
