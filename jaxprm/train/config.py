"""Typed trainer configuration: the YAML schema (dataclasses), loading, overrides and validation.

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

from jaxprm.modes import KL_ESTIMATORS, LOSS_AGGREGATIONS, SHAPING_MODES
from rollout.client import DIALECTS
from rollout.tree import GROUP_MODES, STRATEGIES
from scorers import check_scorer_specs, validate_prm_config

__all__ = [
    "ConfigError",
    "ModelConfig",
    "ServerConfig",
    "BranchScorerSpec",
    "RolloutConfig",
    "EnvConfig",
    "AgentConfig",
    "ScorerSpec",
    "ShapingConfig",
    "PRMSection",
    "AdvantageSection",
    "OptimizerConfig",
    "PPOConfig",
    "WarmStartConfig",
    "EvalConfig",
    "CheckpointConfig",
    "CompileCacheConfig",
    "MeshConfig",
    "DistributedConfig",
    "TrainConfig",
    "load_config",
    "to_dict",
    "dump_yaml",
    "config_hash",
    "validate",
]


class ConfigError(ValueError):
    """A bad configuration value or key; the message names the dotted key."""


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelConfig:
    """The policy. ``name`` is a preset (``tiny``, ``smollm2-135m``) or a path to an HF directory
    or a ``.gguf`` file. ``overrides`` are passed to the tiny preset's architecture (e.g. layers)."""

    name: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ServerConfig:
    """Generation server: ``embedded`` starts ``jaxprm.serve`` in-process on a free loopback port
    (with a random API key that only the trainer's client knows; ``/update_weights_from_disk``
    limited to the run directory); ``external`` talks to running vLLM / SGLang servers at ``urls``.

    ``warn_behavior_kl`` / ``max_behavior_kl``: a train row's ``behavior_kl`` (the sampler's
    log-probs against the learner's, before the step's first update; ~0 when the server serves the
    learner's policy) above the first logs a warning, above the second stops the run with an error
    (``null``: never stop)."""

    kind: Literal["embedded", "external"] = "embedded"
    urls: list[str] = dataclasses.field(default_factory=list)
    dialect: Literal[DIALECTS] = "vllm"
    model_name: str | None = None
    api_key: str | None = None
    token_backed: bool = True
    timeout_s: float = 120.0
    max_retries: int = 3
    concurrency: int = 64
    max_batch: int = 64
    batch_window_ms: float = 5.0
    weight_sync_dir: str | None = None  # external: where the policy is saved for /update_weights_from_disk
    warn_behavior_kl: float = 0.05
    max_behavior_kl: float | None = 1.0


@dataclasses.dataclass
class BranchScorerSpec:
    """PaTR's branch scorer: a ``scorers.BaseScorer`` class path and its constructor kwargs (the form of
    a ``prm.scorers`` entry). Its reward for a partial branch's last turn must lie in [0, 1]; e.g.
    ``scorers.LLMJudgeScorer`` (PaTR-Judge) or ``scorers.PRMModelScorer`` (PaTR-PRM)."""

    path: str = "scorers.FrozenLakeProgressScorer"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RolloutConfig:
    """Rollout groups: one group (tree) per task, ``tasks_per_step`` groups per training step.

    ``source``: ``tree`` (the env is driven by ``rollout.tree``: flat / tree_random / patr) or
    ``agent`` (an OpenAI-SDK agent, the ``agent`` section, runs against the recording proxy; flat
    groups of ``group_size`` sessions only: PaTR must fork environment states, so it stays on the
    tree path)."""

    source: Literal["tree", "agent"] = "tree"
    strategy: Literal[STRATEGIES] = "patr"
    tasks_per_step: int = 8
    group_size: int = 8  # flat: G samples; trees: the per-group budget (max_branches if unset)
    b0: int = 4
    k: int = 5
    m: int = 2
    top_k: int = 2
    alpha: float = 0.5
    theta: int = 6
    max_branches: int | None = None
    keep: Literal[GROUP_MODES] = "keep_all"
    refill: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    # concat: one row per leaf (the spec's concat export; "individual", one row per turn, is not offered);
    # tree_packed: the same rows, but the learner forwards each group's shared prefixes once
    export: Literal["concat", "tree_packed"] = "concat"
    filter: Literal[
        "none", "mixed_or_penalized_all_wrong", "mixed_or_penalized_all_wrong_mask_no_eos"
    ] = "none"
    branch_scorer: BranchScorerSpec = dataclasses.field(default_factory=lambda: BranchScorerSpec())


