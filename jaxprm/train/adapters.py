"""Translations from the trainer's ``TrainConfig`` to each package's own configuration.

Every other trainer module takes its own small config (``step.py`` the optimizer section and a count
of updates, ``warmstart.py`` the warm-start section and a cache key, ``rollout.evaluate`` its
``EvalSettings``); the mapping from the YAML sections to those lives here, in one place, so an
interface change elsewhere is absorbed here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jaxprm
from jaxprm.train.config import TrainConfig
from rollout.client import SamplingParams
from rollout.envs import sokoban
from rollout.envs.base import Env
from rollout.envs.frozenlake import make_tasks
from rollout.chat import PromptBuilder
from rollout.envs.registry import get_env
from rollout.envs.tool_moves import tool_prompts
from rollout.evaluate import EvalSettings
from rollout.groups import TreeConfig
from scorers import BaseScorer, resolve_scorer_class

__all__ = [
    "advantage_config",
    "branch_scorer",
    "env_factory",
    "eval_settings",
    "loss_kwargs",
    "prompt_builder",
    "row_capacity",
    "tasks",
    "total_updates",
    "tree_config",
    "warm_start_key_data",
]


def advantage_config(cfg: TrainConfig) -> jaxprm.AdvantageConfig:
    """``jaxprm.AdvantageConfig``: the ``advantage`` section (its ``AdvantageParams``) with the
    shaping of ``prm.advantage_shaping`` (no shaping when the process rewards are off)."""
    sh = cfg.prm.advantage_shaping
    return jaxprm.AdvantageConfig.from_params(
        cfg.advantage, shaping_mode=sh.mode if cfg.prm.active else None,
        negative_scale=sh.negative_scale, zero_penalty=sh.zero_penalty, zero_eps=sh.zero_eps)


def env_factory(cfg: TrainConfig) -> Callable[[], Env]:
    """A zero-argument constructor of the configured environment (``env.name``, with
    ``env.system_prompt``, ``env.invalid_ends_episode`` and ``env.action_format`` applied)."""
    return get_env(cfg.env.name).factory(cfg.env.system_prompt, invalid_ends_episode=cfg.env.invalid_ends_episode,
                                         action_format=cfg.env.action_format)


def prompt_builder(cfg: TrainConfig, tokenizer: Any) -> PromptBuilder:
    """The prompts of the configured ``env.action_format`` (tools and the call's prefill for ``tool_call``)."""
    return tool_prompts(tokenizer) if cfg.env.action_format == "tool_call" else PromptBuilder(tokenizer)


def tasks(cfg: TrainConfig) -> tuple[list[Any], list[Any]]:
    """The training tasks and the held-out tasks the evaluation uses (``eval.num_tasks`` of them)."""
    e = cfg.env
    if e.name == "sokoban":
        train, held_out = sokoban.make_tasks(e.seed, e.train_tasks, e.eval_tasks, size=e.size, boxes=e.boxes,
                                             max_turns=e.max_turns, min_distance=e.min_distance)
    else:
        train, held_out = make_tasks(e.seed, e.train_tasks, e.eval_tasks, sizes=(e.size,), p_frozen=e.p,
                                     max_turns=e.max_turns, random_start_goal=e.random_start_goal)
    return train, held_out[: cfg.eval.num_tasks]


def tree_config(cfg: TrainConfig, *, max_context: int | None) -> TreeConfig:
    """The rollout strategy of one training group: the ``rollout`` section's group shape (its
    ``TreeParams``) with the run's turns, sampling, context bound and seed."""
    r = cfg.rollout
    return TreeConfig.from_params(
        r, max_turns=cfg.env.max_turns, max_context_tokens=max_context, seed=cfg.seed,
        sampling=SamplingParams(max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p))


def eval_settings(cfg: TrainConfig, *, max_context: int | None) -> EvalSettings:
    ev = cfg.eval
    return EvalSettings(samples=ev.samples, temperature=ev.temperature, greedy=ev.greedy,
                        max_turns=cfg.env.max_turns, max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed,
                        max_context_tokens=max_context)


def branch_scorer(cfg: TrainConfig) -> BaseScorer | None:
    """PaTR's branch scorer built from ``rollout.branch_scorer`` (``None`` for other strategies)."""
    if cfg.rollout.strategy != "patr":
        return None
    spec = cfg.rollout.branch_scorer
    cls = resolve_scorer_class(spec.path, where="rollout.branch_scorer.path")
    return cls(**spec.kwargs)


def loss_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    p = cfg.ppo
    return dict(eps_clip=p.eps_clip, eps_clip_higher=p.eps_clip_higher, c_clip=p.c_clip, agg=p.agg)


def total_updates(cfg: TrainConfig) -> int:
    """Optimizer updates over the whole run (the schedule's horizon)."""
    return max(1, cfg.steps * cfg.ppo.epochs * cfg.ppo.num_minibatches)


def row_capacity(cfg: TrainConfig, n_devices: int) -> int:
    """Fixed learner batch rows: ``ppo.max_rows`` or tasks x group budget, rounded up to a multiple
    of the minibatch count and the device count."""
    r = cfg.rollout
    cap = cfg.ppo.max_rows or r.tasks_per_step * r.budget
    mult = math.lcm(cfg.ppo.num_minibatches, n_devices)
    return int(-(-cap // mult) * mult)


_SOKOBAN_ONLY = ("boxes", "min_distance")


def _env_key(cfg: TrainConfig) -> dict[str, Any]:
    """The ``env`` section as the warm start's cache key sees it: a FrozenLake key leaves out the
    Sokoban-only fields, so the caches made before Sokoban existed still match."""
    env = dataclasses.asdict(cfg.env)
    if cfg.env.name == "frozenlake":
        for key in _SOKOBAN_ONLY:
            env.pop(key)
    return env


def warm_start_key_data(cfg: TrainConfig, model_config: Any = None) -> dict[str, Any]:
    """Everything that determines the warm-started params (``model_config``: the resolved
    ``jaxprm.models.ModelConfig``, so an architecture or init change misses the cache)."""
    resolved = dataclasses.asdict(model_config) if model_config is not None else None
    # v4: rows of >= 256 tokens attend in causal query chunks (float rounding differs from v3's)
    return {"v": 4, "model": dataclasses.asdict(cfg.model), "model_config": resolved,
            "env": _env_key(cfg),
            # max_batch_tokens only when set: the caches written before it existed stay valid
            "warm_start": {k: v for k, v in dataclasses.asdict(cfg.warm_start).items()
                           if k != "cache_dir" and not (k == "max_batch_tokens" and v is None)},
            "seed": cfg.seed}
