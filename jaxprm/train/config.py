"""Typed trainer configuration: loading, overrides and validation of the YAML schema
(:mod:`jaxprm.train.schema`, re-exported here).

``load_config(path, overrides)`` merges the embedded defaults, a YAML file (optional) and
``key.sub=value`` overrides (values parsed as YAML) with OmegaConf structured configs, then
:func:`validate` checks ranges and cross-field rules. Every problem is a :class:`ConfigError` naming
the dotted key and the allowed values; an unknown key is answered with a "did you mean". The
process-reward rules are the scorers' own (``scorers.validate_prm_config``), called with the
trainer's key names; scorer classes are resolved and their kwargs checked at load time.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from jaxprm.train.schema import (  # noqa: F401  (the sections, re-exported: callers import them from here)
    ModelConfig,
    ServerConfig,
    BranchScorerSpec,
    ARPOConfig,
    DAPOConfig,
    RolloutConfig,
    EnvConfig,
    AgentConfig,
    ScorerSpec,
    ShapingConfig,
    PRMSection,
    AdvantageSection,
    OptimizerConfig,
    PPOConfig,
    WarmStartConfig,
    EvalConfig,
    CheckpointConfig,
    CompileCacheConfig,
    MeshConfig,
    DistributedConfig,
    TrainConfig,
)
from jaxprm.fields import FieldError
from jaxprm.train.schema import __all__ as SCHEMA_NAMES
from rollout.envs.registry import get_env
from rollout.envs.sokoban import MAX_BOXES as SOKOBAN_MAX_BOXES
from rollout.envs.sokoban import MAX_SIZE as SOKOBAN_MAX_SIZE
from rollout.envs.sokoban import MIN_SIZE as SOKOBAN_MIN_SIZE
from rollout.groups import FLAT_STRATEGIES
from scorers import check_scorer_specs, resolve_scorer_class, validate_prm_config

__all__ = [
    "ConfigError",
    "FLAT_STRATEGIES",
    *SCHEMA_NAMES,
    "load_config",
    "to_dict",
    "dump_yaml",
    "config_hash",
    "validate",
]


class ConfigError(ValueError):
    """A bad configuration value or key; the message names the dotted key."""


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- dotted overrides (in order), then :func:`validate`."""
    layers = [OmegaConf.structured(TrainConfig)]
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {p}: invalid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {p}: top level must be a mapping")
        layers.append(loaded)
    layers += [_override(ov) for ov in overrides or []]
    try:
        merged = OmegaConf.merge(*[OmegaConf.create(x) if isinstance(x, dict) else x for x in layers])
        cfg = OmegaConf.to_object(merged)  # each section's own __post_init__ validates its fields
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None
    except FieldError as e:
        raise ConfigError(f"{_section_key(e.owner)}{e}") from None
    except (ValueError, TypeError) as e:  # the scorers' configs name their own keys (prm.timeout_s, ...)
        raise ConfigError(str(e)) from None
    return validate(cfg)


def _section_key(owner: type | None, tp: Any = None, prefix: str = "") -> str:
    """The dotted YAML key (with a trailing dot) of the section whose class is ``owner`` ("" if none)."""
    tp = TrainConfig if tp is None else tp
    for name, hint in typing.get_type_hints(tp).items():
        if dataclasses.is_dataclass(hint):
            if hint is owner:
                return f"{prefix}{name}."
            found = _section_key(owner, hint, f"{prefix}{name}.")
            if found:
                return found
    return ""


def _override(ov: str) -> dict[str, Any]:
    """``a.b.c=value`` -> ``{"a": {"b": {"c": value}}}`` with ``value`` parsed as YAML."""
    if "=" not in ov:
        raise ConfigError(f"override {ov!r} must look like key.sub=value")
    key, text = ov.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {ov!r}: empty key segment")
    try:
        value = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        value = text
    for part in reversed(parts):
        value = {part: value}
    return value


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain YAML data (nested dicts; sequences as lists)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def config_hash(obj: Any) -> str:
    """A short stable hash of a config (dataclass or JSON-like data)."""
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else obj
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Errors: OmegaConf's exceptions -> messages that name the key, the expected type or allowed values
# --------------------------------------------------------------------------------------------


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _schema_at(key: str) -> tuple[Any, Any]:
    """(the annotated type at dotted ``key``, the dataclass that holds it) in ``TrainConfig``."""
    tp, parent = TrainConfig, None
    for part in re.findall(r"[^.\[\]]+", key):
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return None, tp
            parent, tp = tp, hints[part]
        elif typing.get_origin(tp) is list:
            parent, tp = tp, typing.get_args(tp)[0]
        else:
            return None, parent
    return tp, parent


