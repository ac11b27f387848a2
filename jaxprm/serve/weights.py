"""The guards of ``/update_weights_from_disk``: where weights may be loaded from, and which weight
versions are accepted.

* Paths: only under the server's configured weights roots (``ServeConfig.weights_roots``:
  ``--weights-root`` for ``python -m jaxprm.serve``, the run directory for the trainer's embedded
  server); none configured means loading from disk is off (403). ``model_path`` must be absolute;
  it is resolved (``..`` and symlinks followed) before the containment test, and preset names
  (``"tiny"``, ...) are refused: they would re-initialize the weights rather than load them.
* Errors never say whether a path exists: a path outside the roots is refused before the file
  system is looked at, and every failure to load a path inside them gets one message (the cause
  goes to the server log).
* Versions: an integer (or a string of digits) in ``[0, MAX_WEIGHT_VERSION]``, never below the
  served version (equal is allowed, so that a retried update is idempotent).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from jaxprm.models import PRESETS
from jaxprm.serve.errors import APIError

__all__ = ["MAX_WEIGHT_VERSION", "LOAD_FAILED", "resolve_roots", "weights_path", "parse_version", "check_version_order"]

MAX_WEIGHT_VERSION = 2**31 - 1
LOAD_FAILED = ("could not load weights from model_path: not a checkpoint of this model (Hugging Face directory or "
               ".gguf file) that the server can read; the server log has the cause")


def resolve_roots(roots: Sequence[str | os.PathLike]) -> tuple[str, ...]:
    """Absolute, resolved weights roots; each must be an existing directory (``ValueError``)."""
    out = []
    for r in roots:
        p = Path(r).expanduser()
        if not p.is_dir():
            raise ValueError(f"weights root {os.fspath(r)!r} is not a directory")
        out.append(str(p.resolve()))
    return tuple(out)


def weights_path(model_path: str, roots: Sequence[str]) -> Path:
    """The resolved ``model_path`` if it lies under one of ``roots``; else an :class:`APIError`
    (403) that says nothing about the file system."""
    if not roots:
        raise APIError("loading weights from disk is disabled on this server (start it with --weights-root DIR)",
                       status=403, param="model_path", type="PermissionDeniedError")
    if model_path in PRESETS:
        raise APIError(f"model_path {model_path!r} is a preset name; only saved checkpoints can be loaded here",
                       param="model_path")
    if "\x00" in model_path or not os.path.isabs(model_path):
        raise APIError("model_path must be an absolute path under the server's weights roots", param="model_path")
    try:
        path = Path(model_path).resolve()
    except (OSError, RuntimeError):  # a symlink loop, an over-long name: treated as outside
        path = None
    if path is None or not any(path.is_relative_to(r) for r in roots):
        raise APIError("model_path is outside the server's weights roots", status=403, param="model_path",
                       type="PermissionDeniedError")
    return path


def parse_version(raw: int | str | None) -> int | None:
    """``weight_version`` as an int in ``[0, MAX_WEIGHT_VERSION]`` (``None`` stays ``None``)."""
    if raw is None:
        return None
    digits = isinstance(raw, str) and raw.isascii() and raw.isdigit() and len(raw) <= 10
    if isinstance(raw, bool) or not (isinstance(raw, int) or digits):
        raise APIError(f"weight_version must be an integer in [0, {MAX_WEIGHT_VERSION}]", param="weight_version")
    value = int(raw)
    if not 0 <= value <= MAX_WEIGHT_VERSION:
        raise APIError(f"weight_version must be an integer in [0, {MAX_WEIGHT_VERSION}]", param="weight_version")
    return value


def check_version_order(version: int | None, current: int) -> None:
    """Versions never go back: ``version`` below the served ``current`` is a 409."""
    if version is not None and version < current:
        raise APIError(f"weight_version {version} is below the served version {current}; versions never go "
                       "back (restart the server to serve an older run)", status=409, param="weight_version",
                       type="ConflictError")
