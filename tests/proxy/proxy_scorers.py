"""Scorers for the proxy tests, importable by dotted path (``tests.proxy.proxy_scorers.X``).

They record what happened in module-level logs so a test can check call order, concurrency and
cleanup; each test resets them with ``reset()``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from scorers import BaseScorer

EVENTS: list[tuple[str, Any]] = []
STATE: dict[str, Any] = {"active": 0, "max_active": 0, "calls": 0, "proxy": None}


def reset(proxy: Any = None) -> None:
    EVENTS.clear()
    STATE.update(active=0, max_active=0, calls=0, proxy=proxy)


class TurnIndexScorer(BaseScorer):
    """Reward = the turn's position on its branch (0, 1, ...), scalar; records each call."""

    name = "turn_index"

    async def evaluate(self, interaction, ctx):
        STATE["calls"] += 1
        EVENTS.append(("score", (ctx.get("session_id"), ctx.get("leaf_id"), interaction.id)))
        return float(ctx["turn_index"])


class SlowScorer(BaseScorer):
    """Sleeps ``delay_s`` per turn (tracking concurrency), then returns 0.5; ``fail_session`` raises."""

    name = "slow"

    def __init__(self, delay_s: float = 0.2, fail_session: str | None = None, **kw: Any) -> None:
        self.delay_s = delay_s
        self.fail_session = fail_session
        super().__init__(**kw)

    async def evaluate(self, interaction, ctx):
        STATE["calls"] += 1
        STATE["active"] += 1
        STATE["max_active"] = max(STATE["max_active"], STATE["active"])
        EVENTS.append(("start", ctx.get("session_id")))
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            STATE["active"] -= 1
        if ctx.get("session_id") == self.fail_session:
            raise RuntimeError(f"injected failure for {self.fail_session}")
        EVENTS.append(("done", ctx.get("session_id")))
        return 0.5


class ClosingScorer(BaseScorer):
    """Records its ``aclose`` and whether the proxy's upstream client was still open then."""

    name = "closing"

    async def evaluate(self, interaction, ctx):
        return 0.0

    async def aclose(self) -> None:
        proxy = STATE.get("proxy")
        client_open = None
        if proxy is not None and proxy.client is not None:
            client_open = not proxy.client.is_closed
        EVENTS.append(("aclose", client_open))


class BrokenScorer(BaseScorer):
    """Its constructor fails (a startup failure)."""

    name = "broken"

    def __init__(self, **kw: Any) -> None:
        raise RuntimeError("broken scorer: cannot start")


class FailingCloseScorer(BaseScorer):
    """Its ``aclose`` fails (scorer cleanup failure at shutdown)."""

    name = "failing_close"

    async def evaluate(self, interaction, ctx):
        return 0.0

    async def aclose(self) -> None:
        EVENTS.append(("aclose_failed", None))
        raise OSError("cannot flush the audit log")
