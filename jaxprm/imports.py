"""``import_object``: the one resolver of the dotted paths a config or a command line names (scorer
classes, agent workflows, tokenizer factories). jax-free and project-free, so every layer may use it."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_object"]


def import_object(spec: str, *, where: str, colon_only: bool = False, shape: str = "package.module:name") -> Any:
    """The object ``spec`` names: ``package.module:attr`` (``attr`` may be dotted, ``Class.method``)
    or, unless ``colon_only``, ``package.module.attr`` (split at the last dot).

    Errors name the config key or flag ``where`` and the ``spec``: a malformed spec raises
    ``ValueError`` ("must look like ``shape``"); a module that cannot be imported raises an
    ``ImportError`` of the same class naming ``where``, the spec and the original error (chained); a
    missing attribute raises ``ImportError`` ("has no attribute").
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{where} must be a non-empty import path like {shape}, got {spec!r}")
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
    elif colon_only:
        module_name, attr = "", ""
    else:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"{where}={spec!r} must look like {shape}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise type(err)(f"{where}={spec!r}: cannot import module {module_name!r}: {err}", name=err.name,
                        path=err.path) from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"{where}={spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj
