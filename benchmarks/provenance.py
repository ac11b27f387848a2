"""What every results JSON records about how it was made: the commit (and whether the tree had
uncommitted changes), the command line, the machine and the date."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["provenance"]

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _module(script: str) -> str:
    """``benchmarks/recipe.py`` (as ``python -m`` sets ``sys.argv[0]``) -> ``benchmarks.recipe``."""
    path = Path(script).resolve()
    try:
        return ".".join(path.relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return path.stem


def provenance(argv: list[str] | None = None) -> dict:
    """``{"commit", "dirty", "command", "machine", "date"}`` for the running benchmark."""
    import jax

    argv = sys.argv if argv is None else argv
    return {
        "commit": _git("rev-parse", "HEAD") or None,
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "command": " ".join(["python", "-m", _module(argv[0]) if argv else "?", *argv[1:]]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
                    "devices": [str(d.device_kind) for d in jax.devices()]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
