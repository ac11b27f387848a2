"""scorers is layer 3: it may import rollout.types, numpy, asyncio and httpx; never jax, never the
rollout machinery (client, envs, tree, export), never jaxprm."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN = ("jax", "jaxlib", "flax", "optax", "chex", "orbax", "torch", "jaxprm")
ROLLOUT_ALLOWED = ("rollout", "rollout.types")


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_upward_imports_in_the_source():
    bad = []
    for path in sorted((ROOT / "scorers").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top in FORBIDDEN or (top == "rollout" and name not in ROLLOUT_ALLOWED):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_importing_scorers_loads_no_jax_and_no_rollout_machinery():
    code = (
        "import sys, scorers; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in %r "
        "or (m.startswith('rollout.') and m != 'rollout.types')); print(bad)" % (FORBIDDEN,)
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
