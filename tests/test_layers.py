"""The house's layering (docs/design.md), declared in pyproject.toml and checked by import-linter:
jaxprm.learner < rollout.types < scorers < rollout < jaxprm.models < jaxprm.serve < jaxprm.train."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxprm", "rollout", "scorers")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_the_layering_contract_holds():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_the_contract_fails_on_an_upward_import(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    export = tmp_path / "rollout" / "export.py"
    export.write_text(export.read_text() + "\nimport jaxprm.serve  # an upward import\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "rollout.export is not allowed to import jaxprm.serve" in out.stdout


def test_layer_4_names_every_rollout_module_but_types():
    """The first contract lists rollout's modules one by one (so that rollout.types can be layer 2
    without ignored imports): a new rollout module must be named there too."""
    import tomllib

    (layers,) = [c["layers"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
                 ["contracts"] if c["name"].startswith("layers: ")]
    (layer4,) = [layer for layer in layers if layer.startswith("rollout.agents")]
    named = {m.strip() for m in layer4.split(":")}
    modules = {f"rollout.{p.stem}" for p in (ROOT / "rollout").iterdir()
               if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert named == modules - {"rollout.types"}
    assert "rollout.types" in layers


def test_importing_scorers_loads_no_jax_and_no_rollout_machinery():
    code = ("import sys, scorers; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'optax', 'chex', 'orbax', 'torch') or (m.startswith('rollout.') and "
            "m != 'rollout.types') or (m.startswith('jaxprm.') and m not in ('jaxprm.modes', 'jaxprm.imports', 'jaxprm.fields'))); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
