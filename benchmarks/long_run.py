"""Long-run health: one long training run, the trainer process sampled every step.

    python -m benchmarks.long_run [--steps 500] [--warmup 50] [--small] [--json PATH] [key=value ...]
    python -m benchmarks.long_run --plot benchmarks/results/long_run_cpu.json [--warmup N]  # figure, table again

Every train row carries the trainer's RSS, open file descriptors, OS threads and programs compiled
(``jaxprm.train.health``). After ``--warmup`` steps each must be flat: the benchmark fits a line to
steps ``warmup..N`` and reports its slope per 100 steps, the range, and the first and last values.
A leak shows as a slope that does not fade. ``--small`` runs the tests' small settings (2 tasks x 4
samples a step, no warm start: ~2 s a step on 2 CPU cores) instead of the default config (~25 s a
step), the same code path per step with smaller batches. Writes JSON (with provenance and every
step's sample) and ``PATH.png`` drawn from it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.provenance import result_path, write_result

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("rss_mb", "open_fds", "threads", "compiled_programs")
SMALL = [
    "env.train_tasks=64", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.every_steps=100",
    "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2",
    "warm_start.enabled=false", "checkpoint.every_steps=10", "checkpoint.keep=2",
]


def flatness(rows: list[dict], warmup: int, block: int = 50) -> dict:
    """Per key, over the steps from ``warmup`` on: first/last value, range, the least-squares slope
    per 100 steps, and the means of consecutive whole ``block``-step blocks (``block_means``: a leak
    keeps raising them; RSS that swings by hundreds of MB from step to step can tilt a fitted slope
    without any block mean rising)."""
    out = {}
    for key in KEYS:
        pts = np.array([(r["step"], r[key]) for r in rows if r["step"] >= warmup and r.get(key) is not None], float)
        if len(pts) < 2:
            out[key] = None
            continue
        slope = np.polyfit(pts[:, 0], pts[:, 1], 1)[0]
        blocks = [round(float(pts[i:i + block, 1].mean()), 1) for i in range(0, len(pts) - block + 1, block)]
        out[key] = {"after_warmup": pts[0, 1], "last": pts[-1, 1], "min": pts[:, 1].min(), "max": pts[:, 1].max(),
                    "slope_per_100_steps": round(float(slope) * 100, 3), "block_means": blocks}
    return out


def plot(result: dict, out: Path) -> None:
    """The four samples against the step, drawn from ``result`` (a ``long_run`` JSON)."""
    from jaxprm.train.plots import health_figure

    health_figure([{"kind": "train", **r} for r in result["series"]], out)


def flatness_table(result: dict) -> str:
    """Markdown: per sample, its value after warm-up, last, min, max and fitted slope per 100 steps."""
    lines = ["| sample | after warm-up | last | min | max | slope per 100 steps | 50-step block means, first / max / last |",
             "|---|---|---|---|---|---|---|"]
    for key, f in result["flatness"].items():
        if f:
            b = f["block_means"]
            blocks = f"{b[0]:g} / {max(b):g} / {b[-1]:g}" if b else "-"
            lines.append(f"| {key} | {f['after_warmup']:g} | {f['last']:g} | {f['min']:g} | {f['max']:g} "
                         f"| {f['slope_per_100_steps']:g} | {blocks} |")
    return "\n".join(lines)


def _print(result: dict) -> None:
    print(f"after step {result['warmup']}:\n{flatness_table(result)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="the tests' small settings instead of the default config")
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/long_run_<device>.json")
    ap.add_argument("--plot", type=Path, default=None, help="only draw the figure of an existing JSON")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    args.json = args.json or result_path("long_run")
    if args.plot is not None:  # the figure again, and the flatness for this --warmup
        result = json.loads(args.plot.read_text())
        result["warmup"], result["flatness"] = args.warmup, flatness(result["series"], args.warmup)
        args.plot.write_text(json.dumps(result, indent=1))  # not write_result: the file keeps its run's provenance
        plot(result, args.plot.with_suffix(".png"))
        _print(result)
        return 0
    from jaxprm.train.rundir import read_metrics

    run = Path(tempfile.mkdtemp(prefix="jaxprm-long-run-")) / "run"
    cmd = [sys.executable, "-m", "jaxprm.train", *(SMALL if args.small else []), f"steps={args.steps}",
           "progress=false", "export_final=false", f"run_dir={run}", *args.overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
    series = [{"step": r["step"], **{k: r.get(k) for k in KEYS}} for r in rows]
    result = {"benchmark": "long_run", "steps": args.steps, "warmup": args.warmup,
              "small": args.small, "overrides": args.overrides, "run_dir": str(run),
              "flatness": flatness(series, args.warmup), "series": series}
    write_result(args.json, result)
    plot(result, args.json.with_suffix(".png"))
    _print(result)
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
