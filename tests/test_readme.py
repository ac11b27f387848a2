"""The README's snippet runs, and its set-up commands match what CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_snippet_runs():
    code = re.findall(r"```python\n(.*?)```", README, re.S)
    assert code, "README has no python snippet"
    exec(compile(code[0], "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    bash = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert len(bash) == 2, "README must hold exactly two set-up commands"
    test_cmd = bash[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci, ".ci/run must run the README test command verbatim"
