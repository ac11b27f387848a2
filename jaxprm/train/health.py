"""The trainer process's health, sampled into every train row (long runs must stay flat).

``process_health()`` -> ``{"rss_mb", "open_fds", "threads", "compiled_programs"}``: resident
memory (``/proc/self/status`` VmRSS; ``resource`` peak RSS where ``/proc`` is missing), open
file descriptors (``/proc/self/fd``; ``None`` without ``/proc``), OS threads, and the programs
compiled so far in this process (``jaxprm.train.compilation.METER``). A leak shows as a slope over
steps after warm-up (``jaxprm.train.plots.health_curves`` draws them into ``plots/health.png``).
"""

from __future__ import annotations

import os
import resource
import threading
from pathlib import Path

from jaxprm.train.compilation import METER

__all__ = ["process_health"]


def process_health() -> dict[str, float | int | None]:
    """See the module docstring."""
    rss_mb: float
    threads: int
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        rss_mb = int(fields["VmRSS"].split()[0]) / 1024
        threads = int(fields["Threads"])
        fds: int | None = len(os.listdir("/proc/self/fd"))
    except (OSError, KeyError, ValueError):  # no /proc (macOS): peak RSS, Python threads
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        threads, fds = threading.active_count(), None
    return {"rss_mb": round(rss_mb, 1), "open_fds": fds, "threads": threads,
            "compiled_programs": METER.snapshot().count}
