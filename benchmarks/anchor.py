"""The learner kernels of an older commit, reachable in the same benchmark process (the anchor),
and the full-size copies / transposes in a compiled program's HLO.

``load_anchor(REV)`` extracts ``jaxprm/__init__.py`` and ``jaxprm/learner`` of ``REV`` (``git
archive``) into a temporary directory as the package ``jaxprm_anchor`` (imports rewritten) and
imports it next to the current ``jaxprm``. ``best_interleaved`` then times a current and an old
kernel alternately, so both see the same machine load (this machine is shared).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType

import jax

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["load_anchor", "best_interleaved", "hlo_copies"]


def load_anchor(rev: str, paths: tuple[str, ...] = ("jaxprm/__init__.py", "jaxprm/learner")) -> ModuleType:
    """The ``jaxprm`` learner of git revision ``rev`` as the module ``jaxprm_anchor`` (``paths``:
    the parts of ``jaxprm`` to extract; ``benchmarks.serve_decode`` takes the models and the server)."""
    out = Path(tempfile.mkdtemp(prefix="jaxprm-anchor-"))
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, *paths],
                          check=True, capture_output=True).stdout
    (out / "src.tar").write_bytes(data)
    with tarfile.open(out / "src.tar") as tf:
        tf.extractall(out, filter="data")
    (out / "jaxprm").rename(out / "jaxprm_anchor")
    for f in (out / "jaxprm_anchor").rglob("*.py"):
        f.write_text(re.sub(r"\bjaxprm\b", "jaxprm_anchor", f.read_text()))
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("jaxprm_anchor")
    finally:
        sys.path.remove(str(out))


def best_interleaved(new, old, repeats: int) -> tuple[float, float]:
    """Best seconds of ``new()`` and ``old()`` (each compiled first), alternating the two."""
    jax.block_until_ready(new())
    jax.block_until_ready(old())
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((new, old)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


_SHAPE = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(copy|transpose)\(")


def hlo_copies(compiled_text: str, min_elements: int) -> dict[str, int]:
    """Count ``copy`` and ``transpose`` instructions (top level and inside fusions) whose result has
    at least ``min_elements`` elements, in ``jax.jit(f).lower(...).compile().as_text()``."""
    counts = {"copy": 0, "transpose": 0}
    for m in _SHAPE.finditer(compiled_text):
        n = 1
        for d in m.group(2).split(","):
            n *= int(d) if d else 1
        if n >= min_elements:
            counts[m.group(3)] += 1
    return counts
