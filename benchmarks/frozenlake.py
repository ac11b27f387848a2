"""Flat GRPO vs Tree-Random vs PaTR on the default FrozenLake setup, at an equal rollout budget.

    python -m benchmarks.frozenlake [--seeds 0 1 2] [--steps N] [--out runs/bench] [key.sub=value ...]

Every run uses the embedded default (same warm start per seed, same tasks, same learner); only
``rollout.strategy`` changes. The budget is equal by construction: flat groups have ``group_size``
samples, tree groups have ``max_branches = group_size`` trajectories (dead slots are refilled), and
the table also reports the sampled actions each strategy actually spent. Prints a table of held-out
sampled success per eval step (mean ± std over seeds), writes ``results.json`` and ``success.png``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

STRATEGIES = ("flat", "tree_random", "patr")


def _run(strategy: str, seed: int, out: Path, steps: int | None, extra: list[str]) -> dict:
    """One training run in its own process (compiled programs of earlier runs would otherwise pile
    up in this one until LLVM cannot map more code), then its metrics."""
    from jaxprm.train.config import load_config
    from jaxprm.train.rundir import read_metrics

    run_dir = out / f"{strategy}-s{seed}"
    overrides = [f"rollout.strategy={strategy}", f"seed={seed}", f"env.seed={seed}", f"run_dir={run_dir}",
                 "progress=false", "export_final=false", *extra]
    if steps is not None:
        overrides.append(f"steps={steps}")
    cfg = load_config(None, overrides)
    if run_dir.exists() and (run_dir / "summary.json").is_file():
        pass  # reuse a finished run
    else:
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxprm.train", *overrides], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{strategy} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        print(f"  {strategy} seed {seed}: {time.perf_counter() - t0:.0f}s", flush=True)
    rows = read_metrics(run_dir / "metrics.jsonl")
    ev = [r for r in rows if r["kind"] == "eval"]
    tr = [r for r in rows if r["kind"] == "train"]
    return {
        "steps": [r["step"] for r in ev],
        "success": [r["success"] for r in ev],
        "pass_at_k": [r.get(f"pass_at_{cfg.eval.samples}") for r in ev],
        "greedy": [r.get("greedy_success") for r in ev],
        "sampled_actions": int(sum(r.get("sampled_actions", 0) for r in tr)),
        "groups_with_success": float(np.mean([r.get("groups_with_success", 0) for r in tr])) if tr else 0.0,
        "expanded": int(sum(r.get("expanded", 0) for r in tr)),
        "pruned": int(sum(r.get("pruned", 0) for r in tr)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frozenlake", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the config's)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--out", default="runs/bench_frozenlake")
    p.add_argument("overrides", nargs="*", help="extra key.sub=value overrides for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {}
    for strategy in args.strategies:
        for seed in args.seeds:
            results.setdefault(strategy, []).append(_run(strategy, seed, out, args.steps, args.overrides))
    (out / "results.json").write_text(json.dumps(results, indent=1))

    print("\nheld-out sampled success (mean ± std over seeds) per eval step")
    steps = results[args.strategies[0]][0]["steps"]
    header = f"{'strategy':<12}" + "".join(f"{f'@{s}':>14}" for s in steps) + f"{'curve mean':>14}{'pass@k last':>13}{'actions':>10}{'grp w/ succ':>12}"
    print(header)
    summary = {}
    for strategy, runs in results.items():
        n = min(len(r["success"]) for r in runs)
        succ = np.array([r["success"][:n] for r in runs])
        pk = np.array([r["pass_at_k"][n - 1] or 0.0 for r in runs])
        mean, std = succ.mean(0), succ.std(0)
        cells = "".join(f"{m:>8.3f}±{s:<5.3f}" for m, s in zip(mean, std))
        acts = np.mean([r["sampled_actions"] for r in runs])
        gws = np.mean([r["groups_with_success"] for r in runs])
        print(f"{strategy:<12}{cells}{succ.mean():>14.3f}{pk.mean():>13.3f}{acts:>10.0f}{gws:>12.3f}")
        summary[strategy] = {"curve_mean": float(succ.mean()), "final_mean": float(mean[-1]), "final_std": float(std[-1])}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, runs in results.items():
        n = min(len(r["success"]) for r in runs)
        xs = runs[0]["steps"][:n]
        succ = np.array([r["success"][:n] for r in runs])
        ax.plot(xs, succ.mean(0), marker="o", label=strategy)
        ax.fill_between(xs, succ.mean(0) - succ.std(0), succ.mean(0) + succ.std(0), alpha=0.2)
    ax.set(xlabel="training step", ylabel="held-out sampled success", title=f"FrozenLake, {len(args.seeds)} seeds",
           ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "success.png", dpi=110)
    print(f"\nwrote {out / 'results.json'}, {out / 'summary.json'}, {out / 'success.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
