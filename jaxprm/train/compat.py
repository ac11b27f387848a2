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


def call_validate_prm_config(fn, cfg) -> Any:
    """Run ``scorers.validate_prm_config`` with the trainer's settings; re-raise as ConfigError."""
    from jaxprm.train.config import ConfigError

    try:
        return fn(
            prm_config_dict(cfg),
            export_style=cfg.rollout.export,
            token_backed=cfg.server.token_backed,
            token_rewards_as_adv=cfg.advantage.token_rewards_as_adv,
            mask_no_eos_with_zero=cfg.advantage.mask_no_eos_with_zero,
            external_string_backend=cfg.server.kind == "external" and not cfg.server.token_backed,
        )
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"prm: {e}") from None
