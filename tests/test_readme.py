"""The README's and the getting-started page's snippets run, and the README's set-up commands match
what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def _run_snippets(path: pathlib.Path) -> dict:
    """Every python snippet of ``path``, in order, in one namespace (a later one may use an earlier
    one's names)."""
    code = re.findall(r"```python\n(.*?)```", path.read_text(), re.S)
    assert code, f"{path.name} has no python snippet"
    namespace: dict = {}
    for snippet in code:
        exec(compile(snippet, str(path), "exec"), namespace)
    return namespace


def test_readme_snippets_run():
    _run_snippets(ROOT / "README.md")


def test_getting_started_snippets_run():
    namespace = _run_snippets(ROOT / "docs" / "getting-started.md")
    import numpy as np

    # the tree-credit snippet's sibling term: +-1 on the two sibling turns, 0 elsewhere
    np.testing.assert_allclose(np.asarray(namespace["z"]), [[0, 1], [0, -1], [0, 0]], atol=1e-5)


def test_ci_runs_the_readme_test_command():
    bash = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert len(bash) == 2, "README must hold exactly two set-up commands"
    test_cmd = bash[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, ".ci/run must run the README test command verbatim"
