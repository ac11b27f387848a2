"""The paper's comparison on this machine: GRPO, DAPO, ARPO, Tree-Random and PaTR on FrozenLake at an
equal sampling cost, and the tree-credit estimators (``advantage.estimator``).

    python -m benchmarks.frozenlake [--seeds 0 1 2] [--steps N] [--variants grpo patr patr_tree_value ...]
        [--budget total|tokens|trajectories] [--token-budget N] [--jobs J] [--out DIR] [key.sub=value ...]

Every run is ``python -m jaxprm.train --config configs/<variant>.yaml`` on the embedded default
(same warm start per seed, same tasks, same learner: clip-higher and the token-level loss for every
row); only the rollout strategy (and, for the ``*_tree_value`` / ``*_sibling`` / ``*_anchor`` rows,
``advantage.estimator``) changes. ``--budget total`` (default) enforces equal cost: every run stops
at the step where its train rollouts have sampled ``token_budget`` tokens (measured once: flat
GRPO's tokens over the config's steps, seed 0, under ``OUT/anchor``; recorded in ``results.json``)
and is evaluated at 1/6, 2/6, ..., 6/6 of it (and at step 0), so ``success.png`` is success against
cumulative sampled tokens; every variant is then compared with flat GRPO paired by seed
(``benchmarks.paired``: mean difference, 95% t CI, Wilcoxon p). ``--budget tokens`` equalises the
*sampled tokens per step*, the budget that costs generation compute: a one-step pilot of each variant (seed 0, the
warm-started policy) measures its generated tokens per task, and each variant then rolls out
``round(16 * flat's tokens per task / its own)`` tasks a step (flat GRPO keeps 16). ``--budget
trajectories`` keeps 16 tasks of 8 trajectories for all (the older protocol). The table reports
what each run actually spent (tokens, trajectories and actions per step), since a policy's lengths
change as it learns. DAPO's refill rounds would spend more as the policy improves (all-success
groups multiply), so under ``--budget tokens`` they stop at flat GRPO's pilot tokens per step
(``rollout.dapo.max_tokens_per_step``).

Columns (held-out maps, the run's last evaluation, mean ± std over seeds): success (mean over 4
samples per map), pass@4, response tokens per trajectory, turns, greedy success, and the gain of
success over the run's step-0 evaluation; then the mechanism, per training step: mixed groups (the
share of rolled-out groups with both a success and a failure, the only ones GRPO learns from) and
branches expanded / pruned at checkpoints. Writes ``results.json`` (every run's curve),
``table.md``, ``summary.json`` (the table's numbers, with the provenance) and ``success.png`` (success over steps with seed bands) under
``--out``. Finished runs are reused (delete a run directory to redo it); an interrupted run is
resumed from its last checkpoint (started again if it had none); ``--keep V ...`` takes those variants' rows from ``OUT/results.json`` of an earlier run
instead of running them. ``--jobs`` runs that many trainings at once (default: one per 2 cores),
seed by seed (every variant of a seed before the next seed, so an interrupted comparison holds whole
pairs); ``--few V ...`` runs those (secondary) variants on the first 3 seeds only. Pairs are matched
by seed, std is the sample std (ddof=1).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np

from benchmarks._harness import has_checkpoint, train_process

ROOT = Path(__file__).resolve().parents[1]

#: variant -> the config it runs (configs/<name>.yaml over the embedded default)
VARIANTS = {
    "grpo": "configs/flat_grpo.yaml",
    "dapo": "configs/dapo.yaml",
    "arpo": "configs/arpo.yaml",
    "tree_random": "configs/tree_random.yaml",
    "patr": "configs/patr.yaml",
    "patr_paper": "configs/patr_paper.yaml",
    # the tree-credit rows (advantage.estimator; jaxprm.learner.tree_credit)
    "grpo_anchor": "configs/flat_grpo.yaml",
    "patr_tree_value": "configs/patr.yaml",
    "patr_sibling": "configs/patr.yaml",
    "patr_anchor": "configs/patr.yaml",
}
#: what a variant adds to its config (the paper's arms are GRPO on leaves whatever the trainer's
#: default estimator)
VARIANT_OVERRIDES = {
    **{v: ["advantage.estimator=leaf_grpo"] for v in ("grpo", "dapo", "arpo", "tree_random", "patr", "patr_paper")},
    "grpo_anchor": ["advantage.estimator=anchor_state"],
    "patr_tree_value": ["advantage.estimator=tree_value"],
    "patr_sibling": ["advantage.estimator=sibling"],
    "patr_anchor": ["advantage.estimator=anchor_state"],
}
#: --budget total: evaluations at these fractions of the token budget (and at step 0)
TOKEN_FRACTIONS = (1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0)
BASE_TASKS = 16  # the default's tasks per step: the flat GRPO row's budget

#: the paper's Table 1 (FrozenLake, Qwen2.5-0.5B-Instruct): success, pass@4, response length, turns
PAPER = {
    "grpo": (66.5, 67.0, 513, 3.4), "dapo": (71.0, 71.0, 562, 4.2), "arpo": (69.7, 72.0, 377, 3.3),
    "tree_random": (56.3, 63.0, 400, 3.9), "patr": (75.8, 78.0, 344, 3.6),
}


def _train(config: str, run_dir: Path, overrides: list[str], log: Path) -> float:
    """One training in its own process (``train_process``), its output in ``log``; its seconds."""
    return train_process(["--config", str(ROOT / config), f"run_dir={run_dir}", "progress=false", "export_final=false",
                   *overrides], log, cwd=ROOT)


def _rows(run_dir: Path) -> list[dict]:
    from jaxprm.train.rundir import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _finished(run_dir: Path) -> bool:
    return (run_dir / "summary.json").is_file()


def _fresh(run_dir: Path) -> None:
    if run_dir.exists():
        shutil.rmtree(run_dir)


def pilot_tokens(variant: str, out: Path, extra: list[str]) -> float:
    """Generated tokens per requested task in one step of ``variant`` from the warm-started policy
    (seed 0; dynamic sampling's extra rounds included)."""
    run_dir = out / "pilot" / variant
    if not _finished(run_dir):
        _fresh(run_dir)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        _train(VARIANTS[variant], run_dir, ["seed=0", "env.seed=0", "steps=1", "eval.at_start=false",
                                            "eval.num_tasks=1", "eval.samples=1", "eval.greedy=false",
                                            f"rollout.tasks_per_step={BASE_TASKS}",
                                            *VARIANT_OVERRIDES.get(variant, []), *extra],
               run_dir.parent / f"{variant}.log")
    row = next(r for r in _rows(run_dir) if r["kind"] == "train")
    return row["generated_tokens"] / BASE_TASKS


def anchor_budget(out: Path, steps: int | None, extra: list[str]) -> int:
    """``--budget total``'s budget, measured once: the tokens flat GRPO samples in a run of the
    config's steps (seed 0, the warm-started policy; a cheap eval), reused from ``OUT/anchor``."""
    run_dir = out / "anchor" / "grpo"
    if not _finished(run_dir):
        _fresh(run_dir)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        _train(VARIANTS["grpo"], run_dir, ["seed=0", "env.seed=0", "eval.at_start=false", "eval.num_tasks=1",
                                           "eval.samples=1", "eval.greedy=false", f"rollout.tasks_per_step={BASE_TASKS}",
                                           *([f"steps={steps}"] if steps is not None else []),
                                           *VARIANT_OVERRIDES["grpo"], *extra],
               run_dir.parent / "grpo.log")
    return int(sum(r["generated_tokens"] for r in _rows(run_dir) if r["kind"] == "train"))


def paired_against(results: dict[str, list[dict]], base: str = "grpo") -> dict[str, dict]:
    """Each variant against ``base``, paired by seed, on the final held-out success in points and
    on the gain over step 0 (``benchmarks.paired``)."""
    from benchmarks.paired import paired_comparison

    def by_seed(runs: list[dict]) -> dict[int, dict]:  # runs of older results carry no seed: their index
        return {r.get("seed", i): r for i, r in enumerate(runs)}

    out = {}
    base_runs = by_seed(results.get(base, []))
    for v, runs in results.items():
        mine = by_seed(runs)
        seeds = sorted(set(mine) & set(base_runs))
        if v == base or len(seeds) < 2:
            continue
        pairs = [(mine[s], base_runs[s]) for s in seeds]
        final = [100 * a["success"][-1] for a, _ in pairs], [100 * b["success"][-1] for _, b in pairs]
        gain = ([100 * (a["success"][-1] - a["success"][0]) for a, _ in pairs],
                [100 * (b["success"][-1] - b["success"][0]) for _, b in pairs])
        # pairs whose warm starts are known to differ (both digests recorded): a float-level difference
        # in the SFT, e.g. a cache made by other code, makes a seed's arms start apart
        apart = [s for s, (a, b) in zip(seeds, pairs) if a.get("warm_start_sha256") and b.get("warm_start_sha256")
                 and a["warm_start_sha256"] != b["warm_start_sha256"]]
        out[v] = {"seeds": seeds, "final_success": paired_comparison(*final), "gain": paired_comparison(*gain),
                  "warm_start_differs": apart}
    return out


def tasks_per_step(pilots: dict[str, float]) -> dict[str, int]:
    """Tasks per step that give every variant flat GRPO's sampled tokens per step."""
    flat = pilots["grpo"]
    return {v: max(1, round(BASE_TASKS * flat / t)) for v, t in pilots.items()}


def run_one(variant: str, seed: int, tasks: int, out: Path, steps: int | None, extra: list[str]) -> dict:
    """One seed of one variant (reused when finished): its eval curve and what it spent."""
    run_dir = out / f"{variant}-s{seed}"
    if not _finished(run_dir) and has_checkpoint(run_dir):  # cut off after a checkpoint: resumed (bitwise exact)
        secs = train_process(["--resume", str(run_dir)], out / f"{variant}-s{seed}.log", cwd=ROOT)
        print(f"  {variant} seed {seed}: resumed, {secs:.0f}s", flush=True)
    if not _finished(run_dir):
        _fresh(run_dir)
        overrides = [f"seed={seed}", f"env.seed={seed}", f"rollout.tasks_per_step={tasks}",
                     *VARIANT_OVERRIDES.get(variant, []), *extra]
        if steps is not None:
            overrides.append(f"steps={steps}")
        secs = _train(VARIANTS[variant], run_dir, overrides, out / f"{variant}-s{seed}.log")
        print(f"  {variant} seed {seed}: {secs:.0f}s", flush=True)
    rows = _rows(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    ev = [r for r in rows if r["kind"] == "eval"]
    tr = [r for r in rows if r["kind"] == "train"]
    mean = lambda key: float(np.mean([r.get(key, 0) for r in tr])) if tr else 0.0  # noqa: E731
    return {
        "seed": seed,
        "tasks_per_step": tasks,
        "steps": [r["step"] for r in ev],
        "sampled_tokens": [r.get("sampled_tokens") for r in ev],
        "success": [r["success"] for r in ev],
        "pass_at_4": [r.get("pass_at_4") for r in ev],
        "greedy": [r.get("greedy_success") for r in ev],
        "response_tokens": [r.get("response_tokens") for r in ev],
        "turns": [r.get("turns") for r in ev],
        "dead_rate": [r.get("dead_rate") for r in ev],  # Sokoban's: episodes that end in a dead state
        "tokens_per_step": mean("generated_tokens"),
        "trajectories_per_step": mean("trajectories"),
        "actions_per_step": mean("sampled_actions"),
        "groups_with_success": mean("groups_with_success"),
        "mixed_groups": mean("mixed_groups"),
        "expanded_per_step": mean("expanded"),
        "pruned_per_step": mean("pruned"),
        "checkpoints_per_step": mean("checkpoints"),
        "dynamic_dropped_per_step": mean("dynamic_dropped_groups"),
        "wall_s": summary.get("wall_s"),
        # the warm-started parameters' digest: the pairs of a seed must start from the same ones
        "warm_start_sha256": (summary.get("warm_start") or {}).get("params_sha256"),
    }


def _ms(values) -> tuple[float, float]:
    """Mean and sample std (ddof=1; 0 for one value) of the values that are not None."""
    a = np.asarray([v for v in values if v is not None], float)
    if not a.size:
        return math.nan, math.nan
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: the last evaluation's columns (mean, std over seeds), the gain over step 0, the
    per-seed values and the spending per step."""
    out = {}
    for variant, runs in results.items():
        last = lambda key: [(r.get(key) or [None])[-1] for r in runs]  # noqa: E731
        gain = [r["success"][-1] - r["success"][0] for r in runs]
        out[variant] = {
            "seeds": len(runs),
            "success": _ms(last("success")), "pass_at_4": _ms(last("pass_at_4")), "greedy": _ms(last("greedy")),
            "response_tokens": _ms(last("response_tokens")), "turns": _ms(last("turns")), "gain": _ms(gain),
            "dead_rate": _ms(last("dead_rate")),
            "success_per_seed": last("success"), "gain_per_seed": gain,
            "curve_mean": float(np.mean([np.mean(r["success"]) for r in runs])),
            **{k: float(np.mean([r.get(k, math.nan) for r in runs])) for k in (  # nan: an older run lacks it
                "tasks_per_step", "tokens_per_step", "trajectories_per_step", "actions_per_step",
                "groups_with_success", "mixed_groups", "expanded_per_step", "pruned_per_step", "checkpoints_per_step",
                "dynamic_dropped_per_step")},
        }
    return out


def table(summary: dict[str, dict], title: str, *, paper: bool = True) -> str:
    """The markdown table: ours (percent, mean ± std over seeds) beside the paper's numbers
    (``paper``: FrozenLake only); a dead-state column where the environment records one (Sokoban)."""
    pct = lambda m: f"{100 * m[0]:.1f} ± {100 * m[1]:.1f}"  # noqa: E731
    dead = any(not math.isnan(s.get("dead_rate", (math.nan,))[0]) for s in summary.values())
    head = ["method", "success", "pass@4", "resp. tokens", "turns", "greedy", "gain", *(["dead states"] if dead else []),
            "tasks/step", "tokens/step", "traj./step", "actions/step", "mixed groups", "expanded / pruned per step",
            *(["paper succ. / pass@4 / RLen / turns"] if paper else [])]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for v, s in summary.items():
        ref = " / ".join(str(x) for x in PAPER[v]) if v in PAPER else "—"
        cells = [f"{v} ({s['seeds']} seeds)", pct(s["success"]), pct(s["pass_at_4"]), f"{s['response_tokens'][0]:.1f}",
                 f"{s['turns'][0]:.2f}", pct(s["greedy"]), f"{100 * s['gain'][0]:+.1f} ± {100 * s['gain'][1]:.1f}",
                 *([pct(s["dead_rate"])] if dead else []),
                 f"{s['tasks_per_step']:.0f}", f"{s['tokens_per_step']:.0f}", f"{s['trajectories_per_step']:.0f}",
                 f"{s['actions_per_step']:.0f}", f"{100 * s['mixed_groups']:.0f}%",
                 f"{s['expanded_per_step']:.1f} / {s['pruned_per_step']:.1f}", *([ref] if paper else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path, title: str, budget: int | None = None) -> None:
    """Held-out success, mean over seeds with a band of one sample std, against the training step,
    or (``budget``: ``--budget total``) against cumulative sampled tokens at each evaluation's
    nominal fraction of the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, runs in results.items():
        n = min(len(r["success"]) for r in runs)
        xs = runs[0]["steps"] if budget is None else [0.0, *[f * budget for f in TOKEN_FRACTIONS]]
        n = min(n, len(xs))
        succ = np.array([r["success"][:n] for r in runs])
        sd = succ.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
        ax.plot(xs[:n], succ.mean(0), marker="o", label=f"{variant} ({len(runs)})")
        ax.fill_between(xs[:n], succ.mean(0) - sd, succ.mean(0) + sd, alpha=0.12)
    xlabel = "training step" if budget is None else "sampled tokens (train rollouts)"
    ax.set(xlabel=xlabel, ylabel="held-out sampled success", ylim=(0, 1))
    ax.set_title("\n".join(textwrap.wrap(title, 72)), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.frozenlake", description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the config's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--budget", choices=("total", "tokens", "trajectories"), default="total",
                   help="total (default): every run samples the same cumulative tokens (token_budget) and is "
                        "evaluated at the same fractions of it; tokens: equal tokens per step (a pilot sets "
                        "tasks per step); trajectories: 16 tasks of 8 trajectories")
    p.add_argument("--token-budget", type=int, default=None,
                   help="--budget total: the budget (default: flat GRPO's tokens over the config's steps, seed 0, "
                        "measured once under OUT/anchor and recorded)")
    p.add_argument("--few", nargs="+", default=[], choices=list(VARIANTS),
                   help="run these variants on the first 3 of --seeds only (the secondary rows)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--out", default="runs/bench_frozenlake")
    p.add_argument("--title", default=None, help="the table's title (default: the settings)")
    p.add_argument("--keep", nargs="+", default=[], choices=list(VARIANTS),
                   help="take these variants' rows from OUT/results.json (an earlier run of the same protocol) "
                        "instead of running them")
    p.add_argument("overrides", nargs="*", help="extra key.sub=value overrides for every run (e.g. env.size=6)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # runs go in the order given (flat GRPO, the budget's anchor, is added last when not named); the
    # table keeps the VARIANTS order
    variants = list(dict.fromkeys([*args.variants, *args.keep, *(["grpo"] if args.budget != "trajectories" else [])]))

    earlier = json.loads((out / "results.json").read_text()) if args.keep else None
    if args.budget == "tokens":
        print("pilot: generated tokens per task of each variant's first step (seed 0)", flush=True)
        pilots = {v: earlier["pilot_tokens_per_task"][v] if v in args.keep else pilot_tokens(v, out, args.overrides)
                  for v in variants}
        tasks = tasks_per_step(pilots)
        for v in variants:
            print(f"  {v:<12} {pilots[v]:7.1f} tokens/task -> {tasks[v]} tasks/step", flush=True)
    else:
        pilots, tasks = {}, dict.fromkeys(variants, BASE_TASKS)
    budget = None
    per_variant = {v: [] for v in variants}
    if args.budget == "total":
        budget = args.token_budget or (earlier or {}).get("token_budget") or anchor_budget(out, args.steps, args.overrides)
        cap = 4 * (args.steps or 30)
        print(f"token budget: {budget} sampled tokens a run (evaluated at {len(TOKEN_FRACTIONS)} fractions; "
              f"at most {cap} steps)", flush=True)
        fractions = "[" + ", ".join(f"{f:.6f}" for f in TOKEN_FRACTIONS) + "]"
        per_variant = {v: [f"token_budget={budget}", f"eval.token_fractions={fractions}"] for v in variants}
        args.steps = cap
    if args.budget == "tokens" and "dapo" in per_variant:  # its refill rounds stop at flat GRPO's tokens per step
        per_variant["dapo"] = [f"rollout.dapo.max_tokens_per_step={round(BASE_TASKS * pilots['grpo'])}"]
    # seed-major, so that an interrupted comparison holds whole pairs; --few rows stop at 3 seeds
    jobs = [(v, s) for i, s in enumerate(args.seeds) for v in variants
            if v not in args.keep and not (v in args.few and i >= 3)]
    results: dict[str, list[dict]] = {v: [None] * len(args.seeds) for v in variants}
    for v in args.keep:  # these rows as an earlier run of the same protocol measured them
        results[v] = earlier["runs"][v]
    print(f"{len(jobs)} runs, {args.jobs} at a time", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(run_one, v, s, tasks[v], out, args.steps, [*args.overrides, *per_variant[v]]): (v, i)
                   for v, s in jobs for i in [args.seeds.index(s)]}
        for fut in concurrent.futures.as_completed(futures):
            v, i = futures[fut]
            results[v][i] = fut.result()

    results = {v: [r for r in results[v] if r is not None] for v in VARIANTS if v in results}
    summary = summarize(results)
    what = f"equal {args.budget} per step" if args.budget != "total" else f"equal sampled tokens ({budget} a run)"
    env = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("env.name=")), "frozenlake")
    title = args.title or f"{env} {' '.join(args.overrides) or 'default'}, {len(args.seeds)} seeds, {what}"
    md = table(summary, title, paper=env == "frozenlake")  # the paper's numbers are FrozenLake's
    paired = paired_against(results)
    if paired:
        from benchmarks.paired import format_comparison

        md += "\n\nPaired by seed against grpo (points; " + "sample std, 95% t CI, Wilcoxon signed-rank):\n\n" + "\n".join(
            f"- {format_comparison(v + ' final success', c['final_success'])}; "
            f"{format_comparison('gain', c['gain'])}"
            + (f" (the warm start differs from grpo's on seed(s) {c['warm_start_differs']})"
               if c.get("warm_start_differs") else "") for v, c in paired.items())
    print("\n" + md)
    from benchmarks.provenance import provenance

    now = provenance()
    keys = ("commit", "dirty", "command", "machine", "date")
    # each arm's own provenance: a kept arm keeps the one it was run under (its JSON's, or the arm's
    # entry there when that JSON had merged arms itself)
    arm_provenance = {v: ((earlier.get("arm_provenance") or {}).get(v) or {k: earlier.get(k) for k in keys})
                      if v in args.keep else {k: now[k] for k in keys} for v in results}
    (out / "results.json").write_text(json.dumps({**now, "arm_provenance": arm_provenance,
                                                  "budget": args.budget, "token_budget": budget,
                                                  "token_fractions": list(TOKEN_FRACTIONS) if budget else None,
                                                  "pilot_tokens_per_task": pilots,
                                                  "tasks_per_step": tasks, "overrides": args.overrides,
                                                  "variant_overrides": {v: [*VARIANT_OVERRIDES.get(v, []), *o]
                                                                        for v, o in per_variant.items()},
                                                  "paired_vs_grpo": paired, "runs": results}, indent=1))
    (out / "summary.json").write_text(json.dumps({**now, "variants": summary}, indent=1))
    (out / "table.md").write_text(md + "\n")
    plot(results, out / "success.png", title, budget)
    print(f"\nwrote {out}/results.json, summary.json, table.md, success.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
