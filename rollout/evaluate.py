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
from rollout.stats import summarize_groups
from rollout.tree import GroupResult, TreeConfig, run_groups

__all__ = ["EvalSettings", "EvalResult", "evaluate"]

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


@dataclasses.dataclass
class EvalResult:
    """``metrics``: ``success``, ``pass_at_<samples>``, ``turns``, ``response_tokens``, ``hole_rate``,
    ``invalid_rate`` (and ``greedy_success``, ``greedy_turns``); ``groups``: the sampled groups."""

    metrics: dict[str, float]
    groups: list[GroupResult]


async def evaluate(tasks: Sequence[Any], *, client: GenerationClient, prompts: PromptBuilder | ChatTokenizer,
                   env_factory: Callable[[], Env], settings: EvalSettings = EvalSettings()) -> EvalResult:
    """Run the evaluation protocol (see the module docstring) on ``tasks``."""
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
                              config=tree(s.samples, s.temperature), group_seed=SAMPLED_SEED_BASE + s.seed * 1000)
    summary = summarize_groups(groups)
    metrics = {
        "success": summary["success"],
        f"pass_at_{s.samples}": summary["pass_at_k"],
        "turns": summary["turns"],
        "response_tokens": summary["response_tokens"],
        "hole_rate": summary["hole_rate"],
        "invalid_rate": summary["invalid_rate"],
    }
    if s.greedy:
        greedy = await run_groups(list(tasks), env_factory=env_factory, client=client, prompts=prompts,
                                  config=tree(1, 0.0), group_seed=GREEDY_SEED_BASE + s.seed * 1000)
        gs = summarize_groups(greedy)
        metrics["greedy_success"] = gs["success"]
        metrics["greedy_turns"] = gs["turns"]
    return EvalResult(metrics=metrics, groups=groups)
