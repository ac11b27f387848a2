"""What every results JSON records about how it was made: the commit (and whether the tree had
uncommitted changes), the command line, the machine (CPU model, cores, memory, accelerators), the
jax / jaxlib versions and the date; ``write_result`` writes a benchmark's JSON with it."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["device_name", "git", "gpu_model", "provenance", "result_path", "write_result"]

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """``git ARGS`` in this checkout, its stripped stdout (empty when git fails)."""
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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def device_name() -> str:
    """The ``<device>`` of a result's name, found without starting JAX (a parent that spawns servers
    must not take the accelerator's memory): ``cpu`` when ``JAX_PLATFORMS`` is ``cpu`` or nothing
    else is found, else the GPU model as ``nvidia-smi`` names it (``NVIDIA H200`` -> ``h200``), else
    ``tpu`` where a TPU is attached."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return "cpu"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        names = []
    for name in filter(None, (n.strip() for n in names)):
        return gpu_model(name)
    if Path("/dev/accel0").exists() or os.environ.get("TPU_NAME"):
        return "tpu"
    return "cpu"


def gpu_model(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``, ``Tesla V100-SXM2-16GB`` -> ``v100``; ``gpu`` if no model."""
    import re

    model = re.search(r"\b([a-z]+\d+[a-z]*)\b", name.lower().removeprefix("nvidia "))
    return model.group(1) if model else "gpu"


def result_path(bench: str, variant: str | None = None) -> Path:
    """``benchmarks/results/<bench>_<device>[_variant].json``: where a benchmark's JSON goes by default."""
    return ROOT / "benchmarks" / "results" / f"{bench}_{device_name()}{'_' + variant if variant else ''}.json"


#: where a tree copied without its ``.git`` learns its commit (``benchmarks/lent_gpu_prepare.sh`` writes it)
COMMIT_ENV = "JAXPRM_COMMIT"


def provenance(argv: list[str] | None = None, *, config: dict | None = None) -> dict:
    """``{"commit", "dirty", "command", "machine", "date"}`` (and ``"config"``, the resolved config
    of the run, when given) for the running benchmark. Outside a git checkout the commit is
    ``$JAXPRM_COMMIT`` (set by whoever copied the tree; ``dirty`` is then unknown: ``None``), else
    ``None``."""
    import jax
    import jaxlib

    argv = sys.argv if argv is None else argv
    commit = git("rev-parse", "HEAD")
    dirty: bool | None = bool(git("status", "--porcelain", "--untracked-files=no"))
    if not commit:  # a copy of the tree without .git (a lent GPU machine): the commit it was copied from
        commit, dirty = os.environ.get(COMMIT_ENV, "").strip(), None
    out = {
        "commit": commit or None,
        "dirty": dirty,
        "command": " ".join(["python", "-m", _module(argv[0]) if argv else "?", *argv[1:]]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_model": _cpu_model(), "cpus": os.cpu_count(), "memory_gib": _memory_gib(),
                    "python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                    "devices": [str(d.device_kind) for d in jax.devices()]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if config is not None:
        out["config"] = config
    return out


def write_result(path: str | os.PathLike, payload: dict, *, config: dict | None = None) -> Path:
    """Write ``provenance(config=config)`` and ``payload`` as JSON to ``path`` (parents made); returns
    the path. The benchmarks' one JSON writer. A payload dict under a provenance key (a benchmark's
    own ``"machine"``) is merged under it, provenance's entries winning; any other clash is an error."""
    import json

    prov = provenance(config=config)
    out = {**prov}
    for key, value in payload.items():
        if key not in prov:
            out[key] = value
        elif isinstance(value, dict) and isinstance(prov[key], dict):  # e.g. a benchmark's own "machine"
            out[key] = {**value, **prov[key]}
        else:
            raise ValueError(f"the result's key {key!r} is provenance's; rename it")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return path
