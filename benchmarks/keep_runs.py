"""Keep a multi-session benchmark's finished runs, small enough to commit.

    python -m benchmarks.keep_runs OUT KEPT

A benchmark that outlives a session (``benchmarks.recipe``, ``benchmarks.frozenlake``) reuses every
run under its ``--out`` that has a ``summary.json``, but a session's machine and its ``--out`` may
not survive. This copies each *finished* run directory under ``OUT`` (one holding
``summary.json``) to the same relative path under ``KEPT``, with only what a reuse and the tables
read: ``summary.json``, ``metrics.jsonl``, ``config.yaml`` and the ``config.resumes`` of a resumed
run, not its checkpoints, TensorBoard events or exported model (a few KB a run instead of MBs).
Unfinished runs are left out. To go on in a new session, copy ``KEPT`` to ``OUT`` and rerun the
benchmark's same command: the kept runs are reused (their recorded config is checked), the rest run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

#: what a reused run needs: the tables read the first two, the config check the third
KEPT_FILES = ("summary.json", "metrics.jsonl", "config.yaml")


def keep_runs(out: Path, kept: Path) -> list[Path]:
    """Copy every finished run under ``out`` (a directory with ``summary.json``, see the module
    docstring) to ``kept``; returns the copied runs' paths relative to ``out``."""
    copied = []
    for summary in sorted(out.rglob("summary.json")):
        run = summary.parent
        if not (run / "metrics.jsonl").is_file():  # a benchmark's own summary.json, not a run's
            continue
        rel = run.relative_to(out)
        dest = kept / rel
        dest.mkdir(parents=True, exist_ok=True)
        for name in KEPT_FILES:
            if (run / name).is_file():
                shutil.copy2(run / name, dest / name)
        if (run / "config.resumes").is_dir():
            shutil.copytree(run / "config.resumes", dest / "config.resumes", dirs_exist_ok=True)
        copied.append(rel)
    return copied


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.keep_runs", description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the benchmark's --out")
    p.add_argument("kept", type=Path, help="where the finished runs' small files go")
    args = p.parse_args(argv)
    if not args.out.is_dir():
        raise SystemExit(f"{args.out}: no such directory")
    copied = keep_runs(args.out, args.kept)
    for rel in copied:
        print(f"kept {rel}")
    print(f"{len(copied)} finished run(s) kept under {args.kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
