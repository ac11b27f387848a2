"""Render the documentation's results from ``benchmarks/results/`` (no figure in the docs is typed).

    python -m benchmarks.report [--check] [--figures]

The README and the pages under ``docs/`` mark each generated block with an HTML comment pair::

    <!-- report:NAME -->
    ... (rewritten by this command) ...
    <!-- /report:NAME -->

(indented alike inside a list item, and the block is indented with them)
and :data:`BLOCKS` maps ``NAME`` to the function that renders it from the JSON it cites (each block
names its JSON and the commit that JSON records). The command also writes ``docs/index.md``, the
site's home page, from ``README.md`` (links into ``docs/`` made site-relative), and with
``--figures`` draws the figures the pages show (``docs/img/``) from their JSON. ``--check``
rewrites nothing and exits 1 if any file would change (``tests/test_report.py`` runs it).

Statistics, stated once: over seeds, ``mean ± std`` is the mean and the *sample* standard deviation
(``ddof=1``); paired comparisons are ``benchmarks.paired``'s.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^(?P<indent>[ ]*)<!-- report:(?P<name>[\w-]+) -->\n.*?^(?P=indent)<!-- /report:(?P=name) -->",
                   re.S | re.M)


def load(name: str) -> dict:
    """``benchmarks/results/NAME`` as a dict."""
    return json.loads((RESULTS / name).read_text())


@functools.cache
def _committed_at(name: str) -> str | None:
    """The short hash of the last commit that changed ``benchmarks/results/NAME``."""
    import subprocess

    # the last commit that added or changed its content (a rename is not a measurement)
    out = subprocess.run(["git", "log", "--follow", "--diff-filter=AM", "-1", "--format=%h", "--",
                          f"benchmarks/results/{name}"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or None


def source(name: str, data: dict | None = None) -> str:
    """``` `NAME` (commit abc1234) ``` for a JSON that records its commit; one whose run recorded
    none is labelled stale with the commit that added it (its ``added_in_commit``, stamped into the
    file, else git's answer): ``(stale: no commit recorded; added at abc1234)``."""
    data = load(name) if data is None else data
    commit = data.get("commit")
    if commit:
        return f"`{name}` (commit {commit[:7]})"
    added = (data.get("added_in_commit") or "")[:7] or _committed_at(name) or "an unknown commit"
    return f"`{name}` (stale: no commit recorded; added at {added})"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1; 0 for one value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _gains(variant: dict) -> list[float]:
    return [100 * (r["success"][-1] - r["success"][0]) for _, r in sorted(variant["seeds"].items())]


def _only_variant(recipe: dict) -> dict:
    """The one variant of a ``benchmarks.recipe`` JSON that ran one (its name is the run's)."""
    (variant,) = recipe["variants"].values()
    return variant


def _gain_text(gains: list[float]) -> str:
    m, s = mean_std(gains)
    return f"{' / '.join(f'{g:+.1f}' for g in gains)} points (mean **{m:+.1f} ± {s:.1f}**)"


# ------------------------------------------------------------------------------------------- blocks


def headline() -> str:
    """The README's one results table: a row per capability, each from its JSON."""
    rows = []
    recipe = load("recipe_cpu_default.json")
    gains = _gains(recipe["variants"]["default"])
    rows.append(("FrozenLake 4x4, `python -m jaxprm.train` (the default: flat GRPO + `anchor_state`, tiny policy, "
                 f"30 steps): held-out success gain, {len(gains)} seeds", _gain_text(gains),
                 source("recipe_cpu_default.json", recipe)))
    sok = load("recipe_cpu_sokoban.json")
    gains = _gains(_only_variant(sok))
    rows.append((f"Sokoban 5x5, `configs/sokoban.yaml`: held-out success gain, {len(gains)} seeds",
                 _gain_text(gains), source("recipe_cpu_sokoban.json", sok)))
    pairs, ns, sources = [], [], []
    for folder, regime in [("frozenlake_cpu_credit", "default"), ("frozenlake_cpu_credit_weak", "weak")]:
        data = load(f"{folder}/results.json")
        sources.append(source(f"{folder}/results.json", data))
        n_most = max(c["final_success"]["n"] for c in data["paired_vs_grpo"].values())
        for arm, c in data["paired_vs_grpo"].items():  # the arms at the most seeds (the secondary rows: results)
            f = c["final_success"]
            if f["n"] < n_most:
                continue
            ns.append(f["n"])
            pairs.append(f"{arm} ({regime}) {f['mean_diff']:+.1f} [{f['ci95_low']:+.1f}, {f['ci95_high']:+.1f}]")
    rows.append((f"Tree rollouts and tree credit against flat GRPO at equal sampled tokens, FrozenLake, {min(ns)} "
                 "paired seeds, two regimes: final held-out success, points, 95% CI", "; ".join(pairs),
                 ", ".join(sources)))
    ll = load("learner_llm_cpu.json")
    ratios = {(r["mode"], r["rows"]): r["speed_ratio"] for r in ll["ratios"]}
    text = ", ".join(f"{m} {n} rows {ratios[(m, n)]:.2f}x" for m, n in sorted(ratios))
    ch = load("learner_llm_cpu_chunked.json")
    text += "; after the chunked causal attention " + ", ".join(
        f"{r['mode']} {r['rows']} rows {r['speed_ratio']:.2f}x" for r in ch["ratios"])
    rows.append(("Learner step on SmolLM2-135M, tokens/s against PyTorch (eager + SDPA, peft LoRA)", text,
                 f"{source('learner_llm_cpu.json', ll)}, {source('learner_llm_cpu_chunked.json', ch)}"))
    sv = load("serve_cpu_llamacpp.json")
    ours = sv["server"][0]["levels"][0]["tokens_per_s"]
    theirs = sv["llamacpp"]["levels"][0]["tokens_per_s"]
    rows.append(("Serving SmolLM2-135M, one stream: jaxprm (float32) against llama.cpp (Q4_1)",
                 f"{ours:.1f} against {theirs:.1f} tok/s ({ours / theirs:.2f}x)", source("serve_cpu_llamacpp.json", sv)))
    texts, sources = [], []
    for name in ("proxy_rollout_time_cpu.json", "proxy_rollout_time_cpu_repeat.json"):
        pr = load(name)
        r, rp = pr["summary"]["rollout_time_ratio"], pr["summary"].get("rollout_time_ratio_agent_processes")
        text = f"tree {r['tree_s'][0]:.1f} s, agents in the trainer's process {r['agent_s'][0]:.1f} s ({r['agent_over_tree'][0]:.2f}x)"
        if rp:  # the agents in a child process (agent.processes=1), timed against the same tree run
            text += f", in a process of their own {rp['agent_s'][0]:.1f} s ({rp['agent_over_tree'][0]:.2f}x)"
        texts.append(text)
        sources.append(source(name, pr))
    rows.append(("An OpenAI-SDK agent through the recording proxy against the tree path, same samples: "
                 "rollout time over 10 steps (`agent.processes=1` for a process of their own), "
                 f"{len(texts)} run(s)", "; ".join(texts), ", ".join(sources)))
    agents = _agent_learning_runs()
    rows.append(("Agents trained through the recording proxy on FrozenLake, 20 steps: held-out success gain, "
                 "a chat agent and a tool-calling agent (`move(direction)` calls), 3 seeds each",
                 "; ".join(f"{a['agent']}: {_gain_text(a['gains'])}" for a in agents),
                 ", ".join(a["source"] for a in agents)))
    lc = load("proxy_locust_cpu.json")
    rows.append((f"The proxy under locust: {lc['agents']} SDK agents x {lc['turns_per_agent']} turns",
                 f"{lc['rows_not_matching']} of {lc['rows']} rows lost or wrong; proxy's own time p50 "
                 f"{lc['own_p50_ms']:.2f} ms, p99 {lc['own_p99_ms']:.1f} ms", source("proxy_locust_cpu.json", lc)))
    runs, pre = [(n, load(n)) for n in FIRST_RUNS], load("first_run_cpu_precompile.json")
    on_off = {b["precompile"]: b["total_s"] for b in pre["arms"]}
    text = "; ".join(f"{a['total_s']:.0f} s (set-up {a['setup_s']:.0f} s, run {a['run_s']:.0f} s, of it warm start "
                     f"{a['split_s']['warm_start']:.0f} s), gain {a['gain_points']:+.1f} points"
                     for _, d in runs for a in d["arms"])
    rows.append((f"The README main command on a fresh clone with empty caches, set-up included (goal "
                 f"{pre['goal_s'] / 60:.0f} minutes), {len(runs)} run(s)",
                 f"{text}; before the chunked attention, background compiles on / off: {on_off[True]:.0f} / "
                 f"{on_off[False]:.0f} s", ", ".join(source(n, d) for n, d in [*runs, ("first_run_cpu_precompile.json", pre)])))
    lr = load("long_run_cpu_default.json")
    fl = lr["flatness"]
    text = ", ".join(f"{label} {fl[k]['block_means'][0]:,.0f} -> {fl[k]['block_means'][-1]:,.0f} (fitted "
                     f"{fl[k]['slope_per_100_steps']:+.1f} per 100 steps)" for k, label in (
                         ("rss_mb", "RSS MB"), ("open_fds", "descriptors"), ("threads", "threads"),
                         ("compiled_programs", "programs compiled")))
    rows.append((f"{lr['steps']} steps of the default config: the trainer's health, first and last 50-step block "
                 f"mean after step {lr['warmup']}", text, source("long_run_cpu_default.json", lr)))
    ch = load("chaos_cpu.json")
    faults = sum(c["faults"] for c in ch["campaigns"])
    lost = sum(c["steps_lost"] for c in ch["campaigns"])
    dup = sum(c["rows_duplicated"] for c in ch["campaigns"])
    rows.append(("Generation-server, judge and agent processes SIGKILLed mid-run",
                 f"{faults} faults: {lost} steps lost, {dup} rows duplicated", source("chaos_cpu.json", ch)))
    lines = ["| what | measured | from |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def sokoban() -> str:
    """The Sokoban recipe's table over its eval steps (``benchmarks.recipe.markdown_table``)."""
    from benchmarks.recipe import markdown_table

    data = load("recipe_cpu_sokoban.json")
    return markdown_table(_only_variant(data)) + f"\n\nFrom {source('recipe_cpu_sokoban.json', data)}."


#: the Sokoban recipes tried, in order: (results JSON, what ran)
SOKOBAN_RECIPES = [
    ("recipe_cpu_sokoban_patr.json", "PaTR + `leaf_grpo`, 30 steps, the learner before its layout choice"),
    ("recipe_cpu_sokoban_flat30.json", "flat GRPO + `anchor_state` (the trainer's default), 30 steps"),
    ("recipe_cpu_sokoban.json", "the same, 40 steps: `configs/sokoban.yaml`"),
]


def sokoban_recipes() -> str:
    """Each Sokoban recipe tried: its gains per seed, their mean ± sample std and each run's
    minutes (warm start included)."""
    lines = ["| recipe | gains (points, seeds 0 / 1 / 2) | mean ± std | run minutes | source |", "|---|---|---|---|---|"]
    for name, what in SOKOBAN_RECIPES:
        data = load(name)
        variant = _only_variant(data)
        runs = [r for _, r in sorted(variant["seeds"].items())]
        gains = _gains(variant)
        m, sd = mean_std(gains)
        minutes = " / ".join(f"{r['wall_s'] / 60:.1f}" for r in runs)
        lines.append(f"| {what} | {' / '.join(f'{g:+.1f}' for g in gains)} | {m:+.1f} ± {sd:.1f} | {minutes} "
                     f"| {source(name, data)} |")
    return "\n".join(lines)


def learner_layout() -> str:
    """The learner's layout choice against the measured step times (``benchmarks.learner --prompt-cases``)."""
    data = load("learner_layout_cpu.json")
    lines = ["| flat GRPO groups (16 x 8 leaves) | flat rows | packed rows | flat / packed tokens | flat step s "
             "| packed step s | estimated packed / flat | chosen | faster |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['case']} | {'x'.join(map(str, r['flat_shape']))} | {'x'.join(map(str, r['packed_shape']))} "
                     f"| {r['ideal_ratio']:.2f} | {r['flat_step_s']:.1f} | {r['packed_step_s']:.1f} "
                     f"| {r['estimated_packed_over_flat']:.2f} | {r['chosen']} | {r['faster']} |")
    return "\n".join(lines) + f"\n\nFrom {source('learner_layout_cpu.json', data)}."


def chaos() -> str:
    """The failure campaigns' table (``benchmarks.chaos``)."""
    from benchmarks.chaos import campaign_table

    data = load("chaos_cpu.json")
    return campaign_table(data["campaigns"]) + f"\n\nFrom {source('chaos_cpu.json', data)}."


def _frozenlake(folder: str, title: str) -> str:
    from benchmarks.frozenlake import summarize, table

    data = load(f"{folder}/results.json")
    return table(summarize(data["runs"]), title) + f"\n\nFrom {source(folder + '/results.json', data)}."


def _credit(folder: str, regime: str) -> str:
    """The tree-credit comparison at equal sampled tokens (issue 36): the table, then each arm paired
    by seed with flat GRPO on the final held-out success and on the gain over step 0."""
    from benchmarks.frozenlake import summarize, table
    from benchmarks.paired import format_comparison

    data = load(f"{folder}/results.json")
    runs = data["runs"]
    seeds = max(len(r) for r in runs.values())
    title = (f"FrozenLake {regime}, up to {seeds} seeds, equal sampled tokens "
             f"({data['token_budget']:,} a run)")
    lines = [table(summarize(runs), title), "",
             "Paired by seed with flat GRPO on the final held-out success, in points (mean difference, "
             "95% t CI, sample std of the differences, Wilcoxon signed-rank p; a seed's arms share its "
             "warm start, so the paired gains over step 0 are the same numbers):", ""]
    for arm, c in data["paired_vs_grpo"].items():
        apart = c.get("warm_start_differs")
        lines.append(f"- {format_comparison(arm, c['final_success'])}"
                     + (f" (the warm start differs from flat GRPO's on seed(s) {apart})" if apart else ""))
    lines += ["", "A secondary statistic (not the pre-registered one): the same pairs on the mean of a run's "
              "seven evaluations (step 0 and the six budget fractions: the area under its success-vs-tokens "
              "curve), which averages out much of the last evaluation's noise:", ""]
    lines += [f"- {format_comparison(arm, c)}" for arm, c in paired_curve_means(runs).items()]
    return "\n".join(lines) + f"\n\nFrom {source(folder + '/results.json', data)}."


def paired_curve_means(runs: dict[str, list[dict]], base: str = "grpo") -> dict[str, dict]:
    """Each arm against ``base``, paired by seed, on the mean held-out success over a run's
    evaluations (in points; ``benchmarks.paired``)."""
    from benchmarks.paired import paired_comparison

    ref = {r["seed"]: r for r in runs[base]}
    out = {}
    for arm, rs in runs.items():
        mine = {r["seed"]: r for r in rs}
        seeds = sorted(set(mine) & set(ref))
        if arm == base or len(seeds) < 2:
            continue
        out[arm] = paired_comparison([100 * statistics.mean(mine[s]["success"]) for s in seeds],
                                     [100 * statistics.mean(ref[s]["success"]) for s in seeds])
    return out


def credit_default() -> str:
    """Issue 36's comparison in the default regime."""
    return _credit("frozenlake_cpu_credit", "default")


def credit_weak() -> str:
    """Issue 36's comparison in the weak regime (weak warm start, k = 2, alpha = 0.08)."""
    return _credit("frozenlake_cpu_credit_weak", "warm_start.steps=100 rollout.k=2 rollout.alpha=0.08")


def frozenlake_default() -> str:
    """The older protocol's default-regime table (equal tokens per step)."""
    return _frozenlake("frozenlake_cpu", "FrozenLake default, 3 seeds, equal tokens per step")


def frozenlake_weak() -> str:
    """The older protocol's weak-regime table."""
    return _frozenlake("frozenlake_weak_cpu",
                       "FrozenLake warm_start.steps=100 rollout.k=2 rollout.alpha=0.08, 3 seeds, equal tokens per step")


def _serve_table(name: str, model: str) -> str:
    """Generated tok/s of the server at each concurrency, cache on and off, beside transformers
    ``generate`` at the same batch (``benchmarks.serve``)."""
    data = load(name)
    server = next(s for s in data["server"] if s["model"] == model)
    levels = {(lv["concurrency"], lv["prefix_cache"]): lv for lv in server["levels"]}
    cs = sorted({c for c, _ in levels})
    hf = {b["batch"]: b["tokens_per_s"] for b in data["transformers"]["batches"]}
    ratio = {(r["batch"], r["prefix_cache"]): r["ratio"] for r in data["comparison"]}

    def row(label, cell):
        return f"| {label} | " + " | ".join(cell(c) for c in cs) + " |"

    def tps(cache):
        return lambda c: f"{levels[c, cache]['tokens_per_s']:,.1f}" if (c, cache) in levels else ""

    def ratios(c):
        return "; ".join(f"{ratio[c, k]:.2f}x" for k in (True, False) if (c, k) in ratio)

    lines = ["| generated tok/s | " + " | ".join(map(str, cs)) + " |", "|---" * (len(cs) + 1) + "|",
             row("ours, concurrency (prefix cache on)", tps(True)), row("ours, cache off", tps(False)),
             row("transformers `generate`, batch", lambda c: f"{hf[c]:,.1f}" if c in hf else ""),
             row("ours / transformers (cache on; off)", ratios),
             row("ours, p50 latency (s)", lambda c: f"{levels[c, True]['latency_median_s']:.2f}")]
    return "\n".join(lines) + f"\n\nFrom {source(name, data)}."


def serve() -> str:
    """The server on SmolLM2-135M on this CPU."""
    return _serve_table("serve_cpu.json", "smollm2-135m")


def serve_h200() -> str:
    """The server on SmolLM2-135M's shape twin on a lent H200."""
    return _serve_table("serve_h200.json", "/tmp/smollm2-135m-twin")


def learner_llm() -> str:
    """The learner on SmolLM2-135M against PyTorch, per cell (``benchmarks.learner_llm``), then the
    cell re-measured after the chunked causal attention."""
    return (_learner_llm_table("learner_llm_cpu.json") + "\n\nAfter the learner's rows attend in causal query "
            "chunks (`causal_attention`), the 8-row cells, both frameworks in the same run:\n\n"
            + _learner_llm_table("learner_llm_cpu_chunked.json"))


def _learner_llm_table(name: str) -> str:
    data = load(name)
    by = {(c["framework"], c["mode"], c["rows"]): c for c in data["cells"]}
    lines = [f"| rows x {data['seq']} | mode | jax tokens/s | torch tokens/s | jax / torch | jax compile s "
             "| steps' peak RSS MB jax / torch | first loss jax / torch |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for rows in sorted({c["rows"] for c in data["cells"]}):
        for mode in ("full", "lora"):
            j, t = by.get(("jax", mode, rows)), by.get(("torch", mode, rows))
            if j is None or t is None:
                continue
            comp = "" if j.get("compile_s") is None else f"{j['compile_s']:.1f}"
            lines.append(f"| {rows} | {'LoRA' if mode == 'lora' else mode} | {j['tokens_per_s']:.0f} | "
                         f"{t['tokens_per_s']:.0f} | {j['tokens_per_s'] / t['tokens_per_s']:.2f}x | {comp} | "
                         f"{j['step_peak_rss_mb']:,.0f} / {t['step_peak_rss_mb']:,.0f} | {j['loss']:.6f} / {t['loss']:.6f} |")
    return "\n".join(lines) + f"\n\nFrom {source(name, data)}."


def serve_warmup() -> str:
    """First-request p50 latency per concurrency, without and with the warm-up (``benchmarks.serve_warmup``)."""
    data = load("serve_warmup_cpu.json")
    by = {s["server"]: {lv["concurrency"]: lv for lv in s["levels"]} for s in data["servers"]}
    cell = lambda r: f"{r['latency_median_s']:.2f} ({r['compiled']})"  # noqa: E731
    lines = ["| c | no warm-up, first round | no warm-up, again | warm-up, first round | warm-up, again |",
             "|---|---|---|---|---|"]
    for c in sorted(by["off"]):
        off, on = by["off"][c], by["warmup"][c]
        lines.append(f"| {c} | {cell(off['first'])} | {cell(off['again'])} | {cell(on['first'])} | {cell(on['again'])} |")
    return "\n".join(lines) + f"\n\nFrom {source('serve_warmup_cpu.json', data)}."


def proxy_tools() -> str:
    """The proxy's overhead per turn, chat and tool-calling turns (``benchmarks.proxy --kinds chat tools``)."""
    data = load("proxy_cpu_tools.json")
    lines = ["| kind, agents | overhead p50 | paired p50 | proxy's own p50 / p99 | proxy CPU |", "|---|---|---|---|---|"]
    for r in data["rows"]:
        who = f"{r['kind']}, {r['agents']}" + (f" ({r['gen_ms']:.0f} ms upstream)" if r["gen_ms"] else "")
        lines.append(f"| {who} | {r['overhead_p50_ms']:.2f} | {r['paired_p50_ms']:.2f} | {r['own_p50_ms']:.2f} / "
                     f"{r['own_p99_ms']:.2f} | {r['cpu_ms_per_turn']:.2f} |")
    return "\n".join(lines) + f"\n\nms per turn. From {source('proxy_cpu_tools.json', data)}."


#: (agent, config, JSON): the chat and the tool-calling agent trained through the proxy, same
#: settings otherwise (issue 38, ``benchmarks.proxy_learning --arms agent``)
AGENT_LEARNING = (("chat", "configs/agent_frozenlake.yaml", "proxy_learning_cpu_chat.json"),
                  ("tool calls", "configs/agent_frozenlake_tools.yaml", "proxy_learning_cpu_tools.json"))


def _agent_learning_runs() -> list[dict]:
    """Per :data:`AGENT_LEARNING` entry: its label, source, runs by seed and gains in points (the
    JSON's own per-seed ``summary.agent.gain``)."""
    out = []
    for agent, config, name in AGENT_LEARNING:
        data = load(name)
        out.append({"agent": agent, "label": f"{agent} (`{config}`)", "source": source(name, data),
                    "runs": sorted((r for r in data["runs"] if r["arm"] == "agent"), key=lambda r: r["seed"]),
                    "gains": [100 * g for g in data["summary"]["agent"]["gain"]],
                    "steps": data["summary"]["agent"]["steps"]})
    return out


def agent_learning() -> str:
    """Held-out success of the chat and the tool-calling agent trained through the proxy, per seed
    and eval step, the gain's mean ± std (``benchmarks.proxy_learning --arms agent``)."""
    lines = ["| agent | seed | held-out success by step | gain, points | greedy first -> last | invalid answers (train) | "
             "generated tokens | run s |", "|---|---|---|---|---|---|---|---|"]
    agents = _agent_learning_runs()
    for a in agents:
        for r, gain in zip(a["runs"], a["gains"]):
            curve = " / ".join(f"{100 * v:.1f}" for v in r["success"])
            lines.append(f"| {a['label']} | {r['seed']} | {curve} | {gain:+.1f} | "
                         f"{100 * r['greedy'][0]:.1f} -> {100 * r['greedy'][-1]:.1f} | "
                         f"{100 * r['invalid_rate_mean']:.1f}% | {r['generated_tokens']:,} | {r['wall_s']:.0f} |")
        m, s = mean_std(a["gains"])
        lines.append(f"| {a['label']} | mean ± std | | **{m:+.1f} ± {s:.1f}** | | | | |")
    return "\n".join(lines) + (f"\n\nHeld-out sampled success (64 maps x 4 samples) at steps "
                               f"{', '.join(map(str, agents[0]['steps']))}, in points; run seconds include the warm "
                               f"start. From {' and '.join(a['source'] for a in agents)}.")


def gae_break_even() -> str:
    """GAE's scan and associative methods, milliseconds, on the H200 and this CPU (``benchmarks.kernels --break-even``)."""
    gpu, cpu = load("gae_break_even_h200.json"), load("gae_break_even_cpu.json")
    key = lambda r: (r["B"], r["T"])  # noqa: E731
    g, c = {key(r): r for r in gpu["break_even"]}, {key(r): r for r in cpu["break_even"]}
    scan = lambda r: min(r["scan_u1_ms"], r["scan_u16_ms"])  # noqa: E731
    lines = ["| B x T | H200 scan | H200 associative | 2-core CPU scan | 2-core CPU associative |", "|---|---|---|---|---|"]
    for k in sorted(set(g) & set(c), key=lambda k: (k[0] * k[1], k)):
        lines.append(f"| {k[0]} x {k[1]} | {scan(g[k]):.3f} | {g[k]['associative_ms']:.3f} | {scan(c[k]):.3f} | "
                     f"{c[k]['associative_ms']:.3f} |")
    return "\n".join(lines) + (f"\n\nThe scan column is the faster of unroll 1 and 16. From "
                                f"{source('gae_break_even_h200.json', gpu)} and {source('gae_break_even_cpu.json', cpu)}.")


def async_rl() -> str:
    """Synchronous against asynchronous rollouts, embedded and external server (``benchmarks.async_rl``)."""
    data = load("async_rl_cpu.json")
    lines = ["| variant | steps/hour (per seed) | mean ± std | learner waited (s, per seed) | gain, points (per seed) "
             "| mean ± std |", "|---|---|---|---|---|---|"]
    for name, runs in data["results"].items():
        seeds = sorted(runs, key=int)
        sph = [runs[s]["steps_per_hour"] for s in seeds]
        gains = [100 * runs[s]["gain"] for s in seeds]
        (ms, ss), (mg, sg) = mean_std(sph), mean_std(gains)
        waited = " / ".join(f"{runs[s]['rollout_wait_s']:.0f}" for s in seeds)
        lines.append(f"| {name} | {' / '.join(f'{x:.0f}' for x in sph)} | **{ms:.0f} ± {ss:.0f}** | "
                     f"{waited} | "
                     f"{' / '.join(f'{g:+.1f}' for g in gains)} | **{mg:+.1f} ± {sg:.1f}** |")
    return "\n".join(lines) + f"\n\nFrom {source('async_rl_cpu.json', data)}."


def fuzz() -> str:
    """schemathesis against the served OpenAPI document (``benchmarks.fuzz_server``)."""
    name = "fuzz_server_cpu.json"
    data = load(name)
    st = data["statuses"]
    codes = sorted(st, key=int)
    lines = ["| operations | cases | " + " | ".join(f"{c} answers" for c in codes) + " | 5xx | off the document |",
             "|---" * (len(codes) + 4) + "|",
             f"| {len(data['operations'])} | {data['cases']:,} | " + " | ".join(f"{st[c]:,}" for c in codes)
             + f" | {data['server_errors']} | {len(data['failures'])} |"]
    return "\n".join(lines) + f"\n\nSeed {data['seed']}. From {source(name, data)}."


def kill_and_damage() -> str:
    """SIGKILLs and damaged checkpoints against uninterrupted runs (``benchmarks.kill_and_damage``)."""
    lines = ["| campaign file | settings | damage kinds | SIGKILLs (mid-save) | steps lost / duplicated "
             "| rows equal to the reference | parameters vs the reference |", "|---|---|---|---|---|---|---|"]
    notes = []
    for name, what in [("kill_and_damage_cpu.json", "8 rows a step"), ("kill_and_damage_wide.json", "64 rows a step"),
                       ("kill_and_damage_engine.json", "8 rows a step, the continuous-batching engine")]:
        data = load(name)
        sm, cfg = data["summary"], data["config"]
        strategy = next((o.split("=", 1)[1] for o in reversed(cfg["overrides"]) if o.startswith("rollout.strategy=")), "?")
        kinds = ", ".join(c.get("damage", "?") for c in data["campaigns"])
        params = "bitwise equal" if sm["max_param_diff_vs_reference"] == 0 else f"max diff {sm['max_param_diff_vs_reference']:.1e}"
        lines.append(f"| `{name}` | {strategy}, {what}, {cfg['steps']} steps | {kinds} | {sm['sigkills']} "
                     f"({sm['sigkills_mid_save']}) | {sm['lost_steps']} / {sm['duplicated_steps']} | "
                     f"{sm['data_rows_equal_to_reference']} | {params} |")
        notes.append(source(name, data))
    return "\n".join(lines) + "\n\nFrom " + ", ".join(notes) + "."


RECIPE_HISTORY = [  # (variant in recipe_cpu.json, what it was, what it showed): the prose is ours, the numbers the JSON's
    ("before", "before: 8 tasks/step, lr 3e-4, warmup 8 updates, 200 SFT steps",
     "seed 0: approx KL 0.09 at step 3, invalid answers 100% at step 4"),
    ("warmup40", "+ warmup 40 updates (5 steps)", "no format collapse; seed 2 stalls"),
    ("entropy02", "warmup 40 + entropy bonus 0.02 (`ppo.entropy_coef`; not kept)",
     "entropy held, seed 2 still stalls: not the cause"),
    ("tasks16", "+ 16 tasks/step", "half the gradient noise"),
    ("lr6e-4", "+ lr 6e-4", "greedy up on all; seed 2 slow"),
    ("default", "+ 300 SFT steps (the default)",
     "seed 2's init had not learned to read the map at 200 (greedy 0.375 -> 0.438)"),
    ("default_stop26", "the default again, final code of stop 26", "greedy up on all"),
    ("target_kl01_stop26", "default + `ppo.target_kl=0.01` (PPO's KL early stop; not kept)",
     "it skipped 77 / 56 / 7 of 240 minibatch updates; no gain in robustness"),
    ("default_stop27", "the default on the final code of stop 27", "the headline run"),
]


def recipe_history() -> str:
    """How the default recipe was made robust, a variant per row (``benchmarks.recipe``)."""
    data = load("recipe_cpu.json")
    lines = ["| recipe | gains (points, seeds 0 / 1 / 2) | mean ± std | what it showed |", "|---|---|---|---|"]
    for key, what, showed in RECIPE_HISTORY:
        gains = _gains(data["variants"][key])
        m, sd = mean_std(gains)
        lines.append(f"| {what} | {' / '.join(f'{g:+.1f}' for g in gains)} | {m:+.1f} ± {sd:.1f} | {showed} |")
    return "\n".join(lines) + f"\n\nFrom {source('recipe_cpu.json', data)}."


def long_run() -> str:
    """Per-step health after warm-up, each recorded long run a table (``benchmarks.long_run``)."""
    from benchmarks.long_run import flatness_table

    parts = []
    for name, what in (("long_run_cpu_default.json", "the default config"),
                       ("long_run_cpu.json", "the tests' small settings (`--small`)")):
        data = load(name)
        parts.append(f"{data['steps']} steps of {what}, after step {data['warmup']}, from {source(name, data)}:\n\n"
                     + flatness_table(data))
    return "\n\n".join(parts)


#: the recorded first runs of the README command as it is (``benchmarks.first_run --arms on``)
FIRST_RUNS = ("first_run_cpu.json", "first_run_cpu_repeat.json")


def first_run() -> str:
    """The README main command on a fresh clone, set-up included, per arm (``benchmarks.first_run``)."""
    from benchmarks.first_run import table

    runs = [(n, load(n)) for n in FIRST_RUNS]
    pre = load("first_run_cpu_precompile.json")
    return (f"The README command as it is, {len(runs)} run(s) ({', '.join(source(n, d) for n, d in runs)}):\n\n"
            + table([a for _, d in runs for a in d["arms"]], runs[0][1]["goal_s"])
            + f"\n\nBackground compiles on and off, before the SFT's chunked attention "
            f"({source('first_run_cpu_precompile.json', pre)}):\n\n" + table(pre["arms"], pre["goal_s"]))


BLOCKS: dict[str, Callable[[], str]] = {
    "long-run": long_run, "first-run": first_run,
    "serve": serve, "serve-h200": serve_h200, "learner-llm": learner_llm, "serve-warmup": serve_warmup,
    "proxy-tools": proxy_tools, "agent-learning": agent_learning, "gae-break-even": gae_break_even, "async-rl": async_rl,
    "recipe-history": recipe_history, "fuzz": fuzz, "kill-and-damage": kill_and_damage, "credit-default": credit_default, "credit-weak": credit_weak,
    "headline": headline, "sokoban": sokoban, "sokoban-recipes": sokoban_recipes, "chaos": chaos,
    "learner-layout": learner_layout,
    "frozenlake-default": frozenlake_default, "frozenlake-weak": frozenlake_weak,
}


# -------------------------------------------------------------------------------------------- files


def render(text: str, where: str) -> str:
    """``text`` with every marked block re-rendered. Unknown block names are an error."""
    def one(m: re.Match) -> str:
        name, indent = m.group("name"), m.group("indent")
        if name not in BLOCKS:
            raise KeyError(f"{where}: no renderer for block {name!r}; known: {sorted(BLOCKS)}")
        body = "\n".join((indent + line) if line else "" for line in BLOCKS[name]().rstrip().split("\n"))
        return f"{indent}<!-- report:{name} -->\n{body}\n{indent}<!-- /report:{name} -->"

    return BLOCK.sub(one, text)


def home_page(readme: str) -> str:
    """``docs/index.md`` from the README: links into ``docs/`` become site-relative."""
    return ("<!-- generated from README.md by python -m benchmarks.report; edit the README -->\n"
            + re.sub(r"\]\(docs/", "](", readme))


def outputs() -> dict[Path, str]:
    """Every file this command owns, as it should read."""
    out: dict[Path, str] = {}
    readme = ROOT / "README.md"
    out[readme] = render(readme.read_text(), "README.md")
    for page in sorted(DOCS.glob("*.md")):
        if page.name != "index.md":
            out[page] = render(page.read_text(), f"docs/{page.name}")
    out[DOCS / "index.md"] = home_page(out[readme])
    return out


def figures() -> list[Path]:
    """The figures the docs show, drawn from their JSON."""
    from benchmarks.frozenlake import plot

    made = []
    (DOCS / "img").mkdir(exist_ok=True)
    for folder, name, title in [
            ("frozenlake_cpu_credit", "credit_default.png", "Tree credit at equal sampled tokens, default regime"),
            ("frozenlake_cpu_credit_weak", "credit_weak.png",
             "Tree credit at equal sampled tokens, weak warm start, k=2, alpha=0.08"),
            ("frozenlake_cpu", "frozenlake_default.png", "FrozenLake default, 3 seeds, equal tokens per step"),
            ("frozenlake_weak_cpu", "frozenlake_weak.png",
             "FrozenLake weak warm start, k=2, alpha=0.08, 3 seeds, equal tokens per step")]:
        if not (RESULTS / folder / "results.json").is_file():
            continue
        data = load(f"{folder}/results.json")
        path = DOCS / "img" / name
        plot(data["runs"], path, f"{title} ({source(folder + '/results.json', data)})".replace("`", ""),
             data.get("token_budget") if data.get("budget") == "total" else None)
        made.append(path)
    from benchmarks.long_run import plot as health_plot

    path = DOCS / "img" / "long_run_default.png"
    health_plot(load("long_run_cpu_default.json"), path)
    return [*made, path]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    p.add_argument("--figures", action="store_true", help="also draw the docs' figures (docs/img/) from their JSON")
    args = p.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        old = path.read_text() if path.exists() else None
        if old != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    if args.check:
        if stale:
            print("out of date (run python -m benchmarks.report): " + ", ".join(map(str, stale)))
            return 1
        print("every generated block is current")
        return 0
    print(("rewrote " + ", ".join(map(str, stale))) if stale else "nothing to rewrite")
    if args.figures:
        for path in figures():
            print(f"drew {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
