"""The README's snippet runs, and its set-up commands match what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_snippets_run():
    """Every python snippet, in order, in one namespace (a later one may use an earlier one's names)."""
    code = re.findall(r"```python\n(.*?)```", README, re.S)
    assert code, "README has no python snippet"
    namespace: dict = {}
    for snippet in code:
        exec(compile(snippet, "README.md", "exec"), namespace)
    import numpy as np

    # the tree-credit snippet's sibling term: +-1 on the two sibling turns, 0 elsewhere
    np.testing.assert_allclose(np.asarray(namespace["z"]), [[0, 1], [0, -1], [0, 0]], atol=1e-5)


def test_ci_runs_the_readme_test_command():
    bash = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert len(bash) == 2, "README must hold exactly two set-up commands"
    test_cmd = bash[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, ".ci/run must run the README test command verbatim"
