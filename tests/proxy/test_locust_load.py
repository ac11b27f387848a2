"""``benchmarks.proxy_locust`` end to end at a small scale: locust spawns SDK agents against a real
proxy and scripted upstream on loopback, and every session's exported row holds exactly its turns."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_locust_agents_lose_no_turn(tmp_path):
    if not (Path(sys.executable).with_name("locust").is_file() or shutil.which("locust")):
        pytest.fail("locust is not installed (it is in the test extra)")
    from benchmarks.proxy_locust import main

    out = tmp_path / "locust.json"
    assert main(["--agents", "10", "--turns", "3", "--spawn-rate", "20", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["sessions_played"], r["turns"], r["rows"], len(r["command"]) > 0) == (10, 30, 10, True)
    assert r["rows_not_matching"] == r["rejected_groups"] == r["failures"] == 0
    assert r["command"] and r["commit"]
