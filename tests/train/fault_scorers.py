"""Scorers with injected faults for the trainer's process-reward wiring tests (dotted paths
``tests.train.fault_scorers.X`` resolve from the repository root).

Interaction ids are ``g<group seed>/<branch>/t<turn>`` and a training step's groups have seeds
``step * 10000 + i``, so ``GroupFault(faults={"g10001": "raise"})`` misbehaves on group 1 of step 1.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Mapping
from typing import Any

from scorers import BaseScorer

#: What the fault scorers observed; the tests read it after a run.
SEEN: dict[str, Any] = {}


class GroupFault(BaseScorer):
    """0.5 on every turn, except in the groups named in ``faults``: there the first branch seen
    scores 0.9 and every later one misbehaves: ``raise`` (an exception), ``nan``, ``hang`` (sleeps
    past any timeout) or ``out_of_range`` (1.5). So a faulty group is rejected after some of its
    branches were scored, and their 0.9s would show in the metrics if a rejected group leaked.

    A branch is ``ctx["leaf_id"]`` at export time and ``ctx["branch_id"]`` at PaTR checkpoints.
    Each call yields to the event loop for ``sleep_s``, so groups scored concurrently overlap.
    Records in ``SEEN``: ``leaves`` (scored leaf ids) and ``max_groups_in_flight`` (the most groups
    with an export-time call in progress at once; PaTR checkpoints are not counted)."""

    name = "group_fault"

    def __init__(self, faults: Mapping[str, str] | None = None, sleep_s: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.faults = dict(faults or {})
        self.sleep_s = sleep_s
        self._first: dict[str, Any] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()

    async def evaluate(self, interaction, ctx):
        group = interaction.id.split("/")[0]
        branch = ctx.get("leaf_id", ctx.get("branch_id"))
        SEEN.setdefault("leaves", set()).add(ctx.get("leaf_id"))
        self._in_flight[group] += 1
        if "leaf_id" in ctx:
            busy = sum(1 for n in self._in_flight.values() if n > 0)
            SEEN["max_groups_in_flight"] = max(SEEN.get("max_groups_in_flight", 0), busy)
        try:
            await asyncio.sleep(self.sleep_s)
            fault = self.faults.get(group)
            if fault is None:
                return 0.5
            if self._first.setdefault(group, branch) == branch:
                return 0.9
            if fault == "raise":
                raise RuntimeError(f"injected failure on {group}")
            if fault == "nan":
                return float("nan")
            if fault == "hang":
                await asyncio.sleep(3600)
            if fault == "out_of_range":
                return 1.5
            raise ValueError(f"unknown fault {fault!r}")
        finally:
            self._in_flight[group] -= 1


class FailingClose(BaseScorer):
    """Scores 0.0; its ``aclose`` fails. Records whether the embedded server was still up then."""

    name = "failing_close"

    async def evaluate(self, interaction, ctx):
        return 0.0

    async def aclose(self) -> None:
        SEEN["server_alive_at_scorer_close"] = any(t.name.startswith("jaxprm-serve-") and t.is_alive()
                                                   for t in threading.enumerate())
        raise RuntimeError("injected aclose failure")


class FailingBuild(BaseScorer):
    """Fails whenever it is built: the config's load-time check reports it."""

    name = "failing_build"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        raise RuntimeError("injected build failure")

    async def evaluate(self, interaction, ctx):
        return 0.0


class FailingStart(BaseScorer):
    """Builds once (the config's check at load time), then fails when it is built again (at the
    trainer's start): a failure the load-time check cannot see, such as a server gone since."""

    name = "failing_start"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        SEEN["failing_start_builds"] = SEEN.get("failing_start_builds", 0) + 1
        if SEEN["failing_start_builds"] > 1:
            raise RuntimeError("injected startup failure")

    async def evaluate(self, interaction, ctx):
        return 0.0
