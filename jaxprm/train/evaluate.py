"""Held-out evaluation: sampled success (``samples`` per map), pass@k, greedy success, turns, length.

Every held-out map is played ``samples`` times at the eval temperature (flat groups, the paper's
protocol: success = mean over all samples; pass@k = fraction of maps with at least one success) and,
if enabled, once greedily (temperature 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["evaluate", "summarize_groups"]


def summarize_groups(groups: Sequence[Any], prefix: str = "") -> dict[str, float]:
    """Success, pass@k (any success per group), mean turns, tokens per response, the rate of episodes
    that ended in a hole (status ``done``) and of invalid answers among all sampled turns."""
    leaves = [lf for g in groups for lf in g.leaves]
    n = max(len(leaves), 1)
    actions = sum(g.stats.sampled_actions for g in groups)
    gen = sum(g.stats.generated_tokens for g in groups)
    invalid = sum(g.stats.invalid_actions for g in groups)
    return {
        f"{prefix}success": sum(lf.status == "success" for lf in leaves) / n,
        f"{prefix}pass_at_k": float(np.mean([any(lf.status == "success" for lf in g.leaves) for g in groups])) if groups else 0.0,
        f"{prefix}turns": float(np.mean([lf.turns for lf in leaves])) if leaves else 0.0,
        f"{prefix}response_tokens": gen / max(actions, 1),
        f"{prefix}hole_rate": sum(lf.status == "done" for lf in leaves) / n,
        f"{prefix}invalid_rate": invalid / max(actions, 1),
    }


async def evaluate(tasks: Sequence[Any], *, client: Any, prompts: Any, env_factory: Any, samples: int,
                   temperature: float, greedy: bool, max_turns: int, max_new_tokens: int, seed: int,
                   max_context_tokens: int | None = None) -> dict[str, float]:
    """Run the eval protocol on ``tasks``; returns ``success``, ``pass_at_<samples>``, ``greedy_success``, ..."""
    from rollout.client import SamplingParams
    from rollout.tree import TreeConfig, run_groups

    def tree(n: int, temp: float) -> TreeConfig:
        return TreeConfig(strategy="flat", group_size=n, theta=None, max_turns=max_turns, max_branches=None,
                          sampling=SamplingParams(max_tokens=max_new_tokens, temperature=temp),
                          max_context_tokens=max_context_tokens, seed=seed)

    groups = await run_groups(list(tasks), env_factory=env_factory, client=client, prompts=prompts,
                              config=tree(samples, temperature), group_seed=10_000_000 + seed * 1000)
    s = summarize_groups(groups)
    out = {
        "success": s["success"],
        f"pass_at_{samples}": s["pass_at_k"],
        "turns": s["turns"],
        "response_tokens": s["response_tokens"],
        "hole_rate": s["hole_rate"],
        "invalid_rate": s["invalid_rate"],
    }
    if greedy:
        g = await run_groups(list(tasks), env_factory=env_factory, client=client, prompts=prompts,
                             config=tree(1, 0.0), group_seed=20_000_000 + seed * 1000)
        gs = summarize_groups(g)
        out["greedy_success"] = gs["success"]
        out["greedy_turns"] = gs["turns"]
    return out
