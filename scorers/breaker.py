"""A circuit breaker for a scorer's server (layer 3): fail fast while it is down, probe until it
answers again.

States: **closed** (calls go through; ``failures`` consecutive failed calls open it), **open**
(every call fails at once with :class:`scorers.base.ScorerUnavailable`, which rejects its group
with kind ``scorer_unavailable`` instead of waiting out timeouts and retries), **half-open** (once
``probe_s`` has passed since it opened, the next call goes through as a probe while the others
still fail fast; a probe that succeeds closes the breaker, one that fails opens it again with the
wait doubled, up to ``max_probe_s``: by default 60 s, or ``probe_s`` if longer). A call that is
cancelled mid-probe gives the probe slot back.

``HTTPJsonClient`` owns one per server, so every path that calls the scorer (export-time scoring
through ``PRMRunner``, PaTR's branch scorer through ``score_branch``) follows the same rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from scorers.base import ScorerUnavailable

__all__ = ["CircuitBreaker"]


class CircuitBreaker:
    """See the module docstring. ``name`` goes into the fail-fast error; ``clock`` is monotonic seconds."""

    def __init__(self, name: str, *, failures: int = 5, probe_s: float = 5.0, max_probe_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        max_probe_s = max(60.0, probe_s) if max_probe_s is None else max_probe_s
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ValueError(f"breaker_failures must be an int >= 1, got {failures!r}")
        if not probe_s > 0 or not max_probe_s >= probe_s:
            raise ValueError(f"breaker_probe_s must be > 0 and <= max_probe_s, got {probe_s!r}, {max_probe_s!r}")
        self.name, self.failures, self.probe_s, self.max_probe_s = name, failures, float(probe_s), float(max_probe_s)
        self._clock = clock
        self.consecutive = 0
        self.opened_at: float | None = None
        self.wait_s = self.probe_s
        self.probing = False
        self.counts = {"opened": 0, "fast_failures": 0, "probes": 0, "closed_after_probe": 0}

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.probing or self._clock() - self.opened_at >= self.wait_s else "open"

    def before(self) -> bool:
        """Admit a call: ``True`` if it is the probe, ``False`` if the breaker is closed; raises
        ``ScorerUnavailable`` while open (or while another call probes)."""
        if self.opened_at is None:
            return False
        if not self.probing and self._clock() - self.opened_at >= self.wait_s:
            self.probing = True
            self.counts["probes"] += 1
            return True
        self.counts["fast_failures"] += 1
        raise ScorerUnavailable(f"{self.name}: server unavailable ({self.consecutive} consecutive failed calls; "
                                f"next probe in {max(0.0, self.opened_at + self.wait_s - self._clock()):.1f} s)")

    def success(self, probe: bool) -> None:
        if probe:
            self.counts["closed_after_probe"] += 1
        self.consecutive, self.opened_at, self.wait_s, self.probing = 0, None, self.probe_s, False

    def failure(self, probe: bool) -> None:
        self.consecutive += 1
        if probe:  # still down: wait longer before the next probe
            self.probing = False
            self.opened_at, self.wait_s = self._clock(), min(2 * self.wait_s, self.max_probe_s)
        elif self.opened_at is None and self.consecutive >= self.failures:
            self.opened_at, self.wait_s = self._clock(), self.probe_s
            self.counts["opened"] += 1

    def abandon(self, probe: bool) -> None:
        """A call ended without an answer either way (cancelled): free the probe slot."""
        if probe:
            self.probing = False
