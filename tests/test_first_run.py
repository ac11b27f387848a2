"""``benchmarks.first_run``'s bookkeeping without installing anything: the environment it gives a
fresh clone shares no cache or venv with the caller's, and its table reads each arm against the goal."""

from __future__ import annotations

from benchmarks.first_run import fresh_env, table


def test_a_fresh_env_has_its_own_home_and_no_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/x/.venv")
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    monkeypatch.setenv("PATH", "/x/.venv/bin:/usr/bin")
    env = fresh_env(tmp_path)
    assert env["HOME"] == str(tmp_path)
    assert "VIRTUAL_ENV" not in env and "XDG_CACHE_HOME" not in env
    assert env["PATH"] == "/usr/bin"


def _arm(precompile, total, gain):
    return {"precompile": precompile, "setup_s": 60.0, "run_s": total - 60.0, "total_s": total,
            "split_s": {"warm_start": 170.0, "learn": 150.0}, "background_compile": [12, 40.0] if precompile else None,
            "gain_points": gain}


def test_the_table_reads_each_arm_against_the_goal():
    out = table([_arm(True, 500.0, 21.0), _arm(False, 470.0, -2.5)], 480.0)
    rows = out.splitlines()
    assert rows[0].startswith("| background compiles | set-up s | run s | total s | goal | warm_start | learn |")
    assert "| on | 60 | 440 | 500 | missed | 170 | 150 | 12 programs, 40 s | +21.0 |" in rows
    assert "| off | 60 | 410 | 470 | met | 170 | 150 | - | -2.5 |" in rows
