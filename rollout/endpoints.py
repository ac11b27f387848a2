"""Which generation endpoints are up, which are down, and when to probe a down one again (layer 4).

An endpoint is marked down when a request to it loses its connection (refused, reset, closed
before the answer): the server died or is restarting. Requests are then routed to the endpoints
still up; a down endpoint is probed again after ``probe_base_s * 2**probes`` seconds (capped at
``probe_max_s``), and comes back only when a probe succeeds (the client's ``on_recover`` hook, the
trainer's weight push and version check, included). A slow answer (a timeout) or an HTTP error does
not mark an endpoint down: the server is alive, the request is retried under the usual policy.

Pure bookkeeping on a clock, touched only from the event loop thread (no locks)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

__all__ = ["EndpointHealth"]


@dataclasses.dataclass
class _Down:
    since: float  # when it was marked down
    next_probe: float  # when it may be probed again
    probes: int = 0  # failed probes since it went down
    reason: str = ""  # the error that took it down (or the last failed probe's)


class EndpointHealth:
    """Up/down state of ``endpoints`` with probe backoff.

    Counters (``stats()``): ``marked_down`` (times an endpoint went down), ``recovered`` (times one
    came back), ``failed_probes``."""

    def __init__(self, endpoints: Sequence[str], *, probe_base_s: float = 0.5, probe_max_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.endpoints = tuple(endpoints)
        self.probe_base_s, self.probe_max_s, self.clock = probe_base_s, probe_max_s, clock
        self._down: dict[str, _Down] = {}
        self._stats = {"marked_down": 0, "recovered": 0, "failed_probes": 0}

    def stats(self) -> dict[str, int]:
        return {**self._stats, "down": len(self._down)}

    def up(self) -> list[str]:
        """The endpoints that take requests, in configuration order."""
        return [e for e in self.endpoints if e not in self._down]

    def is_up(self, endpoint: str) -> bool:
        return endpoint not in self._down

    def down(self) -> dict[str, str]:
        """``{endpoint: reason}`` of every endpoint that is down."""
        return {e: d.reason for e, d in self._down.items()}

    def mark_down(self, endpoint: str, reason: str) -> bool:
        """Take ``endpoint`` out of rotation (first probe after ``probe_base_s``); True when it was up."""
        if endpoint in self._down:
            return False
        now = self.clock()
        self._down[endpoint] = _Down(since=now, next_probe=now + self.probe_base_s, reason=reason)
        self._stats["marked_down"] += 1
        return True

    def mark_up(self, endpoint: str) -> None:
        """Put a recovered endpoint back in rotation."""
        if self._down.pop(endpoint, None) is not None:
            self._stats["recovered"] += 1

    def probe_failed(self, endpoint: str, reason: str) -> None:
        """A probe of a down endpoint failed: the next one waits twice as long (capped)."""
        d = self._down.get(endpoint)
        if d is None:
            return
        d.probes += 1
        d.reason = reason
        d.next_probe = self.clock() + min(self.probe_max_s, self.probe_base_s * 2 ** d.probes)
        self._stats["failed_probes"] += 1

    def due(self) -> list[str]:
        """Down endpoints whose next probe time has come."""
        now = self.clock()
        return [e for e, d in self._down.items() if d.next_probe <= now]

    def next_probe_in(self) -> float:
        """Seconds until the earliest probe of a down endpoint is due (0 if one is due; inf if none is down)."""
        if not self._down:
            return float("inf")
        return max(0.0, min(d.next_probe for d in self._down.values()) - self.clock())

    def all_down_for(self) -> float | None:
        """Seconds since the last endpoint went down, when every endpoint is down; else ``None``."""
        if len(self._down) < len(self.endpoints):
            return None
        return self.clock() - max(d.since for d in self._down.values())
