"""Synchronous against asynchronous rollouts on the main job: steps per hour and held-out success
over wall time.

    python -m benchmarks.async_rl [--seeds 0 1 2] [--steps 30] [--out runs/bench_async]
                                  [--external [--external-seeds 0]] [--json benchmarks/results/async_rl_cpu.json]

Variants (each ``python -m jaxprm.train seed=S steps=N`` plus):
- ``sync``: the README default;
- ``async``: ``rollout.asynchronous=true rollout.max_staleness=1 ppo.decoupled=true``;
- with ``--external``, both again against a separate ``python -m jaxprm.serve`` process
  (``server.kind=external``, weights synced through ``/update_weights_from_disk``).

Runs go one at a time (timings are the point), sharing one warm-start and compile cache. Before the
timed runs, one untimed run of each variant (first seed, ``OUT/warmup-*``) fills the caches, so no
timed run pays for compiling programs another run made (warm starts are cached per seed). The
time axis is ``loop_s``: seconds since the training loop started (after the warm start and the first
evaluation). A run whose ``summary.json`` exists is reused (resumable).

On the embedded server the rollouts and the learner share the same cores, so what overlap buys is
bounded by how much of a step is waiting rather than computing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._harness import free_port, wait_healthy
from benchmarks.provenance import result_path, write_result
from jaxprm.train.rundir import read_metrics

ASYNC = ["rollout.asynchronous=true", "rollout.max_staleness=1", "ppo.decoupled=true"]


class _ExternalServer:
    """``python -m jaxprm.serve`` on loopback, loading weights from under ``root``."""

    def __init__(self, root: Path, log: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxprm.serve", "--model", "tiny", "--port",
                                      str(self.port), "--weights-root", str(root),
                                      "--served-model-name", "jaxprm"],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_healthy(f"http://127.0.0.1:{self.port}", self.proc, timeout=300, log=log)

    def overrides(self, weights: Path) -> list[str]:
        return ["server.kind=external", f"server.urls=[http://127.0.0.1:{self.port}]", "server.dialect=vllm",
                f"server.weight_sync_dir={weights}"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_one(run_dir: Path, seed: int, steps: int, extra: list[str]) -> dict:
    if not (run_dir / "summary.json").is_file():
        args = [f"seed={seed}", f"steps={steps}", f"run_dir={run_dir}", "progress=false", "plots=false",
                "export_final=false", *extra]
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "jaxprm.train", *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{run_dir}: {out.stderr[-3000:]}")
        print(f"  {run_dir.name}: {time.perf_counter() - t0:.0f} s", flush=True)
    return summarize(run_dir)


def run_external(out: Path, run_dir: Path, tag: str, seed: int, steps: int, extra: list[str]) -> dict:
    """``run_one`` against a server process of its own (``OUT/external-weights-TAG``, its log
    ``OUT/external-server-TAG.log``), started only when the run is not finished yet."""
    if (run_dir / "summary.json").is_file():
        return summarize(run_dir)
    root = out / f"external-weights-{tag}"
    server = _ExternalServer(root, out / f"external-server-{tag}.log")
    try:
        return run_one(run_dir, seed, steps, [*extra, *server.overrides(root / "w")])
    finally:
        server.close()


def summarize(run_dir: Path) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    loop_s = train[-1]["loop_s"]
    return {
        "steps": len(train), "loop_s": round(loop_s, 1), "steps_per_hour": round(3600 * len(train) / loop_s, 1),
        "rollout_s": round(sum(r["rollout_s"] for r in train), 1), "learn_s": round(sum(r["learn_s"] for r in train), 1),
        "rollout_wait_s": round(sum(r.get("rollout_wait_s", r["rollout_s"]) for r in train), 1),
        "staleness_mean": round(statistics.mean(r.get("staleness_mean", 0.0) for r in train), 3),
        "stale_dropped_groups": sum(r.get("stale_dropped_groups", 0) for r in train),
        "success": [[r["step"], round(r.get("loop_s", 0.0), 1), round(r["success"], 4)] for r in evals],
        "gain": round(evals[-1]["success"] - evals[0]["success"], 4),
        "greedy": [round(evals[0].get("greedy_success", 0.0), 4), round(evals[-1].get("greedy_success", 0.0), 4)],
    }


def _table(results: dict) -> str:
    lines = ["| variant | seed | steps/hour | loop s | rollout s (own) | learner waited s | learn s | staleness | "
             "success first -> last (s) | gain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        for seed, r in runs.items():
            first, last = r["success"][0], r["success"][-1]
            lines.append(f"| {name} | {seed} | {r['steps_per_hour']:.0f} | {r['loop_s']:.0f} | {r['rollout_s']:.0f} | "
                         f"{r['rollout_wait_s']:.0f} | {r['learn_s']:.0f} | {r['staleness_mean']:.2f} | "
                         f"{first[2]:.3f} -> {last[2]:.3f} ({last[1]:.0f}) | {100 * r['gain']:+.1f} |")
        sph = [r["steps_per_hour"] for r in runs.values()]
        gains = [100 * r["gain"] for r in runs.values()]
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        lines.append(f"| {name} | mean | {statistics.mean(sph):.0f} ± {sd(sph):.0f} | | | | | | | "
                     f"{statistics.mean(gains):+.1f} ± {sd(gains):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    ap.add_argument("--external", action="store_true", help="also against a separate server process")
    ap.add_argument("--external-seeds", type=int, nargs="+", default=None,
                    help="the seeds of the external-server runs (default: --seeds)")
    ap.add_argument("--only-external", action="store_true",
                    help="run the external-server arms only; the embedded arms' results are kept from --json")
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/async_rl_<device>.json")
    a = ap.parse_args(argv)
    a.json = a.json or result_path("async_rl")
    a.external = a.external or a.only_external
    variants = {"sync": [], "async": ASYNC}
    results: dict[str, dict] = {}
    if a.only_external:  # the embedded arms as an earlier run measured them
        old = json.loads(a.json.read_text())["results"] if a.json.is_file() else {}
        results.update({k: v for k, v in old.items() if k in variants})
    else:
        for name, extra in variants.items():  # untimed: the caches (each seed's warm start is cached by its first run)
            run_one(a.out / f"warmup-{name}", a.seeds[0], a.steps, extra)
        for name, extra in variants.items():
            results[name] = {}
            for seed in a.seeds:
                results[name][seed] = run_one(a.out / f"{name}-s{seed}", seed, a.steps, extra)
    if a.external:  # a server per run: its weight versions never go back, and each run starts at 0
        for name, extra in variants.items():  # untimed warm-ups: the learner's and the server's compile caches
            run_external(a.out, a.out / f"warmup-{name}-external", f"warmup-{name}", a.seeds[0], a.steps, extra)
        for name, extra in variants.items():
            results[f"{name}, external server"] = {
                seed: run_external(a.out, a.out / f"{name}-external-s{seed}", f"{name}-s{seed}", seed, a.steps, extra)
                for seed in a.external_seeds or a.seeds}
    table = _table(results)
    print(table)
    write_result(a.json, {"steps": a.steps, "seeds": a.seeds, "results": results,
                          "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
