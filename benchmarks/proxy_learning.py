"""Learning through the recording proxy vs the tree path's flat GRPO, at the same settings.

    python -m benchmarks.proxy_learning [--seeds 0 1 2] [--steps N] [--arms agent [agent_processes] tree] [--config YAML]
                                        [--out runs/bench_proxy_learning]
                                        [--json benchmarks/results/proxy_learning_cpu.json] [key.sub=value ...]

Both arms run ``configs/agent_frozenlake.yaml`` (``--config``; flat GRPO groups of 8 on 4x4 FrozenLake, 8 tasks
per step, the FrozenLake progress scorer as a per-turn process reward, the same warm start, task
stream, held-out maps and evaluator per seed); only ``rollout.source`` differs: ``agent`` (the
OpenAI-SDK example agent through the in-process proxy) or ``tree`` (``rollout.tree`` drives the same
environment). The agent's kwargs are interpolated from ``env`` / ``rollout`` in that config, so an
override reaches both arms; each run's resolved ``config.yaml`` is compared with its twin's and the
benchmark stops if they differ anywhere but ``rollout.source`` and ``run_dir``.

Common random numbers: the agent path seeds its sessions like the tree path's flat groups
(``rollout.proxy.sessions``), so with the same seed both arms sample from the same per-request seeds
and, as long as the policies agree, train on the same rows (``tests/proxy/test_equivalence.py`` pins
row equality against a deterministic server). The arms then differ only through what the data path
does differently, plus float rounding: the server batches the two arms' requests differently, the
sampler's log-probs agree to ~1e-6, and once the parameters differ a near-tie sample can flip and
the runs drift apart like two seeds.

Every run is its own process (a finished run is reused when its ``summary.json`` exists). Prints
per seed the held-out sampled success (64 maps x 4 samples) at every eval step for both arms, the
gain (last - first), the difference agent - tree, and mean ± sample std over seeds; the JSON has the
curves, training statistics (train success, sampled actions, generated tokens, behavior KL, masked
turns, failed agent groups, rollout seconds) and the load average before and after each run, and
per seed the ratio of the arms' rollout seconds (issue 40's goal: agent <= 1.5x tree for the same
samples; with common random numbers both arms generate the same tokens while their policies agree).
The tool-calling agent (every move a ``move(direction)`` function call, issue 38) is the same
benchmark over its config:

    python -m benchmarks.proxy_learning --config configs/agent_frozenlake_tools.yaml --arms agent \
        --out runs/bench_proxy_learning_tools --json benchmarks/results/proxy_learning_cpu_tools.json

``--arms agent agent_processes tree`` adds the agents in a child process (``agent.processes=1``)
as a third arm, timed against the same tree runs. A rollout-time measurement need not learn long:

    python -m benchmarks.proxy_learning --seeds 0 --steps 10 --json PATH warm_start.steps=50 \
        eval.at_start=false eval.every_steps=100 eval.num_tasks=8
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.provenance import result_path, write_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "agent_frozenlake.yaml"
#: arm -> what it adds: ``agent`` (the agents on the trainer's event loop), ``agent_processes`` (the
#: same agents in a child process, ``agent.processes=1``), ``tree`` (the tree path)
ARMS = {"agent": ["rollout.source=agent", "agent.processes=0"],
        "agent_processes": ["rollout.source=agent", "agent.processes=1"],
        "tree": ["rollout.source=tree"]}
_FREE = {("rollout", "source"), ("run_dir",), ("agent", "processes")}


def _overrides(arm: str, seed: int, run_dir: Path, steps: int | None, extra: list[str]) -> list[str]:
    out = [*ARMS[arm], f"seed={seed}", f"env.seed={seed}", f"run_dir={run_dir}", "progress=false",
           "export_final=false", "plots=false", *extra]
    return out + ([f"steps={steps}"] if steps is not None else [])


def _run(arm: str, seed: int, out: Path, steps: int | None, extra: list[str], config: Path = CONFIG) -> dict:
    from jaxprm.train.rundir import read_metrics

    run_dir = out / f"{arm}-s{seed}"
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    reused = (run_dir / "summary.json").is_file()
    if not reused:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        proc = subprocess.run([sys.executable, "-m", "jaxprm.train", "--config", str(config),
                               *_overrides(arm, seed, run_dir, steps, extra)], capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{arm} seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    rows = read_metrics(run_dir / "metrics.jsonl")
    ev = [r for r in rows if r["kind"] == "eval"]
    tr = [r for r in rows if r["kind"] == "train"]
    mean = lambda k: float(np.mean([r[k] for r in tr if r.get(k) is not None])) if tr else None  # noqa: E731
    res = {
        "arm": arm, "seed": seed, "run_dir": str(run_dir), "reused": reused, "wall_s": wall,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "steps": [r["step"] for r in ev], "success": [r["success"] for r in ev],
        "pass_at_4": [r.get("pass_at_4") for r in ev], "greedy": [r.get("greedy_success") for r in ev],
        "train_success": [r.get("success") for r in tr], "train_success_mean": mean("success"),
        "behavior_kl_mean": mean("behavior_kl"), "invalid_rate_mean": mean("invalid_rate"),
        "rollout_s": float(sum(r.get("rollout_s", 0) for r in tr)),
        "sampled_actions": int(sum(r.get("sampled_actions", 0) for r in tr)),
        "generated_tokens": int(sum(r.get("generated_tokens", 0) for r in tr)),
        "masked_turns": int(sum(r.get("masked_turns", 0) for r in tr)),
        "agent_failed_groups": int(sum(r.get("agent_failed_groups", 0) for r in tr)),
    }
    print(f"  {arm:<5} seed {seed}: {wall:5.0f} s{' (reused)' if reused else ''}  held-out success "
          + " ".join(f"@{s}={v:.3f}" for s, v in zip(res["steps"], res["success"])), flush=True)
    return res


def _flatten(d: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not (prefix == ("agent",) and k == "kwargs"):
            out.update(_flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def check_same_settings(a: Path, b: Path) -> list[str]:
    """Keys (dotted) whose resolved values differ between two runs' ``config.yaml``, other than
    ``rollout.source`` and ``run_dir``."""
    import yaml

    fa, fb = (_flatten(yaml.safe_load((p / "config.yaml").read_text())) for p in (a, b))
    return [".".join(k) for k in sorted(set(fa) | set(fb)) if k not in _FREE and fa.get(k) != fb.get(k)]


def _summary(runs: list[dict], arms: list[str]) -> dict:
    out: dict = {}
    for arm in arms:
        rs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        n = min(len(r["success"]) for r in rs)
        succ = np.array([r["success"][:n] for r in rs])
        gain = succ[:, -1] - succ[:, 0]
        ddof = 1 if len(rs) > 1 else 0  # the sample std over seeds (0 for one seed)
        out[arm] = {"seeds": [r["seed"] for r in rs], "steps": rs[0]["steps"][:n],
                    "mean": succ.mean(0).tolist(), "std": succ.std(0, ddof=ddof).tolist(),
                    "first_mean": float(succ[:, 0].mean()), "last_mean": float(succ[:, -1].mean()),
                    "last_std": float(succ[:, -1].std(ddof=ddof)), "gain": gain.tolist(), "gain_mean": float(gain.mean()),
                    "gain_std": float(gain.std(ddof=ddof)),
                    "train_success_mean": float(np.mean([r["train_success_mean"] for r in rs])),
                    "sampled_actions_mean": float(np.mean([r["sampled_actions"] for r in rs])),
                    "generated_tokens_mean": float(np.mean([r["generated_tokens"] for r in rs]))}
    by = {(r["arm"], r["seed"]): r for r in runs}
    for arm in ("agent", "agent_processes"):  # each agent arm against the tree path, seed by seed
        if not {arm, "tree"} <= set(out):
            continue
        seeds = [s for s in out[arm]["seeds"] if ("tree", s) in by]
        d = np.array([by[arm, s]["success"][-1] - by["tree", s]["success"][-1] for s in seeds])
        suffix = "" if arm == "agent" else f"_{arm}"
        out[f"{arm}_minus_tree"] = {"seeds": seeds, "last": d.tolist(), "mean": float(d.mean()),
                                    "std": float(d.std(ddof=1 if len(d) > 1 else 0))}
        ratio = [by[arm, s]["rollout_s"] / max(by["tree", s]["rollout_s"], 1e-9) for s in seeds]
        out["rollout_time_ratio" + suffix] = {
            "seeds": seeds, "agent_s": [by[arm, s]["rollout_s"] for s in seeds],
            "tree_s": [by["tree", s]["rollout_s"] for s in seeds], "agent_over_tree": ratio,
            "same_generated_tokens": [by[arm, s]["generated_tokens"] == by["tree", s]["generated_tokens"] for s in seeds],
            "goal": "agent / tree <= 1.5 (issue 40)"}
    return out


def _print_summary(summary: dict, runs: list[dict], arms: list[str]) -> None:
    print("\nheld-out sampled success (eval.num_tasks maps x eval.samples samples: 64 x 4 by default)")
    steps = summary[arms[0]]["steps"]
    print(f"{'arm':<6} {'seed':>5} " + " ".join(f"{'@' + str(s):>7}" for s in steps) + f" {'gain':>7}")
    for arm in arms:
        for r in sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"]):
            print(f"{arm:<6} {r['seed']:>5} " + " ".join(f"{v:>7.3f}" for v in r["success"][:len(steps)])
                  + f" {r['success'][len(steps) - 1] - r['success'][0]:>+7.3f}")
        s = summary[arm]
        print(f"{arm:<6} {'mean':>5} " + " ".join(f"{v:>7.3f}" for v in s["mean"]) + f" {s['gain_mean']:>+7.3f}")
        print(f"{arm:<6} {'std':>5} " + " ".join(f"{v:>7.3f}" for v in s["std"]) + f" {s['gain_std']:>7.3f}")
    for arm in ("agent", "agent_processes"):
        suffix = "" if arm == "agent" else f"_{arm}"
        if f"{arm}_minus_tree" not in summary:
            continue
        d = summary[f"{arm}_minus_tree"]
        print(f"{arm} - tree at the last eval, per seed: {', '.join(f'{x:+.3f}' for x in d['last'])}; "
              f"mean {d['mean']:+.3f} ± {d['std']:.3f}")
        t = summary["rollout_time_ratio" + suffix]
        print(f"rollout seconds {arm} / tree, per seed: " + ", ".join(
            f"{a:.1f} / {b:.1f} = {r:.2f}x" for a, b, r in zip(t["agent_s"], t["tree_s"], t["agent_over_tree"]))
            + f" (same generated tokens: {all(t['same_generated_tokens'])}; goal <= 1.5x)")
    for arm in arms:
        s = summary[arm]
        print(f"{arm:<6} train success {s['train_success_mean']:.3f}, sampled actions {s['sampled_actions_mean']:.0f}, "
              f"generated tokens {s['generated_tokens_mean']:.0f} (means over seeds)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_learning", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--arms", nargs="+", default=["agent", "tree"], choices=list(ARMS))
    p.add_argument("--config", type=Path, default=CONFIG, help="the trainer config both arms run (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_proxy_learning")
    p.add_argument("--json", default=None, help="default: benchmarks/results/proxy_learning_<device>.json")
    p.add_argument("overrides", nargs="*", help="key.sub=value for both arms")
    args = p.parse_args(argv)
    args.json = args.json or result_path("proxy_learning")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = args.config.resolve()
    if not config.is_file():
        p.error(f"--config {args.config}: no such file")
    meta = {"config_file": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
            "overrides": args.overrides, "steps": args.steps}
    runs: list[dict] = []
    for seed in args.seeds:  # the arms of a seed back to back, so machine load affects both alike
        for arm in args.arms:
            runs.append(_run(arm, seed, out, args.steps, args.overrides, config))
            write_result(args.json, {**meta, "runs": runs})  # after every run: an interrupted benchmark keeps them
        for arm in args.arms[1:]:  # every arm runs the first arm's settings but for what ARMS changes
            diff = check_same_settings(out / f"{args.arms[0]}-s{seed}", out / f"{arm}-s{seed}")
            if diff:
                raise SystemExit(f"seed {seed}: the arms' resolved configs differ at {diff}")
    summary = _summary(runs, args.arms)
    _print_summary(summary, runs, args.arms)
    write_result(args.json, {**meta, "runs": runs, "summary": summary})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
