"""The main job's learning over seeds: the README default and recipe variants, 3+ seeds each.

    python -m benchmarks.recipe [--seeds 0 1 2] [--parallel 3] [--out runs/bench_recipe]
                                [--config configs/sokoban.yaml]
                                [--variant NAME=key.sub=value,key.sub=value ...] [--json PATH]

Each run is ``python -m jaxprm.train [--config PATH] seed=S`` plus the variant's overrides
(``default`` has none: the README command, or the ``--config`` file's recipe), in its own
process, ``--parallel`` at a time; a run whose ``summary.json`` exists is reused and one cut off
after a checkpoint is ``--resume``d (so the benchmark resumes across interrupted sessions), after
checking that its recorded ``config.yaml`` is the one the variant asks for. A run's output goes to
``OUT/VARIANT/sSEED.log``; a failed run is reported when it ends, the others go on, and the
command then exits non-zero naming it. Runs share one warm-start and compile cache
(``$HOME/.cache/jaxprm``), so only the first run of a seed pays its warm start; learning does not
depend on timing except through the sampler's dynamic batching (two runs of one seed agree for ~15
steps, then drift). ``benchmarks.keep_runs`` keeps finished runs for a later session.

Prints, per variant and seed, held-out sampled success at each eval, its gain, greedy success and
pass@k first -> last and the largest train-step invalid-answer rate; then the gain's mean ± sample
std over seeds. Per eval it also keeps what the environment's states give (steps over optimal;
Sokoban's dead-state rate). Writes the same as JSON (``--json``, default ``OUT/results.json``),
with the commit, command and machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from benchmarks._harness import has_checkpoint, train_process

_RUN_KEYS = ("run_dir", "progress", "plots", "export_final", "seed")


def _parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    if not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=key=value,key=value (or NAME= for none)")
    return name, [o for o in rest.split(",") if o]


def _overrides(run_dir: Path, seed: int, extra: list[str]) -> list[str]:
    return [f"seed={seed}", f"run_dir={run_dir}", "progress=false", "plots=false", "export_final=false", *extra]


def _check_recorded(run_dir: Path, overrides: list[str], config: str | None) -> None:
    """A reused run must have been made with this variant's config (up to the run keys); keys its
    ``config.yaml`` lacks were added after it was made and are noted, not failed."""
    from jaxprm.train.config import load_config, to_dict
    from jaxprm.train.resume import changed_keys

    got = yaml.safe_load((run_dir / "config.yaml").read_text())

    def recorded(key: str) -> bool:
        node = got
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    changed = [k for k, _, _ in changed_keys(got, to_dict(load_config(config, overrides)))
               if k not in _RUN_KEYS]
    diff = [k for k in changed if recorded(k)]
    if diff:
        raise SystemExit(f"{run_dir}: recorded config differs from the variant's in {diff}; remove it to rerun")
    if changed:
        print(f"  note: {run_dir} predates {changed} (reused)", flush=True)


def _run(run_dir: Path, seed: int, extra: list[str], config: str | None = None) -> float:
    overrides = _overrides(run_dir, seed, extra)
    if (run_dir / "summary.json").is_file():
        _check_recorded(run_dir, overrides, config)
        return 0.0
    args = [*(["--config", config] if config else []), *overrides]
    if has_checkpoint(run_dir):  # an unfinished run of this variant: resumed (bitwise the run it would have been)
        _check_recorded(run_dir, overrides, config)
        print(f"  resuming {run_dir}", flush=True)
        args = ["--resume", str(run_dir)]
    elif run_dir.exists():  # cut off before its first checkpoint: started again (the trainer would pick a new directory)
        shutil.rmtree(run_dir)
    return train_process(args, run_dir.with_name(run_dir.name + ".log"))  # beside the run: the trainer owns run_dir


_PHASES = ("rollout_s", "score_s", "learn_s", "sync_s", "compile_s", "step_s")


def summarize(run_dir: Path) -> dict:
    """Eval curve, gain and the diagnostics of one finished run."""
    from jaxprm.train.rundir import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    ev = [r for r in rows if r["kind"] == "eval"]
    tr = [r for r in rows if r["kind"] == "train"]
    pk = next((k for k in ev[0] if k.startswith("pass_at_")), None)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "eval_steps": [r["step"] for r in ev],
        "success": [r["success"] for r in ev],
        "gain_points": 100 * (ev[-1]["success"] - ev[0]["success"]),
        "greedy": [r.get("greedy_success") for r in ev],
        "dead_rate": [r.get("dead_rate") for r in ev],
        "greedy_dead_rate": [r.get("greedy_dead_rate") for r in ev],
        "steps_over_optimal": [r.get("steps_over_optimal") for r in ev],
        "greedy_steps_over_optimal": [r.get("greedy_steps_over_optimal") for r in ev],
        "pass_at_k": [r.get(pk) for r in ev],
        "invalid_rate": [r.get("invalid_rate") for r in ev],
        "max_invalid_rate": max((r.get("invalid_rate", 0.0) for r in tr), default=0.0),
        "entropy": [r.get("entropy") for r in tr],
        "approx_kl_max": max((r.get("approx_kl", 0.0) for r in tr), default=0.0),
        # where a train step's time went, mean over the steps (phases a run did not have are left out)
        "seconds_per_step": {k.removesuffix("_s"): statistics.mean(r[k] for r in tr) for k in _PHASES
                             if tr and all(k in r for r in tr)},
        "wall_s": summary.get("wall_s"),
    }


_TABLE_METRICS = (("success", "sampled success"), ("greedy", "greedy success"), ("dead_rate", "dead-state rate"),
                  ("steps_over_optimal", "steps over optimal (solved)"), ("invalid_rate", "invalid answers"))


def markdown_table(variant: dict) -> str:
    """One variant's held-out metrics at each eval step, mean ± sample std over its seeds (a
    metric an environment does not record is left out)."""
    seeds = list(variant["seeds"].values())
    steps = seeds[0]["eval_steps"]
    metrics = [(k, label) for k, label in _TABLE_METRICS if any(x is not None for x in seeds[0].get(k, []))]
    lines = ["| step | " + " | ".join(label for _, label in metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for i, step in enumerate(steps):
        cells = []
        for key, _ in metrics:
            vals = [r[key][i] for r in seeds if r.get(key) and r[key][i] is not None]
            if not vals:
                cells.append("-")
                continue
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.3f} ± {sd:.3f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recipe", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value (default: default=)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (they share the cores)")
    p.add_argument("--out", default="runs/bench_recipe")
    p.add_argument("--json", default=None)
    p.add_argument("--config", default=None, help="the trainer's --config (default: the embedded default)")
    p.add_argument("--report", default=None, metavar="JSON", help="print the tables of a results JSON and exit")
    args = p.parse_args(argv)
    if args.report:
        data = json.loads(Path(args.report).read_text())
        for name, variant in data["variants"].items():
            print(f"{name} ({len(variant['seeds'])} seeds; {data.get('command', '')}; commit {data.get('commit')})\n")
            print(markdown_table(variant) + "\n")
        return 0
    variants = dict(_parse_variant(v) for v in (args.variant or ["default="]))
    out = Path(args.out)
    jobs = [(name, seed) for name in variants for seed in args.seeds]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        futs = {job: pool.submit(_run, out / job[0] / f"s{job[1]}", job[1], variants[job[0]], args.config)
                for job in jobs}
        failed = []
        for (name, seed), f in futs.items():
            try:
                secs = f.result()
            except RuntimeError as e:  # reported now; the other runs go on
                print(f"  {name} seed {seed}: {e}", file=sys.stderr, flush=True)
                failed.append(f"{name} seed {seed}")
                continue
            if secs:
                print(f"  {name} seed {seed}: {secs:.0f}s", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}; rerun the same command to retry "
                         "them (finished runs are reused)")

    results: dict[str, dict] = {}
    print(f"\n{'variant':<12}{'seed':>5}  {'held-out sampled success per eval':<36}{'gain':>7}"
          f"{'greedy':>15}{'pass@k':>15}{'max inv':>9}")
    for name, extra in variants.items():
        runs = {seed: summarize(out / name / f"s{seed}") for seed in args.seeds}
        for seed, r in runs.items():
            curve = " ".join(f"{x:.3f}" for x in r["success"])
            print(f"{name:<12}{seed:>5}  {curve:<36}{r['gain_points']:>+7.1f}"
                  f"{r['greedy'][0]:>8.3f}>{r['greedy'][-1]:.3f}{r['pass_at_k'][0]:>8.3f}>{r['pass_at_k'][-1]:.3f}"
                  f"{r['max_invalid_rate']:>9.2f}")
        gains = [r["gain_points"] for r in runs.values()]
        mean, sd = statistics.mean(gains), statistics.stdev(gains) if len(gains) > 1 else 0.0
        print(f"{'':<12}{'all':>5}  gain {mean:+.1f} ± {sd:.1f} (sample std) points (min {min(gains):+.1f}), "
              f"greedy fell on {sum(r['greedy'][-1] < r['greedy'][0] for r in runs.values())} of {len(runs)}")
        print(markdown_table({"seeds": runs}))
        results[name] = {"overrides": extra, "seeds": {str(s): r for s, r in runs.items()},
                         "gain_mean": mean, "gain_std": sd, "gain_min": min(gains)}
    path = Path(args.json) if args.json else out / "results.json"
    from benchmarks.provenance import write_result

    write_result(path, {"config_file": args.config, "seeds": args.seeds, "variants": results, "std": "sample"})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
