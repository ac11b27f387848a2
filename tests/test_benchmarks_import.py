"""Every ``benchmarks/*`` module imports, its ``--help`` runs, and every name it imports from the
project (at the top or inside a function) still exists, so a benchmark cannot rot silently when an
API it uses moves (the PaTR section of ``benchmarks.serve`` once imported a removed class)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("jaxprm", "rollout", "scorers", "benchmarks")
MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")


def _imports(path: Path):
    """``(module, name or None, line)`` for every import statement of the file, nested ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                yield node.module, a.name, node.lineno


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_imports_and_its_help_runs(name, capsys):
    mod = importlib.import_module(f"benchmarks.{name}")
    for module, attr, line in _imports(ROOT / "benchmarks" / f"{name}.py"):
        if module.split(".")[0] not in PROJECT:
            continue
        target = importlib.import_module(module)
        if attr is not None and attr != "*" and not hasattr(target, attr):
            try:
                importlib.import_module(f"{module}.{attr}")
            except ImportError:
                pytest.fail(f"benchmarks/{name}.py:{line}: `from {module} import {attr}`: no such name")
    main = getattr(mod, "main", None)
    if main is None:
        return  # a helper module (benchmarks.anchor)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_the_recipe_table_is_the_mean_and_sample_std_over_seeds():
    from benchmarks.recipe import markdown_table

    runs = {"seeds": {
        "0": {"eval_steps": [0, 10], "success": [0.1, 0.3], "greedy": [0.2, 0.4], "dead_rate": [None, None],
              "steps_over_optimal": [None, 1.0]},
        "1": {"eval_steps": [0, 10], "success": [0.2, 0.5], "greedy": [0.2, 0.6], "dead_rate": [None, None],
              "steps_over_optimal": [0.5, 2.0]}}}
    table = markdown_table(runs).splitlines()
    assert table[0] == "| step | sampled success | greedy success | steps over optimal (solved) |"  # no dead rate
    assert table[2] == "| 0 | 0.150 ± 0.071 | 0.200 ± 0.000 | 0.500 ± 0.000 |"  # stdev([0.1, 0.2]) = 0.0707
    assert table[3] == "| 10 | 0.400 ± 0.141 | 0.500 ± 0.141 | 1.500 ± 0.707 |"


def test_provenance_names_the_commit_command_and_machine():
    from benchmarks.provenance import provenance

    p = provenance([str(ROOT / "benchmarks" / "recipe.py"), "--seeds", "0"])
    assert p["command"] == "python -m benchmarks.recipe --seeds 0"
    assert len(p["commit"]) == 40 and p["machine"]["cpus"] >= 1 and p["date"]
