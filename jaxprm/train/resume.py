"""What ``--resume`` may change, and what it records in the run directory.

A run directory holds the resolved config of its first start in ``config.yaml`` and that of every
resume in ``config.resumes/<n>.yaml`` (n = 1, 2, ...). ``--resume RUN_DIR key=value ...`` starts
from the newest of these (:func:`latest_config_file`) and applies the overrides on top, so an
override given at one resume (``steps=60``, ``optimizer.lr=1e-4``) holds for every later plain
``--resume`` as well.

Everything may change on resume except the keys that define the run's data and its reference policy
(:data:`FROZEN_KEYS`): ``seed`` (the task order and the RNG), the ``env`` section (the task set the
checkpointed data position counts into), ``model.lora`` (the checkpoint holds only adapters: their
rank, targets and scale define the model) and whether ``advantage.kl_ctl`` is zero (the reference
policy is checkpointed only when it is not). Changing one of those is refused with the key, the
recorded value and the new one. A changed architecture (``model.*`` overrides, a different model
file) is caught when the checkpoint is restored: its arrays are compared with the configured
model's before anything starts (``Checkpointer.restore_latest``), and the error names the first
mismatched parameter and both shapes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from jaxprm.train.config import ConfigError, TrainConfig, dump_yaml, to_dict

__all__ = ["FROZEN_KEYS", "HISTORY_DIR", "changed_keys", "check_resume", "latest_config_file", "record_resume"]

#: Keys (or whole sections) a resume may not change; see the module docstring.
FROZEN_KEYS = ("seed", "env", "model.lora")
HISTORY_DIR = "config.resumes"


def _history(run_dir: Path) -> list[tuple[int, Path]]:
    d = Path(run_dir) / HISTORY_DIR
    if not d.is_dir():
        return []
    out = [(int(p.stem), p) for p in d.glob("*.yaml") if p.stem.isdigit()]
    return sorted(out)


def latest_config_file(run_dir: str | Path) -> Path:
    """The resolved config of the run's latest (re)start: the newest ``config.resumes/<n>.yaml``,
    else ``config.yaml``."""
    hist = _history(Path(run_dir))
    return hist[-1][1] if hist else Path(run_dir) / "config.yaml"


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: d}
    return {prefix[:-1]: d}


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every leaf that differs (``run_dir`` ignored)."""
    a, b = _flatten(old), _flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys())
            if k != "run_dir" and a.get(k) != b.get(k)]


def _recorded(run_dir: Path) -> dict[str, Any]:
    path = latest_config_file(run_dir)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--resume {run_dir}: cannot read {path.name}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--resume {run_dir}: {path.name} is not a mapping")
    return data


def check_resume(run_dir: str | Path, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """The keys ``cfg`` changes relative to the run's latest recorded config; raises
    :class:`ConfigError` naming the key when a frozen one changes (see the module docstring)."""
    old = _recorded(Path(run_dir))
    changes = changed_keys(old, to_dict(cfg))
    for key, was, now in changes:
        if any(key == f or key.startswith(f + ".") for f in FROZEN_KEYS):
            raise ConfigError(f"{key}: cannot change on --resume (recorded {was!r}, given {now!r}); it defines "
                              f"the run's tasks and their order. Start a new run to change it")
    kl_old = float(old.get("advantage", {}).get("kl_ctl", 0.0) or 0.0)
    if (kl_old > 0) != (cfg.advantage.kl_ctl > 0):
        raise ConfigError(f"advantage.kl_ctl: cannot change between 0 and > 0 on --resume (recorded {kl_old!r}, "
                          f"given {cfg.advantage.kl_ctl!r}): the reference policy is checkpointed only when it is > 0")
    return changes


def record_resume(run_dir: str | Path, cfg: TrainConfig) -> tuple[Path, list[tuple[str, Any, Any]]]:
    """Write ``cfg`` as the next ``config.resumes/<n>.yaml`` (atomically); returns its path and the
    keys it changes relative to the previously recorded config."""
    changes = changed_keys(_recorded(Path(run_dir)), to_dict(cfg))
    d = Path(run_dir) / HISTORY_DIR
    d.mkdir(exist_ok=True)
    hist = _history(Path(run_dir))
    path = d / f"{(hist[-1][0] if hist else 0) + 1}.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(dump_yaml(cfg))
    os.replace(tmp, path)
    return path, changes
