"""Process-reward scorers (layer 3: imports ``rollout.types``, numpy, asyncio and httpx; never jax).

- the scorer contract: ``BaseScorer``, ``BaseTrajectoryScorer``, ``PRMScorerResult``,
  ``PRMMetricObservation`` (``scorers.base``);
- configuration: ``PRMConfig``, ``ScorerSpec``, ``AdvantageShapingConfig``, ``validate_prm_config``
  (``scorers.config``);
- branch scoring, the one path both callers use (``scorers.branch``): isolation, validation,
  ``score_branch`` (one scalar for a partial branch, for PaTR);
- ``PRMRunner`` (``run`` one branch, ``score_branches`` of a tree, owned/borrowed lifecycle)
  (``scorers.runner``);
- ``MetricsAccumulator`` (mergeable; ``rollout`` / ``eval-rollout`` namespaces) (``scorers.metrics``);
- built-in scorers: ``LengthBudgetScorer``, ``FrozenLakeProgressScorer``, ``SokobanProgressScorer``,
  ``LLMJudgeScorer``, ``PRMModelScorer``.
"""

from scorers.base import (
    BaseScorer,
    BaseTrajectoryScorer,
    PRMMetricObservation,
    PRMScorerResult,
    PRMTurnResult,
    ScorerUnavailable,
    ScoringRejected,
)
from scorers.config import (
    SHAPING_MODES,
    AdvantageShapingConfig,
    PRMConfig,
    ScorerSpec,
    check_scorer_specs,
    resolve_scorer_class,
    validate_prm_config,
)
from scorers.frozenlake import FrozenLakeProgressScorer, frozenlake_progress_score
from scorers.length_budget import LengthBudgetScorer
from scorers.llm_judge import LLMJudgeScorer
from scorers.metrics import EVAL_NAMESPACE, ROLLOUT_NAMESPACE, MetricsAccumulator, namespace_for
from scorers.prm_model import PRMModelScorer
from scorers.sokoban import SokobanProgressScorer, sokoban_progress_score
from scorers.branch import score_branch
from scorers.runner import PRMRunner, RunResult, SessionScores
from scorers._http import ScorerHTTPError
from scorers.breaker import CircuitBreaker

__all__ = [
    "EVAL_NAMESPACE",
    "ROLLOUT_NAMESPACE",
    "SHAPING_MODES",
    "AdvantageShapingConfig",
    "BaseScorer",
    "BaseTrajectoryScorer",
    "CircuitBreaker",
    "FrozenLakeProgressScorer",
    "LLMJudgeScorer",
    "LengthBudgetScorer",
    "MetricsAccumulator",
    "PRMConfig",
    "PRMMetricObservation",
    "PRMModelScorer",
    "PRMRunner",
    "PRMScorerResult",
    "PRMTurnResult",
    "RunResult",
    "ScorerHTTPError",
    "ScorerSpec",
    "ScorerUnavailable",
    "ScoringRejected",
    "SessionScores",
    "SokobanProgressScorer",
    "check_scorer_specs",
    "frozenlake_progress_score",
    "namespace_for",
    "resolve_scorer_class",
    "score_branch",
    "sokoban_progress_score",
    "validate_prm_config",
]
