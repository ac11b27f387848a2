"""Scorers with injected faults for the trainer's process-reward wiring tests (dotted paths
``tests.train.fault_scorers.X`` resolve from the repository root).

Interaction ids are ``g<group seed>/<branch>/t<turn>`` and a training step's groups have seeds
``step * 10000 + i``, so ``GroupFault(faults={"g10001": "raise"})`` misbehaves on group 1 of step 1.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

from scorers import BaseScorer

#: What the fault scorers observed; the tests read it after a run.
SEEN: dict[str, Any] = {}


class GroupFault(BaseScorer):
    """0.5 on every turn, except on the groups named in ``faults``: ``raise`` (an exception),
    ``nan``, ``hang`` (sleeps past any timeout) or ``out_of_range`` (1.5). Records scored leaves."""

    name = "group_fault"

    def __init__(self, faults: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.faults = dict(faults or {})

    async def evaluate(self, interaction, ctx):
        group = interaction.id.split("/")[0]
        SEEN.setdefault("leaves", set()).add(ctx.get("leaf_id"))
        fault = self.faults.get(group)
        if fault == "raise":
            raise RuntimeError(f"injected failure on {group}")
        if fault == "nan":
            return float("nan")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "out_of_range":
            return 1.5
        return 0.5


class FailingClose(BaseScorer):
    """Scores 0.0; its ``aclose`` fails. Records whether the embedded server was still up then."""

    name = "failing_close"

    async def evaluate(self, interaction, ctx):
        return 0.0

    async def aclose(self) -> None:
        SEEN["server_alive_at_scorer_close"] = any(t.name.startswith("jaxprm-serve-") and t.is_alive()
                                                   for t in threading.enumerate())
        raise RuntimeError("injected aclose failure")


class FailingStart(BaseScorer):
    """Fails when it is built (at the trainer's start)."""

    name = "failing_start"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        raise RuntimeError("injected startup failure")

    async def evaluate(self, interaction, ctx):
        return 0.0
