"""Learning through the recording proxy vs the tree path, at matching settings.

    python -m benchmarks.proxy_learning [--seeds 0 1 2] [--steps N] [--out runs/bench_proxy_learning]
                                        [--json benchmarks/results/proxy_learning_cpu.json] [key.sub=value ...]

Both arms run ``configs/agent_frozenlake.yaml`` (flat GRPO groups of 8 on 4x4 FrozenLake, the
FrozenLake progress scorer as a per-turn process reward, the same warm start per seed, the same
held-out maps and evaluator); only ``rollout.source`` differs: ``agent`` (the OpenAI-SDK example
agent through the in-process proxy) or ``tree`` (``rollout.tree`` drives the same environment).
Every run is its own process. Prints held-out sampled success per eval step (each seed, mean ± std)
and writes the JSON (with the load average before and after each run: the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "agent_frozenlake.yaml"
ARMS = ("agent", "tree")


def _run(arm: str, seed: int, out: Path, steps: int | None, extra: list[str]) -> dict:
    from jaxprm.train.rundir import read_metrics

    run_dir = out / f"{arm}-s{seed}"
    overrides = [f"rollout.source={arm}", f"seed={seed}", f"env.seed={seed}", f"run_dir={run_dir}", "progress=false",
                 "export_final=false", "plots=false", *extra]
    if steps is not None:
        overrides.append(f"steps={steps}")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    if not (run_dir / "summary.json").is_file():
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        proc = subprocess.run([sys.executable, "-m", "jaxprm.train", "--config", str(CONFIG), *overrides],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{arm} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    ev = [r for r in rows if r["kind"] == "eval"]
    tr = [r for r in rows if r["kind"] == "train"]
    res = {
        "arm": arm, "seed": seed, "wall_s": wall, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "steps": [r["step"] for r in ev], "success": [r["success"] for r in ev],
        "pass_at_4": [r.get("pass_at_4") for r in ev], "greedy": [r.get("greedy_success") for r in ev],
        "train_success": [r.get("success") for r in tr], "rollout_s": float(sum(r.get("rollout_s", 0) for r in tr)),
        "sampled_actions": int(sum(r.get("sampled_actions", 0) for r in tr)),
        "agent_failed_groups": int(sum(r.get("agent_failed_groups", 0) for r in tr)),
    }
    print(f"  {arm} seed {seed}: {wall:.0f}s  success {res['success']}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_learning", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--out", default="runs/bench_proxy_learning")
    p.add_argument("--json", default="benchmarks/results/proxy_learning_cpu.json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:  # interleave the arms so machine load affects both alike
        for arm in args.arms:
            runs.append(_run(arm, seed, out, args.steps, args.overrides))
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"config": str(CONFIG.relative_to(ROOT)), "runs": runs}, indent=1))
    print("\nheld-out sampled success (64 maps x 4 samples) per eval step")
    summary = {}
    for arm in args.arms:
        rs = [r for r in runs if r["arm"] == arm]
        n = min(len(r["success"]) for r in rs)
        succ = np.array([r["success"][:n] for r in rs])
        for r in rs:
            print(f"{arm:<6} seed {r['seed']}: " + "  ".join(f"@{s}={v:.3f}" for s, v in zip(r["steps"], r["success"])))
        print(f"{arm:<6} mean ± std: " + "  ".join(f"@{s}={m:.3f}±{d:.3f}" for s, m, d in
                                                  zip(rs[0]["steps"][:n], succ.mean(0), succ.std(0))))
        gain = succ[:, -1] - succ[:, 0]
        summary[arm] = {"first_mean": float(succ[:, 0].mean()), "last_mean": float(succ[:, -1].mean()),
                        "last_std": float(succ[:, -1].std()), "gain_mean": float(gain.mean()),
                        "gain_std": float(gain.std()), "seeds": len(rs)}
        print(f"{arm:<6} gain (last - first): {gain.mean():+.3f} ± {gain.std():.3f}")
    Path(args.json).write_text(json.dumps({"config": str(CONFIG.relative_to(ROOT)), "runs": runs, "summary": summary},
                                          indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
