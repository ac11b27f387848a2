"""The proxy is layer 4: it may import rollout.*, scorers and jaxprm.learner (the Batch rows), never
jaxprm.models / serve / train; and nothing below it (rollout.types, the client, chat, envs, tree,
export, scorers, jaxprm.learner) imports it."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
UPPER = ("jaxprm.models", "jaxprm.serve", "jaxprm.train")
BELOW = [ROOT / "scorers", ROOT / "jaxprm" / "learner", *[p for p in (ROOT / "rollout").glob("*.py")],
         ROOT / "rollout" / "envs"]


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _files(p: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p.rglob("*.py")) if p.is_dir() else [p]


def test_the_proxy_and_the_agents_import_nothing_above_layer_4():
    bad = [f"{path.relative_to(ROOT)}: {name}"
           for folder in (ROOT / "rollout" / "proxy", ROOT / "rollout" / "agents")
           for path in _files(folder) for name in _imports(path)
           if name in ("jaxprm.models", "jaxprm.serve", "jaxprm.train") or name.startswith(tuple(u + "." for u in UPPER))]
    assert not bad, bad


def test_nothing_below_imports_the_proxy():
    bad = [f"{path.relative_to(ROOT)}: {name}" for p in BELOW for path in _files(p) for name in _imports(path)
           if name == "rollout.proxy" or name.startswith("rollout.proxy.") or name.startswith("rollout.agents")]
    assert not bad, bad
