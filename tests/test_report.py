"""``benchmarks.report``: every generated block of the README and the docs is current, and the docs
site builds strictly (a broken link or page fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]


def test_every_generated_block_is_current(capsys):
    assert report.main(["--check"]) == 0, capsys.readouterr().out


def test_blocks_render_indented_and_unknown_names_fail(monkeypatch):
    monkeypatch.setitem(report.BLOCKS, "t", lambda: "| a |\n|---|\n\nafter")
    text = "x\n  <!-- report:t -->\n  stale\n  <!-- /report:t -->\ny\n"
    assert report.render(text, "t.md") == "x\n  <!-- report:t -->\n  | a |\n  |---|\n\n  after\n  <!-- /report:t -->\ny\n"
    with pytest.raises(KeyError, match="no renderer for block 'nope'"):
        report.render("<!-- report:nope -->\n<!-- /report:nope -->\n", "t.md")


def test_every_results_json_names_its_commit():
    """The run's own commit, or (a run that recorded none) the commit that added the file, flagged stale."""
    from benchmarks.provenance import ROOT as root

    unnamed = []
    for path in sorted((root / "benchmarks" / "results").rglob("*.json")):
        data = json.loads(path.read_text())
        named = data.get("commit") or (data.get("added_in_commit") and data.get("stale"))
        if not (isinstance(named, str) and len(data.get("commit") or data["added_in_commit"]) == 40):
            unnamed.append(str(path.relative_to(root)))
    assert not unnamed, f"results that name no commit: {unnamed}"
    assert report.source("x.json", {"commit": None, "added_in_commit": "a" * 40, "stale": "..."}) == (
        "`x.json` (stale: no commit recorded; added at aaaaaaa)")


def test_the_home_page_is_the_readme_with_site_links():
    page = report.home_page("see [Design](docs/design.md) and `docs/`\n")
    assert page.endswith("see [Design](design.md) and `docs/`\n") and page.startswith("<!-- generated")


def test_every_std_over_seeds_is_the_sample_std():
    assert report.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert report.mean_std([4.0]) == (4.0, 0.0)


def test_the_docs_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "design" / "index.html").is_file()
