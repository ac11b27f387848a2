"""Statistics over rolled-out groups (layer 4): tree accounting for training rows and logs
(:func:`describe_groups`) and the evaluation summary (:func:`summarize_groups`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rollout.groups import GroupResult, LeafRecord

__all__ = ["describe_groups", "summarize_groups"]


def describe_groups(groups: Sequence[GroupResult]) -> dict[str, Any]:
    """Aggregate stats over groups (for logs): success rates and tree accounting."""
    n = max(len(groups), 1)
    tot = lambda name: sum(getattr(g.stats, name) for g in groups)  # noqa: E731
    leaves = max(tot("leaves"), 1)
    return {
        "groups": len(groups),
        "trajectories": tot("leaves"),
        "success_rate": tot("successes") / leaves,
        "groups_with_success": sum(1 for g in groups if g.stats.any_success) / n,
        "mixed_groups": sum(1 for g in groups if 0 < g.stats.successes < g.stats.leaves) / n,
        "sampled_actions": tot("sampled_actions"),
        "invalid_rate": tot("invalid_actions") / max(tot("sampled_actions"), 1),
        "expanded": tot("expanded"),
        "pruned": tot("pruned"),
        "loop_stopped": tot("loop_stopped"),
        "refills": tot("refills"),
        "checkpoints": sum(len(g.stats.checkpoints) for g in groups),
        "per_checkpoint": _per_checkpoint(groups),
        "generated_tokens": tot("generated_tokens"),
        "prompt_tokens": tot("prompt_tokens"),
        "sibling_shared_tokens": tot("sibling_shared_tokens"),
    }


def _per_checkpoint(groups: Sequence[GroupResult]) -> list[dict[str, int]]:
    """Summed active / expanded / children / pruned / survived at checkpoint index 0, 1, ..."""
    out: list[dict[str, int]] = []
    for g in groups:
        for c in g.stats.checkpoints:
            while len(out) <= c.index:
                out.append({"index": len(out), "active": 0, "expanded": 0, "children": 0, "pruned": 0, "survived": 0})
            for k in ("active", "expanded", "children", "pruned", "survived"):
                out[c.index][k] += getattr(c, k)
    return out


def _last_states(groups: Sequence[GroupResult]) -> list[tuple[LeafRecord, dict[str, Any]]]:
    """Each leaf with the environment state recorded after its last turn."""
    return [(lf, g.tree.get(lf.leaf_id).env_state or {}) for g in groups for lf in g.leaves if lf.leaf_id in g.tree]


def summarize_groups(groups: Sequence[GroupResult], prefix: str = "") -> dict[str, float]:
    """The evaluation summary: success (mean over all episodes), pass@k (groups with any success),
    mean turns, generated tokens per response, the rate of episodes that ended in a hole (status
    ``done``) and of invalid answers among all sampled turns.

    From the states the environment records: ``steps_over_optimal``, the mean over successful
    episodes of ``turns - start_distance`` (moves beyond a shortest solution; both grid games
    record ``start_distance``), and where the environment records ``dead`` (Sokoban),
    ``dead_rate``, the episodes that ended in a state that can no longer be solved."""
    leaves = [lf for g in groups for lf in g.leaves]
    states = _last_states(groups)
    extra: dict[str, float] = {}
    over = [lf.turns - st["start_distance"] for lf, st in states
            if lf.status == "success" and isinstance(st.get("start_distance"), int) and st["start_distance"] >= 0]
    if over:
        extra[f"{prefix}steps_over_optimal"] = float(np.mean(over))
    if any("dead" in st for _, st in states):
        extra[f"{prefix}dead_rate"] = sum(bool(st.get("dead")) for _, st in states) / max(len(states), 1)
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
        **extra,
    }