@dataclasses.dataclass
class EnvConfig:
    """FrozenLake tasks: maps of ``size`` x ``size`` with hole probability ``p``.

    ``random_start_goal``: False (default) is gymnasium's layout, start top-left and goal
    bottom-right; True puts start and goal on two random distinct cells (much harder for a small
    policy: the right move then depends on locating both P and G in the text map).

    ``system_prompt``: ``compact`` (default; ~40 tokens instead of ~140 with the tiny tokenizer,
    which matters because every turn re-reads the whole history), ``full`` (the verbose rules, for
    instruct models) or ``none``.

    ``invalid_ends_episode``: an answer without a valid fenced move ends the episode with reward 0
    (default). With false it is a no-op turn, which GRPO learned to exploit as a "safe move" (the
    tiny policy's invalid rate rose from 1% to 16-20% within 20 steps and success fell)."""

    name: Literal["frozenlake"] = "frozenlake"
    system_prompt: Literal["compact", "full", "none"] = "compact"
    invalid_ends_episode: bool = True
    size: int = 4
    p: float = 0.8  # probability that a cell is frozen (gymnasium's convention)
    max_turns: int = 10
    random_start_goal: bool = False
    train_tasks: int = 2048
    eval_tasks: int = 64
    seed: int = 0


@dataclasses.dataclass
class AgentConfig:
    """Agent rollouts through the recording proxy (``rollout.source: agent``).

    ``workflow``: ``package.module:function``, an ``async run(task, base_url, api_key, http_client,
    **kwargs)`` written against the official ``openai`` SDK (``rollout.proxy.workflow``); ``kwargs``
    are passed to it. ``timeout_s`` bounds one agent run; ``concurrency`` agents run at once.
    ``discount``: the export's backward reward discount. ``chat_template_type``: ``concat`` (required
    with process-reward scorers) or ``hf``. ``session_timeout_s``: idle sessions are swept."""

    workflow: str = "rollout.agents.frozenlake_chat:run"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float = 600.0
    concurrency: int = 64
    discount: float = 1.0
    chat_template_type: Literal["concat", "hf"] = "concat"
    session_timeout_s: float = 3600.0


@dataclasses.dataclass
class ScorerSpec:
    path: str = ""
    weight: float = 1.0
    enabled: bool = True
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ShapingConfig:
    mode: Literal[SHAPING_MODES] = "additive"
    negative_scale: float = 0.2
    zero_penalty: float = 0.4
    zero_eps: float = 1e-6


@dataclasses.dataclass
class PRMSection:
    """Process-reward scoring of finished branches (``scorers.PRMRunner``)."""

    enabled: bool = False
    scorers: list[ScorerSpec] = dataclasses.field(default_factory=list)
    advantage_shaping: ShapingConfig = dataclasses.field(default_factory=ShapingConfig)
    max_concurrent_sessions: int = 8  # groups scored at once (the branches of a group in order)
    timeout_s: float = 300.0  # bound on scoring one group; past it the group is rejected

    @property
    def active(self) -> bool:
        return self.enabled and any(s.enabled for s in self.scorers)


