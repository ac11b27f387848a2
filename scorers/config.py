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
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "SHAPING_MODES",
    "AdvantageShapingConfig",
    "PRMConfig",
    "ScorerSpec",
    "validate_prm_config",
]

#: Advantage-shaping modes the learner implements (see DESIGN.md, "Process rewards").
SHAPING_MODES = ("additive", "gvpo", "process_weighted")


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


@dataclasses.dataclass(frozen=True)
class ScorerSpec:
    """One configured scorer: a dotted class path, its weight, on/off switch and constructor kwargs."""

    path: str
    weight: float = 1.0
    enabled: bool = True
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

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


@dataclasses.dataclass(frozen=True)
class AdvantageShapingConfig:
    """How the learner applies direct process rewards after GAE and normalization.

    Attributes:
      mode: ``additive`` (``A + p``), ``gvpo`` or ``process_weighted`` (see DESIGN.md).
      negative_scale: gvpo: a negative advantage on a penalized token becomes ``(1 + s) A``.
      zero_penalty: gvpo: a near-zero advantage on a penalized token becomes ``-zero_penalty``.
      zero_eps: gvpo: ``|A| <= zero_eps`` counts as zero.
    All numbers must be finite and ``>= 0``.
    """

    mode: str = "additive"
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


@dataclasses.dataclass(frozen=True)
class PRMConfig:
    """Process-reward configuration.

    Attributes:
      enabled: master switch; ``False`` means no scorer is built or run.
      scorers: ``ScorerSpec`` entries (mappings are converted), built in order.
      advantage_shaping: the learner's shaping settings.
    """

    enabled: bool = True
    scorers: tuple[ScorerSpec, ...] = ()
    advantage_shaping: AdvantageShapingConfig = dataclasses.field(default_factory=AdvantageShapingConfig)

    def __post_init__(self) -> None:
        _bool("prm.enabled", self.enabled)
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
        _check_keys("prm", data, ("enabled", "scorers", "advantage_shaping"))
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
        }


def as_prm_config(config: PRMConfig | Mapping[str, Any] | None) -> PRMConfig:
    """Accept a ``PRMConfig``, a plain mapping or ``None`` (disabled)."""
    if isinstance(config, PRMConfig):
        return config
    if config is None or isinstance(config, Mapping):
        return PRMConfig.from_dict(config)
    raise TypeError(f"prm config must be a PRMConfig or a mapping, got {type(config).__name__}")


def validate_prm_config(
    prm: PRMConfig | Mapping[str, Any] | None,
    *,
    export_style: str,
    token_backed: bool,
    token_rewards_as_adv: bool,
    mask_no_eos_with_zero: bool = False,
    external_string_backend: bool = False,
    chat_template_type: str | None = None,
) -> PRMConfig:
    """Check the process-reward settings against the trainer's rollout/actor settings.

    Rules (each failure is a ``ValueError`` naming the offending key and the allowed values):

    - The shaping numbers are finite and ``>= 0`` and the mode is one of ``SHAPING_MODES``
      (always checked, enforced by ``AdvantageShapingConfig``).
    - ``enabled: false`` or an empty scorer list (or only disabled entries) disables scoring; then
      nothing else is required.
    - Active scorers require ``export_style == "concat"`` (and, when given,
      ``chat_template_type == "concat"``), token-backed interactions (``token_backed``), and direct
      process advantages (``actor.token_rewards_as_adv: true``; folding dense rewards into GAE is
      not specified), and are refused with an external string-only generation backend
      (``external_string_backend``: responses without token ids).
    - Active scorers with ``mode: process_weighted`` refuse ``actor.mask_no_eos_with_zero: true``.

    Returns the normalized ``PRMConfig``.
    """
    cfg = as_prm_config(prm)
    if not cfg.active:
        return cfg
    if export_style != "concat":
        raise ValueError(
            f"rollout export_style={export_style!r} is not supported with active PRM scorers; allowed: 'concat' "
            "(or set prm.enabled: false / an empty prm.scorers list)"
        )
    if chat_template_type is not None and chat_template_type != "concat":
        raise ValueError(
            f"rollout chat_template_type={chat_template_type!r} is not supported with active PRM scorers; "
            "allowed: 'concat'"
        )
    if not token_backed:
        raise ValueError(
            "active PRM scorers need token-backed interactions (model responses with token ids and logprobs); "
            "got token_backed=False"
        )
    if external_string_backend:
        raise ValueError(
            "active PRM scorers are refused with an external string-only generation backend: it stores no "
            "token ids; use a token-in/token-out server or disable prm (prm.enabled: false)"
        )
    if token_rewards_as_adv is not True:
        raise ValueError(
            f"actor.token_rewards_as_adv={token_rewards_as_adv!r}: active PRM scorers need direct process "
            "advantages; allowed: true"
        )
    if cfg.advantage_shaping.mode == "process_weighted" and mask_no_eos_with_zero:
        raise ValueError(
            "actor.mask_no_eos_with_zero=true is not allowed with prm.advantage_shaping.mode='process_weighted'; "
            "allowed: false (or choose mode 'additive' / 'gvpo')"
        )
    return cfg
