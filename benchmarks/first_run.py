"""The README main command as a new user runs it: a fresh clone, empty caches, set-up included.

    python -m benchmarks.first_run [--arms on off] [--json PATH] [--keep DIR] [key=value ...]

Each arm clones this repository's HEAD into a new directory and gives it an empty ``HOME``, so the
pip cache, the warm-start cache and JAX's compilation cache all start empty, as on a fresh machine.
It then times the README's two parts one after the other:

- **set-up**: ``python3 -m venv .venv`` and ``pip install -q -e .`` (downloads included);
- **run**: ``python -m jaxprm.train compile_cache.precompile=<arm>``, the default config.

``--arms on off`` runs the background compiler (``compile_cache.precompile``) on in one arm and off
in the other, so that what it costs the run it serves is measured, not guessed. The split of the run
comes from the run's own ``summary.json`` (warm start, compile, learn, rollout, eval, ...), and the
gain is held-out sampled success at the last evaluation minus the first, in points.

The arms run one after the other; run them on a quiet machine (a busy one makes both slower). The
goal they are read against (8 minutes, set-up included) is the issue's, not this script's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.provenance import git, result_path, write_result

ROOT = Path(__file__).resolve().parents[1]


def _timed(cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> float:
    """Run ``cmd`` to completion (output to ``log``); its wall seconds. Raises on a non-zero exit."""
    t0 = time.perf_counter()
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}")
    return wall


def fresh_env(home: Path) -> dict[str, str]:
    """The caller's environment with ``home`` as ``HOME`` and nothing that points at another cache or venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XDG_CACHE_HOME", "PIP_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    env["HOME"] = str(home)
    return env


def run_arm(commit: str, precompile: bool, work: Path, overrides: list[str]) -> dict:
    """One first run of ``commit`` in ``work`` (clone, venv, install, train); its timings, split and gain."""
    repo, home, log = work / "repo", work / "home", work / "log.txt"
    home.mkdir(parents=True)
    env = fresh_env(home)
    # a clone of a git worktree gets the main checkout's branch: check out the commit this process runs
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", commit], check=True)
    venv = _timed(["python3", "-m", "venv", ".venv"], cwd=repo, env=env, log=log)
    pip = _timed([str(repo / ".venv/bin/pip"), "install", "-q", "-e", "."], cwd=repo, env=env, log=log)
    run = _timed([str(repo / ".venv/bin/python"), "-m", "jaxprm.train", f"compile_cache.precompile={str(precompile).lower()}",
                  *overrides], cwd=repo, env=env, log=log)
    summaries = sorted((repo / "runs").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    if not summaries:
        raise RuntimeError(f"the run wrote no summary.json under {repo / 'runs'}; see {log}")
    s = json.loads(summaries[-1].read_text())
    first, last = s.get("first_eval") or {}, s.get("last_eval") or {}
    gain = None if "success" not in first or "success" not in last else round((last["success"] - first["success"]) * 100, 1)
    return {"precompile": precompile, "setup_s": round(venv + pip, 1), "venv_s": round(venv, 1), "pip_s": round(pip, 1),
            "run_s": round(run, 1), "total_s": round(venv + pip + run, 1), "train_wall_s": round(s["wall_s"], 1),
            "split_s": {k: round(v, 1) for k, v in s["timings"].items()},
            "warm_start_cached": (s.get("warm_start") or {}).get("cached"),
            "compiled_programs": s.get("compiled_programs"), "compile_cache_hits": s.get("compile_cache_hits"),
            "background_compile": s.get("background_compile"), "steps": s["steps"],
            "first_success": first.get("success"), "last_success": last.get("success"), "gain_points": gain}


def table(arms: list[dict], goal_s: float) -> str:
    """Markdown: one row per arm (set-up, run, total against the goal, the run's split, the gain)."""
    keys = sorted({k for a in arms for k in a["split_s"]}, key=lambda k: -max(a["split_s"].get(k, 0) for a in arms))
    head = ("| background compiles | set-up s | run s | total s | goal | " + " | ".join(keys)
            + " | background compiled | gain (points) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in arms:
        bg = a["background_compile"]
        lines.append(f"| {'on' if a['precompile'] else 'off'} | {a['setup_s']:.0f} | {a['run_s']:.0f} | {a['total_s']:.0f} "
                     f"| {'met' if a['total_s'] <= goal_s else 'missed'} | "
                     + " | ".join(f"{a['split_s'].get(k, 0):.0f}" for k in keys)
                     + f" | {'-' if not bg else f'{bg[0]:.0f} programs, {bg[1]:.0f} s'} | {a['gain_points']:+.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", nargs="+", choices=("on", "off"), default=["on", "off"],
                    help="compile_cache.precompile in each arm, run in this order")
    ap.add_argument("--goal-s", type=float, default=480.0, help="the time the total is read against (default 8 minutes)")
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/first_run_<device>.json")
    ap.add_argument("--keep", type=Path, default=None, help="work here and keep the clones (default: a temp dir, removed)")
    ap.add_argument("overrides", nargs="*", help="key=value passed to the run (none: the README's command)")
    args = ap.parse_args(argv)
    args.json = args.json or result_path("first_run")
    commit = git("rev-parse", "HEAD")
    if git("status", "--porcelain", "--untracked-files=no"):
        print("note: the working tree has uncommitted changes; the clone runs the last commit", file=sys.stderr)
    arms = []
    with tempfile.TemporaryDirectory(prefix="jaxprm-first-run-") as tmp:
        base = args.keep or Path(tmp)
        for i, arm in enumerate(args.arms):
            work = base / f"{i}-precompile-{arm}"
            print(f"arm {i + 1}/{len(args.arms)}: background compiles {arm} ({work})", flush=True)
            arms.append(run_arm(commit, arm == "on", work, args.overrides))
            print(json.dumps(arms[-1]), flush=True)
    result = {"benchmark": "first_run", "goal_s": args.goal_s, "overrides": args.overrides, "arms": arms}
    write_result(args.json, result)
    print(table(arms, args.goal_s))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
