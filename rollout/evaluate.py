"""Held-out evaluation: sampled success and pass@k over task lists (layer 4).

The paper's FrozenLake metric samples every held-out task ``k`` times (temperature 1) and reports
the mean success over all samples ("sampled success") and the fraction of tasks with at least one
success (pass@k). A greedy pass (temperature 0, one sample) is reported next to it because the two
can move very differently during training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from rollout.chat import ChatTokenizer, PromptBuilder
from rollout.client import GenerationClient, SamplingParams
from rollout.envs.base import Env
from rollout.tree import TreeConfig, run_groups

__all__ = ["evaluate_tasks"]


async def evaluate_tasks(tasks: Sequence[Any], *, env_factory: Callable[[], Env], client: GenerationClient,
                         prompts: PromptBuilder | ChatTokenizer, samples: int = 4, max_turns: int = 10,
                         sampling: SamplingParams = SamplingParams(), greedy: bool = True,
                         seed: int = 0) -> dict[str, float]:
    """Evaluate ``tasks``: ``samples`` independent episodes each at ``sampling`` (no loop stop),
    plus one greedy episode each when ``greedy``.

    Returns ``{"sampled_success", "pass@{samples}", "mean_turns", "greedy_success", "tasks",
    "episodes"}`` (success = the episode ended with status ``success``).
    """
    if not tasks:
        raise ValueError("tasks is empty")
    if not isinstance(prompts, PromptBuilder):
        prompts = PromptBuilder(prompts)
    cfg = TreeConfig(strategy="flat", group_size=samples, max_turns=max_turns, theta=None, sampling=sampling,
                     seed=seed)
    groups = await run_groups(tasks, env_factory=env_factory, client=client, prompts=prompts, config=cfg,
                              group_seed=seed, scorer=None)
    episodes = [lf for g in groups for lf in g.leaves]
    out: dict[str, float] = {
        "tasks": float(len(tasks)),
        "episodes": float(len(episodes)),
        "sampled_success": sum(lf.status == "success" for lf in episodes) / max(len(episodes), 1),
        f"pass@{samples}": sum(any(lf.status == "success" for lf in g.leaves) for g in groups) / len(groups),
        "mean_turns": sum(lf.turns for lf in episodes) / max(len(episodes), 1),
    }
    if greedy:
        gcfg = dataclasses.replace(cfg, group_size=1, sampling=dataclasses.replace(sampling, temperature=0.0))
        ggroups = await run_groups(tasks, env_factory=env_factory, client=client, prompts=prompts, config=gcfg,
                                   group_seed=seed + len(tasks), scorer=None)
        out["greedy_success"] = sum(lf.status == "success" for g in ggroups for lf in g.leaves) / len(ggroups)
    return out
