"""Held-out evaluation (layer 4): the paper's protocol plus a greedy pass.

Every held-out task is played ``samples`` times at the eval temperature as a flat group (no loop
stop): success is the mean over all episodes ("sampled success") and pass@k the fraction of tasks
with at least one success. A greedy pass (temperature 0, one episode per task) is reported next to
it because the two can move very differently during training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from rollout.chat import ChatTokenizer, PromptBuilder
from rollout.client import GenerationClient, SamplingParams
from rollout.envs.base import Env
from rollout.groups import GroupResult, TreeConfig
from rollout.stats import summarize_groups
from rollout.tree import run_groups

__all__ = ["EvalSettings", "EvalResult", "eval_metrics", "evaluate"]

#: Group seeds of the evaluation episodes (``+ 1000 * seed``), apart from any training group's.
SAMPLED_SEED_BASE = 10_000_000
GREEDY_SEED_BASE = 20_000_000


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How to evaluate: ``samples`` episodes per task at ``temperature`` (and one greedy episode when
    ``greedy``), ``max_turns`` per episode, ``max_new_tokens`` per turn, a base ``seed``."""

    samples: int = 4
    temperature: float = 1.0
    greedy: bool = True
    max_turns: int = 10
    max_new_tokens: int = 8
    seed: int = 0
    max_context_tokens: int | None = None


#: Metrics from the environment's recorded states, where it records them (``rollout.stats``).
_STATE_METRICS = ("steps_over_optimal", "dead_rate")


@dataclasses.dataclass
class EvalResult:
    """``metrics``: ``success``, ``pass_at_<samples>``, ``turns``, ``response_tokens``, ``hole_rate``,
    ``invalid_rate``, ``steps_over_optimal`` (with any success), ``dead_rate`` (Sokoban) (and
    ``greedy_success``, ``greedy_turns`` and the greedy pass's state metrics); ``groups``: the sampled groups;
    ``greedy_groups``: the greedy pass's (empty without it)."""

    metrics: dict[str, float]
    groups: list[GroupResult]
    greedy_groups: list[GroupResult] = dataclasses.field(default_factory=list)


def eval_metrics(groups: Sequence[GroupResult], greedy_groups: Sequence[GroupResult],
                 settings: EvalSettings = EvalSettings()) -> dict[str, float]:
    """The evaluation's metrics of its sampled ``groups`` and its ``greedy_groups`` (see
    :class:`EvalResult`); the groups of several shares of the tasks, concatenated, give the metrics
    of all of them (a distributed trainer evaluates a share per process)."""
    summary = summarize_groups(list(groups))
    metrics = {
        "success": summary["success"],
        f"pass_at_{settings.samples}": summary["pass_at_k"],
        "turns": summary["turns"],
        "response_tokens": summary["response_tokens"],
        "hole_rate": summary["hole_rate"],
        "invalid_rate": summary["invalid_rate"],
        **{k: summary[k] for k in _STATE_METRICS if k in summary},
    }
    if settings.greedy:
        gs = summarize_groups(list(greedy_groups))
        metrics["greedy_success"] = gs["success"]
        metrics["greedy_turns"] = gs["turns"]
        metrics.update({f"greedy_{k}": gs[k] for k in _STATE_METRICS if k in gs})
    return metrics


async def evaluate(tasks: Sequence[Any], *, client: GenerationClient, prompts: PromptBuilder | ChatTokenizer,
                   env_factory: Callable[[], Env], settings: EvalSettings = EvalSettings(),
                   group_offset: int = 0) -> EvalResult:
    """Run the evaluation protocol (see the module docstring) on ``tasks``; task ``i`` is group
    ``group_offset + i`` of the protocol's seeds (a share of a longer task list keeps its seeds)."""
    if not tasks:
        raise ValueError("tasks is empty")
    if not isinstance(prompts, PromptBuilder):
        prompts = PromptBuilder(prompts)
    s = settings

    def tree(n: int, temperature: float) -> TreeConfig:
        return TreeConfig(strategy="flat", group_size=n, theta=None, max_turns=s.max_turns, max_branches=None,
                          sampling=SamplingParams(max_tokens=s.max_new_tokens, temperature=temperature),
                          max_context_tokens=s.max_context_tokens, seed=s.seed)

    groups = await run_groups(list(tasks), env_factory=env_factory, client=client, prompts=prompts,
                              config=tree(s.samples, s.temperature),
                              group_seed=SAMPLED_SEED_BASE + s.seed * 1000 + group_offset)
    greedy = []
    if s.greedy:
        greedy = await run_groups(list(tasks), env_factory=env_factory, client=client, prompts=prompts,
                                  config=tree(1, 0.0), group_seed=GREEDY_SEED_BASE + s.seed * 1000 + group_offset)
    return EvalResult(metrics=eval_metrics(groups, greedy, s), groups=groups, greedy_groups=greedy)
