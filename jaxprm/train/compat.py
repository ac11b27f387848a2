"""Adapters between the trainer's config and the other packages' APIs (scorers, rollout, models).

Kept in one place so an interface change elsewhere is absorbed here, not across the trainer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["prm_config_dict", "call_validate_prm_config"]


def prm_config_dict(cfg) -> dict[str, Any]:
    """The ``prm`` section as the plain mapping ``scorers.PRMConfig`` is built from."""
    return dataclasses.asdict(cfg.prm)


def call_validate_prm_config(fn, cfg) -> None:
    """Run ``scorers.validate_prm_config`` with the trainer's settings; re-raise as ConfigError."""
    raise NotImplementedError