def _expected(tp: Any, value: Any) -> str | None:
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (
        typing.Union, types.UnionType) else [tp]
    if len(args) != 1:
        return f"got {value!r}; expected {_type_name(tp)}"
    (t,) = args
    if typing.get_origin(t) is Literal:
        allowed = typing.get_args(t)
        hint = _suggest(str(value), [str(a) for a in allowed]) if isinstance(value, str) else ""
        return f"got {value!r}; allowed values: {', '.join(repr(a) for a in allowed)}{hint}"
    if dataclasses.is_dataclass(t):
        return f"expected a mapping for section {t.__name__}, got {value!r}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if t in names:
        return f"expected {names[t]}, got {value!r}"
    if typing.get_origin(t) is list:
        return f"expected a list of {_type_name(typing.get_args(t)[0])}, got {value!r}"
    if typing.get_origin(t) is dict:
        return f"expected a mapping, got {value!r}"
    return None


def _explain(e: OmegaConfBaseException) -> str:
    key = str(getattr(e, "full_key", None) or getattr(e, "key", None) or "")
    if isinstance(e, ConfigKeyError) or "not in" in str(getattr(e, "msg", "")):
        parent_key, _, name = key.rpartition(".")
        _, holder = _schema_at(key)
        fields = [f.name for f in dataclasses.fields(holder)] if dataclasses.is_dataclass(holder) else []
        return (f"unknown config key {key!r}{_suggest(name, fields)}"
                + (f" (keys of {parent_key or 'the top level'}: {', '.join(fields)})" if fields else ""))
    tp, _ = _schema_at(key)
    detail = _expected(tp, getattr(e, "value", None)) if tp is not None else None
    msg = str(getattr(e, "msg", "") or e).splitlines()[0]
    return f"{key}: {detail or msg}" if key else msg


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _positive(cfg: Any, section: str, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(cfg, n)
        if v is None:
            continue
        ok = v >= 0 if allow_zero else v > 0
        _check(ok and math.isfinite(v), f"{section}.{n}", f"must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


#: The trainer's YAML keys for the settings the scorers' validator checks.
PRM_RULE_KEYS = {
    "export_style": "rollout.export",
    "token_backed": "server.token_backed",
    "token_rewards_as_adv": "advantage.token_rewards_as_adv",
    "mask_no_eos_with_zero": "advantage.mask_no_eos_with_zero",
    "scorers": "prm.scorers",
}


def validate_prm(cfg: TrainConfig) -> None:
    """The process-reward rules (the scorers' validator, with the trainer's keys) and the branch scorer."""
    try:
        validate_prm_config(
            cfg.prm, export_style="concat", token_backed=cfg.server.token_backed,  # tree_packed packs concat rows
            token_rewards_as_adv=cfg.advantage.token_rewards_as_adv,
            mask_no_eos_with_zero=cfg.advantage.mask_no_eos_with_zero,
            external_string_backend=cfg.server.kind == "external" and not cfg.server.token_backed,
            keys=PRM_RULE_KEYS, resolve=True, build=True)
        if cfg.rollout.strategy == "patr":
            spec = ScorerSpec(path=cfg.rollout.branch_scorer.path, kwargs=cfg.rollout.branch_scorer.kwargs)
            check_scorer_specs([spec], where="rollout.branch_scorer", build=True)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).replace("rollout.branch_scorer[0]", "rollout.branch_scorer")) from None
    specs = [(f"prm.scorers[{i}].path", sp.path) for i, sp in enumerate(cfg.prm.scorers)] if cfg.prm.active else []
    if cfg.rollout.strategy == "patr":
        specs.append(("rollout.branch_scorer.path", cfg.rollout.branch_scorer.path))
    for key, path in specs:  # a scorer that reads one environment's recorded states needs that environment
        wanted = getattr(resolve_scorer_class(path, where=key), "env_name", None)
        _check(wanted in (None, cfg.env.name), key,
               f"{path} reads {wanted} states, but env.name is {cfg.env.name} "
               f"(its progress scorer: {get_env(cfg.env.name).progress_scorer})")


def validate_agent(cfg: TrainConfig) -> None:
    """``rollout.source: agent`` rules: flat groups, a ``package.module:function`` workflow, bounds."""
    ag = cfg.agent
    _positive(ag, "agent", "timeout_s", "concurrency", "session_timeout_s")
    _check(0 <= ag.discount <= 1, "agent.discount", f"must be in [0, 1], got {ag.discount}")
    _check(isinstance(ag.processes, int) and ag.processes >= 0, "agent.processes",
           f"must be an integer >= 0 (0: the agents run on the trainer's event loop), got {ag.processes!r}")
    if cfg.rollout.source != "agent":
        return
    _check(cfg.rollout.strategy == "flat", "rollout.strategy",
           f"rollout.source 'agent' runs flat groups (group_size sessions per task); got {cfg.rollout.strategy!r} "
           "(allowed: 'flat'; PaTR and tree_random fork environment states and stay on rollout.source 'tree')")
    _check(cfg.advantage.estimator == "leaf_grpo", "advantage.estimator",
           f"rollout.source 'agent' exports rows without their turns' tree and states; got "
           f"{cfg.advantage.estimator!r} (allowed: 'leaf_grpo')")
    played = {"rollout.agents.frozenlake_chat:run": "frozenlake",  # the shipped example agents' game
              "rollout.agents.grid_chat:run": ag.kwargs.get("env", "frozenlake")}.get(ag.workflow)
    _check(played in (None, cfg.env.name), "agent.workflow",
           f"{ag.workflow} plays {played}, but env.name is {cfg.env.name} (use rollout.agents.grid_chat:run with "
           f"agent.kwargs.env: {cfg.env.name})")
    mod, sep, fn = ag.workflow.partition(":")
    _check(bool(mod) and sep == ":" and bool(fn) and ":" not in fn, "agent.workflow",
           f"must look like package.module:function, got {ag.workflow!r}")
    if cfg.prm.active:
        _check(ag.chat_template_type == "concat", "agent.chat_template_type",
               f"active process-reward scorers need 'concat', got {ag.chat_template_type!r}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range and cross-field checks; raises :class:`ConfigError` naming the key."""
    _check(cfg.steps >= 0, "steps", f"must be >= 0, got {cfg.steps}")
    _positive(cfg, "", "log_every")
    r = cfg.rollout  # the group's shape (rollout.groups.TreeParams) validated itself on loading
    _positive(r, "rollout", "tasks_per_step", "max_new_tokens")
    _check(0 < r.temperature <= 10, "rollout.temperature", f"must be in (0, 10], got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _positive(r, "rollout", "max_staleness", allow_zero=True)
    _positive(r.dapo, "rollout.dapo", "max_rounds", "max_tokens_per_step")
    _positive(r.dapo, "rollout.dapo", "overlong_factor", allow_zero=True)
    if r.dapo.overlong_buffer is not None:
        _check(0 <= r.dapo.overlong_buffer <= r.max_new_tokens, "rollout.dapo.overlong_buffer",
               f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}], got {r.dapo.overlong_buffer}")
    if r.asynchronous:
        _check(r.source == "tree", "rollout.asynchronous",
               "needs rollout.source=tree (the recording proxy's agents are rolled out step by step)")
        _check(not cfg.distributed.enabled, "rollout.asynchronous", "is single-process (not with distributed.enabled)")
    _check(not (cfg.model.lora.enabled and cfg.distributed.enabled), "model.lora",
           "is single-process for now (not with distributed.enabled: the frozen weights are not placed on the global mesh)")
    validate_agent(cfg)
    e = cfg.env
    if e.name == "sokoban":
        _check(SOKOBAN_MIN_SIZE <= e.size <= SOKOBAN_MAX_SIZE, "env.size",
               f"a Sokoban room is {SOKOBAN_MIN_SIZE} to {SOKOBAN_MAX_SIZE} cells a side, got {e.size}")
        _check(1 <= e.boxes <= SOKOBAN_MAX_BOXES, "env.boxes", f"must be in [1, {SOKOBAN_MAX_BOXES}], got {e.boxes}")
        _check(e.min_distance >= 1, "env.min_distance", f"must be >= 1, got {e.min_distance}")
    else:
        _check(2 <= e.size <= 16, "env.size", f"must be in [2, 16], got {e.size}")
        _check(0 < e.p <= 1, "env.p", f"must be in (0, 1], got {e.p}")
    _positive(e, "env", "max_turns", "train_tasks", "eval_tasks")
    o = cfg.optimizer
    _positive(o, "optimizer", "lr", "grad_clip", "eps")
    _positive(o, "optimizer", "weight_decay", "warmup_steps", allow_zero=True)
    _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optimizer.b1/b2", "must be in [0, 1)")
    _check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    p = cfg.ppo
    _positive(p, "ppo", "epochs", "num_minibatches", "eps_clip", "eps_clip_higher", "max_rows", "microbatch_rows")
    _positive(p, "ppo", "entropy_coef", allow_zero=True)
    _check(p.c_clip is None or p.c_clip > 1, "ppo.c_clip", f"dual clip must be > 1 (or null), got {p.c_clip}")
    _positive(p, "ppo", "behave_cap", "target_kl")
    _check(not (p.decoupled and p.behave_mode == "mask_sequence" and cfg.rollout.export == "tree_packed"),
           "ppo.behave_mode", "mask_sequence needs rollout.export: concat (a packed token is shared by several "
           "sequences); use truncate or mask with tree_packed")
    _check(bool(p.len_buckets) and all(b > 0 for b in p.len_buckets), "ppo.len_buckets", "must be a non-empty list of positive ints")
    _check(bool(p.packed_len_buckets) and all(b > 0 for b in p.packed_len_buckets), "ppo.packed_len_buckets",
           "must be a non-empty list of positive ints")
    if p.max_rows is not None:
        _check(p.max_rows % p.num_minibatches == 0, "ppo.max_rows",
               f"must be divisible by ppo.num_minibatches ({p.num_minibatches}), got {p.max_rows}")
    w = cfg.warm_start
    _positive(w, "warm_start", "num_demos", "steps", "batch_size", "max_batch_tokens", "lr")
    _check(0 <= w.optimal_prob <= 1, "warm_start.optimal_prob", f"must be in [0, 1], got {w.optimal_prob}")
    ev = cfg.eval
    _positive(ev, "eval", "every_steps", "num_tasks", "samples", "temperature")
    _check(ev.num_tasks <= e.eval_tasks, "eval.num_tasks", f"must be <= env.eval_tasks ({e.eval_tasks})")
    _check(cfg.token_budget is None or cfg.token_budget > 0, "token_budget", f"must be > 0, got {cfg.token_budget}")
    if ev.token_fractions is not None:
        _check(cfg.token_budget is not None, "eval.token_fractions", "needs token_budget (fractions of what?)")
        _check(len(ev.token_fractions) > 0 and all(0 < f <= 1 for f in ev.token_fractions), "eval.token_fractions",
               f"must be a non-empty list of numbers in (0, 1], got {ev.token_fractions}")
    _positive(cfg.checkpoint, "checkpoint", "every_steps", "keep")
    m = cfg.mesh
    for n in ("data", "fsdp"):
        v = getattr(m, n)
        _check(v == -1 or v >= 1, f"mesh.{n}", f"must be -1 (all remaining devices) or >= 1, got {v}")
    _check(not (m.data == -1 and m.fsdp == -1), "mesh", "at most one axis may be -1")
    d = cfg.distributed
    if d.enabled and d.coordinator_address is not None:
        _check(d.num_processes is not None and d.process_id is not None, "distributed",
               "coordinator_address needs num_processes and process_id")
    validate_prm(cfg)
    return cfg
