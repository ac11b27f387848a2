"""Process-reward configuration and its load-time validation (layer 3, no jax).

YAML shape (under the rollout agent's ``prm`` key)::

    prm:
      enabled: true
      advantage_shaping: {mode: process_weighted, negative_scale: 0.2, zero_penalty: 0.4, zero_eps: 1.0e-6}
      scorers:
        - path: scorers.LengthBudgetScorer   # dotted import path: package.module.Class
          weight: 1.0
          enabled: true
          kwargs: {max_output_tokens: 128}

``enabled: false`` or an empty ``scorers`` list disables scoring. ``validate_prm_config`` checks
the combination with the trainer's rollout/actor settings; bad values fail with the key named.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from jaxprm.imports import import_object
from jaxprm.modes import SHAPING_MODES
from scorers.base import BaseScorer

__all__ = [
    "SHAPING_MODES",
    "AdvantageShapingConfig",
    "PRMConfig",
    "ScorerSpec",
    "SPEC_KEYS",
    "check_scorer_specs",
    "resolve_scorer_class",
    "validate_prm_config",
]



def _check_keys(where: str, data: Mapping[str, Any], allowed: Sequence[str]) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(allowed)}")


def _real(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a real number, got {value!r}")
    return float(value)


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be true or false, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScorerSpec:
    """One configured scorer: a dotted class path (required), its weight, on/off switch and
    constructor kwargs. The trainer's ``prm.scorers`` entries are these."""

    path: str
    weight: float = 1.0
    enabled: bool = True
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path.strip():
            raise ValueError(f"scorer path must be a non-empty dotted import path, got {self.path!r}")
        w = _real("scorer weight", self.weight)
        if not math.isfinite(w):
            raise ValueError(f"scorer weight must be finite, got {w} (scorer {self.path!r})")
        object.__setattr__(self, "weight", w)
        _bool("scorer enabled", self.enabled)
        if not isinstance(self.kwargs, Mapping):
            raise TypeError(f"scorer kwargs must be a mapping, got {type(self.kwargs).__name__}")
        object.__setattr__(self, "kwargs", dict(self.kwargs))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "prm.scorers[?]") -> ScorerSpec:
        _check_keys(where, data, ("path", "weight", "enabled", "kwargs"))
        if "path" not in data:
            raise ValueError(f"{where}.path is required (a dotted import path such as package.module.Class)")
        try:
            return cls(**dict(data))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}: {err}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageShapingConfig:
    """How the learner applies direct process rewards after GAE and normalization.

    Attributes:
      mode: ``additive`` (``A + p``), ``gvpo`` or ``process_weighted`` (see docs/design.md).
      negative_scale: gvpo: a negative advantage on a penalized token becomes ``(1 + s) A``.
      zero_penalty: gvpo: a near-zero advantage on a penalized token becomes ``-zero_penalty``.
      zero_eps: gvpo: ``|A| <= zero_eps`` counts as zero.
    All numbers must be finite and ``>= 0``.
    """

    mode: Literal[SHAPING_MODES] = "additive"
    negative_scale: float = 0.2
    zero_penalty: float = 0.4
    zero_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.mode not in SHAPING_MODES:
            raise ValueError(f"prm.advantage_shaping.mode={self.mode!r}; allowed: {SHAPING_MODES}")
        for key in ("negative_scale", "zero_penalty", "zero_eps"):
            v = _real(f"prm.advantage_shaping.{key}", getattr(self, key))
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"prm.advantage_shaping.{key}={v} must be finite and >= 0")
            object.__setattr__(self, key, v)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdvantageShapingConfig:
        _check_keys("prm.advantage_shaping", data, [f.name for f in dataclasses.fields(cls)])
        return cls(**dict(data))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PRMConfig:
    """Process-reward configuration (the trainer's ``prm`` section is this class, with scoring off by
    default).

    Attributes:
      enabled: master switch; ``False`` means no scorer is built or run.
      scorers: ``ScorerSpec`` entries (mappings are converted), built in order; stored as a tuple.
      advantage_shaping: the learner's shaping settings.
      max_concurrent_sessions: sessions (groups) scored at once by ``PRMRunner.score_sessions``.
      timeout_s: bound on scoring one session; past it the session is rejected.
    """

    enabled: bool = True
    scorers: list[ScorerSpec] = dataclasses.field(default_factory=list)
    advantage_shaping: AdvantageShapingConfig = dataclasses.field(default_factory=AdvantageShapingConfig)
    max_concurrent_sessions: int = 8
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _bool("prm.enabled", self.enabled)
        n = self.max_concurrent_sessions
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"prm.max_concurrent_sessions must be an int >= 1, got {n!r}")
        t = _real("prm.timeout_s", self.timeout_s)
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"prm.timeout_s must be finite and > 0, got {t!r}")
        object.__setattr__(self, "timeout_s", t)
        if isinstance(self.scorers, (str, bytes, Mapping)) or not isinstance(self.scorers, Sequence):
            raise TypeError(f"prm.scorers must be a list of scorer entries, got {type(self.scorers).__name__}")
        specs = []
        for i, s in enumerate(self.scorers):
            if isinstance(s, ScorerSpec):
                specs.append(s)
            elif isinstance(s, Mapping):
                specs.append(ScorerSpec.from_dict(s, where=f"prm.scorers[{i}]"))
            else:
                raise TypeError(
                    f"prm.scorers[{i}] must be a mapping {{path, weight, enabled, kwargs}} or a ScorerSpec, "
                    f"got {type(s).__name__} (pass scorer instances to PRMRunner(scorers=...))"
                )
        object.__setattr__(self, "scorers", tuple(specs))
        shaping = self.advantage_shaping
        if isinstance(shaping, Mapping):
            shaping = AdvantageShapingConfig.from_dict(shaping)
        elif not isinstance(shaping, AdvantageShapingConfig):
            raise TypeError(
                f"prm.advantage_shaping must be a mapping or AdvantageShapingConfig, got {type(shaping).__name__}"
            )
        object.__setattr__(self, "advantage_shaping", shaping)

    @property
    def active(self) -> bool:
        """True when scoring will run: enabled with at least one enabled scorer entry."""
        return self.enabled and any(s.enabled for s in self.scorers)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> PRMConfig:
        """Build from a parsed YAML/JSON mapping (``None`` -> disabled defaults); unknown keys fail."""
        if data is None:
            return cls(enabled=False)
        _check_keys("prm", data, ("enabled", "scorers", "advantage_shaping", "max_concurrent_sessions", "timeout_s"))
        d = dict(data)
        if d.get("scorers") is None:
            d["scorers"] = ()
        if d.get("advantage_shaping") is None:
            d.pop("advantage_shaping", None)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (round-trips through ``from_dict``)."""
        return {
            "enabled": self.enabled,
            "scorers": [dataclasses.asdict(s) for s in self.scorers],
            "advantage_shaping": dataclasses.asdict(self.advantage_shaping),
            "max_concurrent_sessions": self.max_concurrent_sessions,
            "timeout_s": self.timeout_s,
        }


def as_prm_config(config: PRMConfig | Mapping[str, Any] | None) -> PRMConfig:
    """Accept a ``PRMConfig``, a plain mapping or ``None`` (disabled)."""
    if isinstance(config, PRMConfig):
        return config
    if config is None or isinstance(config, Mapping):
        return PRMConfig.from_dict(config)
    raise TypeError(f"prm config must be a PRMConfig or a mapping, got {type(config).__name__}")


#: The spec's names of the settings ``validate_prm_config`` checks; callers with other names (the
#: trainer's YAML keys) pass their own through ``keys`` so that every error names the key to change.
SPEC_KEYS = {
    "export_style": "rollout export_style",
    "chat_template_type": "rollout chat_template_type",
    "token_backed": "token_backed",
    "token_rewards_as_adv": "actor.token_rewards_as_adv",
    "mask_no_eos_with_zero": "actor.mask_no_eos_with_zero",
    "scorers": "prm.scorers",
}


def validate_prm_config(
    prm: PRMConfig | Mapping[str, Any] | None,
    *,
    export_style: str,
    token_backed: bool,
    token_rewards_as_adv: bool,
    mask_no_eos_with_zero: bool = False,
    external_string_backend: bool = False,
    chat_template_type: str | None = None,
    keys: Mapping[str, str] | None = None,
    resolve: bool = False,
    build: bool = False,
) -> PRMConfig:
    """Check the process-reward settings against the trainer's rollout/actor settings.

    Rules (each failure is a ``ValueError`` naming the offending key and the allowed values; the key
    names are ``SPEC_KEYS`` updated with ``keys``):

    - The shaping numbers are finite and ``>= 0`` and the mode is one of ``SHAPING_MODES``
      (always checked, enforced by ``AdvantageShapingConfig``).
    - ``enabled: false`` or an empty scorer list (or only disabled entries) disables scoring; then
      nothing else is required.
    - Active scorers require ``export_style == "concat"`` (and, when given,
      ``chat_template_type == "concat"``), token-backed interactions (``token_backed``), and direct
      process advantages (``token_rewards_as_adv: true``; folding dense rewards into GAE is
      not specified), and are refused with an external string-only generation backend
      (``external_string_backend``: responses without token ids).
    - Active scorers with ``mode: process_weighted`` refuse ``mask_no_eos_with_zero: true``, and their
      weighted sum must stay in [0, 1] where every enabled scorer declares its output range
      (:meth:`BaseScorer.reward_range`).
    - With ``resolve``, every scorer entry (enabled or not) is checked as :func:`check_scorer_specs`
      does: the class imports, its keyword arguments bind, names are unique; with ``build`` too,
      each is constructed once.

    Returns the normalized ``PRMConfig``.
    """
    k = {**SPEC_KEYS, **(keys or {})}
    cfg = as_prm_config(prm)
    specs: list[tuple[ScorerSpec, type[BaseScorer]]] = []
    if resolve:
        specs = check_scorer_specs(cfg.scorers, where=k["scorers"], build=build)
    if not cfg.active:
        return cfg
    if export_style != "concat":
        raise ValueError(
            f"{k['export_style']}={export_style!r} is not supported with active PRM scorers; allowed: 'concat' "
            "(or set prm.enabled: false / an empty prm.scorers list)"
        )
    if chat_template_type is not None and chat_template_type != "concat":
        raise ValueError(
            f"{k['chat_template_type']}={chat_template_type!r} is not supported with active PRM scorers; "
            "allowed: 'concat'"
        )
    if not token_backed:
        raise ValueError(
            f"{k['token_backed']}=false: active PRM scorers need token-backed interactions (model responses "
            "with token ids and logprobs); a string-only backend is rejected (set prm.enabled: false or use a "
            "token-backed server)"
        )
    if external_string_backend:
        raise ValueError(
            "active PRM scorers are refused with an external string-only generation backend: it stores no "
            "token ids; use a token-in/token-out server or disable prm (prm.enabled: false)"
        )
    if token_rewards_as_adv is not True:
        raise ValueError(
            f"{k['token_rewards_as_adv']}={token_rewards_as_adv!r}: active PRM scorers need direct process "
            "advantages; allowed: true (folded mode is rejected)"
        )
    if cfg.advantage_shaping.mode == "process_weighted":
        if mask_no_eos_with_zero:
            raise ValueError(
                f"{k['mask_no_eos_with_zero']}=true is not allowed with prm.advantage_shaping.mode="
                "'process_weighted'; allowed: false (or choose mode 'additive' / 'gvpo')"
            )
        if specs:
            _check_weighted_range(specs, where=k["scorers"])
    return cfg


def check_scorer_specs(specs: Sequence[ScorerSpec], *, where: str = "prm.scorers",
                       build: bool = False) -> list[tuple[ScorerSpec, type[BaseScorer]]]:
    """Resolve every entry's class and check that its ``kwargs`` bind to the constructor and that
    scorer names are unique. With ``build``, also construct each scorer once and drop it, so that
    a constructor's own checks (a value out of range, a tokenizer file that does not load) fail
    here; constructors must not start work or open connections (that happens on first use, and
    :meth:`BaseScorer.aclose` ends it). Errors name the entry (``where[i]``)."""
    out = []
    names: dict[str, int] = {}
    for i, spec in enumerate(specs):
        here = f"{where}[{i}]"
        try:
            cls = resolve_scorer_class(spec.path, where=f"{here}.path")
        except (ImportError, TypeError, ValueError) as err:
            raise ValueError(str(err)) from None
        _check_kwargs(cls, dict(spec.kwargs), where=f"{here}.kwargs")
        if build:
            try:
                cls(weight=spec.weight, enabled=spec.enabled, **dict(spec.kwargs))
            except Exception as err:  # a user's constructor may raise anything: name the entry
                detail = " ".join(str(err).split())[:300]
                raise ValueError(f"{here}.kwargs: {spec.path} could not be built: {type(err).__name__}: {detail}") from None
        if cls.name in names:
            raise ValueError(
                f"{here}: scorer name {cls.name!r} is already used by {where}[{names[cls.name]}]; "
                "names must be unique (they name the metrics)"
            )
        names[cls.name] = i
        out.append((spec, cls))
    return out


def _check_kwargs(cls: type[BaseScorer], kwargs: Mapping[str, Any], *, where: str) -> None:
    """Check ``kwargs`` against the constructors of ``cls`` and of the bases its ``**kwargs`` reach
    (up to ``BaseScorer``, which refuses leftovers): no unknown name, no missing required one."""
    names: set[str] = set()
    required: set[str] | None = None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        if required is None:
            required = {p.name for p in params if p.kind in kinds and p.default is p.empty}
        names |= {p.name for p in params if p.kind in kinds}
        if klass is BaseScorer or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    names -= {"weight", "enabled"}  # set by the entry itself, not by kwargs
    unknown = sorted(set(kwargs) - names)
    missing = sorted((required or set()) - set(kwargs))
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no argument(s) {unknown}; it accepts {sorted(names)}")
    if missing:
        raise ValueError(f"{where}: {cls.__name__} needs {missing}")


def _check_weighted_range(specs: Sequence[tuple[ScorerSpec, type[BaseScorer]]], *, where: str) -> None:
    lo = hi = 0.0
    for spec, cls in specs:
        if not spec.enabled:
            continue
        rng = cls.reward_range(**dict(spec.kwargs))
        if rng is None:
            return  # not knowable at load time; the runner's check at scoring time applies
        a, b = spec.weight * rng[0], spec.weight * rng[1]
        lo, hi = lo + min(a, b), hi + max(a, b)
    if lo < 0.0 or hi > 1.0:
        raise ValueError(
            f"{where}: prm.advantage_shaping.mode='process_weighted' needs process rewards in [0, 1], but the "
            f"weighted sum of the enabled scorers' declared ranges can reach [{lo:g}, {hi:g}]; change the "
            "weights or the scorers (or choose mode 'additive' / 'gvpo')"
        )


def resolve_scorer_class(path: str, *, where: str = "scorer path") -> type[BaseScorer]:
    """Import ``package.module.Class`` (or ``package.module:Class``) and check it is a scorer."""
    obj = import_object(path, where=where, shape="package.module.Class")
    if not isinstance(obj, type) or not issubclass(obj, BaseScorer):
        raise TypeError(f"{where}={path!r} resolved to {obj!r}, which is not a BaseScorer subclass")
    return obj
