"""Time the learner kernels of an older commit in the same benchmark run (the anchor), and count the
full-size copies / transposes in a compiled program's HLO.

``benchmarks.kernels --anchor REV`` extracts ``jaxprm/__init__.py`` and ``jaxprm/learner`` of
``REV`` (``git archive``) into a temporary directory and, for each size, times the same JAX kernels
there in a subprocess whose ``PYTHONPATH`` puts that copy first, right after timing the current
code. So both are measured on the same machine state, minutes apart.

    python -m benchmarks.anchor --worker DIR --size 256x8192 --repeats 5 --kernels gae_scan,...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["extract", "time_anchor", "hlo_copies"]


def extract(rev: str) -> str:
    """A temporary directory holding ``jaxprm/__init__.py`` and ``jaxprm/learner`` of ``rev``."""
    out = tempfile.mkdtemp(prefix="jaxprm-anchor-")
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "jaxprm/__init__.py",
                           "jaxprm/learner"], check=True, capture_output=True).stdout
    tar_path = Path(out) / "src.tar"
    tar_path.write_bytes(data)
    with tarfile.open(tar_path) as tf:
        tf.extractall(out, filter="data")
    tar_path.unlink()
    return out


def time_anchor(src: str, B: int, T: int, repeats: int, kernels: list[str]) -> dict[str, float]:
    """``{kernel: best seconds}`` of ``kernels`` at ``[B, T]`` for the code in ``src``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "benchmarks.anchor", "--worker", src, "--size", f"{B}x{T}",
                          "--repeats", str(repeats), "--kernels", ",".join(kernels)],
                         check=True, capture_output=True, text=True, env=env, cwd=src)
    return json.loads(out.stdout.strip().splitlines()[-1])


_SHAPE = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(copy|transpose)\(")


def hlo_copies(compiled_text: str, min_elements: int) -> dict[str, int]:
    """Count ``copy`` and ``transpose`` instructions (top level and inside fusions) whose result has
    at least ``min_elements`` elements, in ``jax.jit(f).lower(...).compile().as_text()``."""
    counts = {"copy": 0, "transpose": 0}
    for m in _SHAPE.finditer(compiled_text):
        dims = [int(d) for d in m.group(2).split(",") if d]
        n = 1
        for d in dims:
            n *= d
        if n >= min_elements:
            counts[m.group(3)] += 1
    return counts


def _worker(args) -> None:
    import jax

    import jaxprm
    from benchmarks.kernels import _best_time, jax_kernels, make_inputs

    assert Path(jaxprm.__file__).resolve().is_relative_to(Path(args.worker).resolve()), jaxprm.__file__
    B, T = (int(v) for v in args.size.split("x"))
    ks = jax_kernels(make_inputs(B, T))
    out = {}
    for name in args.kernels.split(","):
        if name in ks:
            out[name] = _best_time(ks[name][0], args.repeats, jax.block_until_ready)
    print(json.dumps(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--size", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kernels", required=True)
    _worker(ap.parse_args())