@dataclasses.dataclass
class AdvantageSection:
    """Reward processing and advantages (``jaxprm.AdvantageConfig``; the shaping mode and its
    numbers come from ``prm.advantage_shaping``)."""

    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    group_reward_norm: bool = True
    group_reward_std: bool = True
    kl_ctl: float = 0.0
    kl_estimator: Literal[KL_ESTIMATORS] = "k1"
    gamma: float = 1.0
    lam: float = 1.0
    gae_method: Literal["scan", "associative"] = "scan"
    adv_mean_level: Literal["batch", "group"] | None = "batch"
    adv_std_level: Literal["batch", "group"] | None = "batch"
    adv_unbiased: bool = True
    adv_eps: float = 1e-5
    token_rewards_as_adv: bool = True
    mask_no_eos_with_zero: bool = False


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW with global-norm gradient clipping and a warmup + cosine/constant schedule."""

    lr: float = 3e-4  # tiny policy: 1e-3 rose for ~10 steps, then drifted down (approx KL spikes to 0.1-0.25)
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 8  # optimizer updates; without it the first full-lr Adam steps can wreck a tiny policy
    min_lr_ratio: float = 0.1


@dataclasses.dataclass
class PPOConfig:
    """PPO epochs over minibatches, all inside one jitted step."""

    epochs: int = 2
    num_minibatches: int = 4
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    c_clip: float | None = None
    agg: Literal[LOSS_AGGREGATIONS] = "token-mean"
    max_rows: int | None = None  # fixed row capacity; default tasks_per_step * group budget
    microbatch_rows: int | None = 8  # gradient accumulation chunk (activation memory bound)
    len_buckets: list[int] = dataclasses.field(default_factory=lambda: [512, 640, 768, 1024, 2048, 4096])


@dataclasses.dataclass
class WarmStartConfig:
    """Supervised warm start on noisy generated demonstrations (cached by config hash)."""

    enabled: bool = True
    num_demos: int = 1024
    optimal_prob: float = 0.8  # probability of taking a BFS-optimal action at each turn
    # True: the random moves are imitated too, so the policy samples a noisy version of a good mode
    # (held-out sampled success 0.32, greedy 0.45 after 200 steps) and RL has noise to remove.
    # False: the random moves shape the episodes (detours, holes) but only optimal moves are in the
    # loss (sampled 0.48, greedy 0.67; GRPO then gained at most ~6 points in 20 steps).
    imitate_noise: bool = True
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    cache_dir: str = "~/.cache/jaxprm/warmstart"
    seed: int = 1234


@dataclasses.dataclass
class EvalConfig:
    every_steps: int = 10
    num_tasks: int = 64
    samples: int = 4
    greedy: bool = True
    at_start: bool = True
    temperature: float = 1.0


@dataclasses.dataclass
class CheckpointConfig:
    every_steps: int = 5
    keep: int = 3
    async_save: bool = True


@dataclasses.dataclass
class CompileCacheConfig:
    """JAX's persistent compilation cache: programs compiled by one run are loaded by the next on
    the same machine (and JAX version) instead of being compiled again. ``enabled: false`` turns it
    off; ``dir`` is where the compiled programs are kept."""

    enabled: bool = True
    dir: str = "~/.cache/jaxprm/xla"


@dataclasses.dataclass
class MeshConfig:
    """Device mesh for the train step: ``data`` x ``fsdp`` (-1 on one axis = all remaining)."""

    data: int = -1
    fsdp: int = 1


@dataclasses.dataclass
class DistributedConfig:
    """Multi-host: ``jax.distributed.initialize`` is called when ``enabled``."""

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    prm: PRMSection = dataclasses.field(default_factory=PRMSection)
    advantage: AdvantageSection = dataclasses.field(default_factory=AdvantageSection)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    compile_cache: CompileCacheConfig = dataclasses.field(default_factory=CompileCacheConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    steps: int = 30
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 1
    progress: bool = True
    plots: bool = True
    export_final: bool = True


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
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None
    return validate(cfg)


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
    return dataclasses.asdict(cfg)


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
            dataclasses.asdict(cfg.prm), export_style="concat", token_backed=cfg.server.token_backed,  # tree_packed packs concat rows
            token_rewards_as_adv=cfg.advantage.token_rewards_as_adv,
            mask_no_eos_with_zero=cfg.advantage.mask_no_eos_with_zero,
            external_string_backend=cfg.server.kind == "external" and not cfg.server.token_backed,
            keys=PRM_RULE_KEYS, resolve=True)
        if cfg.rollout.strategy == "patr":
            check_scorer_specs([_as_spec(cfg.rollout.branch_scorer)], where="rollout.branch_scorer")
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).replace("rollout.branch_scorer[0]", "rollout.branch_scorer")) from None


def _as_spec(b: BranchScorerSpec):
    from scorers import ScorerSpec as _Spec

    return _Spec(path=b.path, kwargs=b.kwargs)


def validate_agent(cfg: TrainConfig) -> None:
    """``rollout.source: agent`` rules: flat groups, a ``package.module:function`` workflow, bounds."""
    ag = cfg.agent
    _positive(ag, "agent", "timeout_s", "concurrency", "session_timeout_s")
    _check(0 <= ag.discount <= 1, "agent.discount", f"must be in [0, 1], got {ag.discount}")
    if cfg.rollout.source != "agent":
        return
    _check(cfg.rollout.strategy == "flat", "rollout.strategy",
           f"rollout.source 'agent' runs flat groups (group_size sessions per task); got {cfg.rollout.strategy!r} "
           "(allowed: 'flat'; PaTR and tree_random fork environment states and stay on rollout.source 'tree')")
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
    r = cfg.rollout
    _positive(r, "rollout", "tasks_per_step", "group_size", "b0", "k", "m", "top_k", "theta", "max_new_tokens", "max_branches")
    _positive(r, "rollout", "alpha", allow_zero=True)
    _check(0 < r.temperature <= 10, "rollout.temperature", f"must be in (0, 10], got {r.temperature}")
    _check(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    _check(r.top_k <= max(r.b0, 1) * 64, "rollout.top_k", "unreasonably large")
    if r.strategy != "flat":
        budget = r.max_branches or r.group_size
        _check(budget >= r.b0, "rollout.max_branches", f"the branch budget ({budget}) must be >= rollout.b0 ({r.b0})")
    validate_agent(cfg)
    e = cfg.env
    _check(2 <= e.size <= 16, "env.size", f"must be in [2, 16], got {e.size}")
    _check(0 < e.p <= 1, "env.p", f"must be in (0, 1], got {e.p}")
    _positive(e, "env", "max_turns", "train_tasks", "eval_tasks")
    a = cfg.advantage
    _check(a.reward_scale != 0 and math.isfinite(a.reward_scale), "advantage.reward_scale", "must be finite and != 0")
    _positive(a, "advantage", "reward_clip")
    _positive(a, "advantage", "kl_ctl", allow_zero=True)
    _check(0 <= a.gamma <= 1, "advantage.gamma", f"must be in [0, 1], got {a.gamma}")
    _check(0 <= a.lam <= 1, "advantage.lam", f"must be in [0, 1], got {a.lam}")
    o = cfg.optimizer
    _positive(o, "optimizer", "lr", "grad_clip", "eps")
    _positive(o, "optimizer", "weight_decay", "warmup_steps", allow_zero=True)
    _check(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optimizer.b1/b2", "must be in [0, 1)")
    _check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    p = cfg.ppo
    _positive(p, "ppo", "epochs", "num_minibatches", "eps_clip", "eps_clip_higher", "max_rows", "microbatch_rows")
    _check(p.c_clip is None or p.c_clip > 1, "ppo.c_clip", f"dual clip must be > 1 (or null), got {p.c_clip}")
    _check(bool(p.len_buckets) and all(b > 0 for b in p.len_buckets), "ppo.len_buckets", "must be a non-empty list of positive ints")
    if p.max_rows is not None:
        _check(p.max_rows % p.num_minibatches == 0, "ppo.max_rows",
               f"must be divisible by ppo.num_minibatches ({p.num_minibatches}), got {p.max_rows}")
    w = cfg.warm_start
    _positive(w, "warm_start", "num_demos", "steps", "batch_size", "lr")
    _check(0 <= w.optimal_prob <= 1, "warm_start.optimal_prob", f"must be in [0, 1], got {w.optimal_prob}")
    ev = cfg.eval
    _positive(ev, "eval", "every_steps", "num_tasks", "samples", "temperature")
    _check(ev.num_tasks <= e.eval_tasks, "eval.num_tasks", f"must be <= env.eval_tasks ({e.eval_tasks})")
    _positive(cfg.checkpoint, "checkpoint", "every_steps", "keep")
    m = cfg.mesh
    for n in ("data", "fsdp"):
        v = getattr(m, n)
        _check(v == -1 or v >= 1, f"mesh.{n}", f"must be -1 (all remaining devices) or >= 1, got {v}")
    _check(not (m.data == -1 and m.fsdp == -1), "mesh", "at most one axis may be -1")
    s = cfg.server
    if s.kind == "external":
        _check(bool(s.urls), "server.urls", "an external server needs at least one URL (http://host:port)")
        for i, u in enumerate(s.urls):
            _check(u.startswith(("http://", "https://")), f"server.urls[{i}]", f"must start with http:// or https://, got {u!r}")
    _positive(s, "server", "timeout_s", "concurrency", "max_batch")
    _positive(s, "server", "max_retries", "batch_window_ms", allow_zero=True)
    _positive(s, "server", "warn_behavior_kl", "max_behavior_kl", allow_zero=True)
    if s.max_behavior_kl is not None:
        _check(s.warn_behavior_kl <= s.max_behavior_kl, "server.warn_behavior_kl",
               f"must be <= server.max_behavior_kl ({s.max_behavior_kl}), got {s.warn_behavior_kl}")
    d = cfg.distributed
    if d.enabled and d.coordinator_address is not None:
        _check(d.num_processes is not None and d.process_id is not None, "distributed",
               "coordinator_address needs num_processes and process_id")
    validate_prm(cfg)
    return cfg
