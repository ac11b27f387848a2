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


def _committed_at(name: str) -> str | None:
    """The short hash of the last commit that changed ``benchmarks/results/NAME``."""
    import subprocess

    out = subprocess.run(["git", "log", "-1", "--format=%h", "--", f"benchmarks/results/{name}"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip() or None


def source(name: str, data: dict | None = None) -> str:
    """``` `NAME` (commit abc1234) ``` for a JSON that records its commit; one that does not is
    labelled stale with the commit that added it: ``(stale: no commit recorded; added at abc1234)``."""
    data = load(name) if data is None else data
    commit = data.get("commit")
    if commit:
        return f"`{name}` (commit {commit[:7]})"
    return f"`{name}` (stale: no commit recorded; added at {_committed_at(name) or 'an unknown commit'})"


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (ddof=1; 0 for one value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _gains(variant: dict) -> list[float]:
    return [100 * (r["success"][-1] - r["success"][0]) for _, r in sorted(variant["seeds"].items())]


def _gain_text(gains: list[float]) -> str:
    m, s = mean_std(gains)
    return f"{' / '.join(f'{g:+.1f}' for g in gains)} points (mean **{m:+.1f} ± {s:.1f}**)"


# ------------------------------------------------------------------------------------------- blocks


def headline() -> str:
    """The README's one results table: a row per capability, each from its JSON."""
    rows = []
    recipe = load("recipe_cpu.json")
    gains = _gains(recipe["variants"]["default_stop27"])
    rows.append(("FrozenLake 4x4, the default recipe (tiny policy, PaTR, 30 steps): held-out success gain, "
                 f"{len(gains)} seeds", _gain_text(gains), source("recipe_cpu.json", recipe)))
    sok = load("sokoban_cpu.json")
    gains = _gains(sok["variants"]["default"])
    rows.append((f"Sokoban 5x5, `configs/sokoban.yaml`: held-out success gain, {len(gains)} seeds",
                 _gain_text(gains), source("sokoban_cpu.json", sok)))
    ll = load("learner_llm_cpu.json")
    ratios = {(r["mode"], r["rows"]): r["speed_ratio"] for r in ll["ratios"]}
    text = ", ".join(f"{m} {n} rows {ratios[(m, n)]:.2f}x" for m, n in sorted(ratios))
    rows.append(("Learner step on SmolLM2-135M, tokens/s against PyTorch (eager + SDPA, peft LoRA)", text,
                 source("learner_llm_cpu.json", ll)))
    sv = load("serve_llamacpp_cpu.json")
    ours = sv["server"][0]["levels"][0]["tokens_per_s"]
    theirs = sv["llamacpp"]["levels"][0]["tokens_per_s"]
    rows.append(("Serving SmolLM2-135M, one stream: jaxprm (float32) against llama.cpp (Q4_1)",
                 f"{ours:.1f} against {theirs:.1f} tok/s ({ours / theirs:.2f}x)", source("serve_llamacpp_cpu.json", sv)))
    pr = load("proxy_rollout_time_cpu.json")
    r = pr["summary"]["rollout_time_ratio"]
    rows.append(("An OpenAI-SDK agent through the recording proxy against the tree path, same samples: "
                 "rollout time", f"{r['agent_s'][0]:.1f} s against {r['tree_s'][0]:.1f} s "
                 f"({r['agent_over_tree'][0]:.2f}x)", source("proxy_rollout_time_cpu.json", pr)))
    lc = load("proxy_locust_cpu.json")
    rows.append((f"The proxy under locust: {lc['agents']} SDK agents x {lc['turns_per_agent']} turns",
                 f"{lc['rows_not_matching']} of {lc['rows']} rows lost or wrong; proxy's own time p50 "
                 f"{lc['own_p50_ms']:.2f} ms, p99 {lc['own_p99_ms']:.1f} ms", source("proxy_locust_cpu.json", lc)))
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

    data = load("sokoban_cpu.json")
    return markdown_table(data["variants"]["default"]) + f"\n\nFrom {source('sokoban_cpu.json', data)}."


def chaos() -> str:
    """The failure campaigns' table (``benchmarks.chaos``)."""
    from benchmarks.chaos import campaign_table

    data = load("chaos_cpu.json")
    return campaign_table(data["campaigns"]) + f"\n\nFrom {source('chaos_cpu.json', data)}."


def _frozenlake(folder: str, title: str) -> str:
    from benchmarks.frozenlake import summarize, table

    data = load(f"{folder}/results.json")
    return table(summarize(data["runs"]), title) + f"\n\nFrom {source(folder + '/results.json', data)}."


def frozenlake_default() -> str:
    """The older protocol's default-regime table (equal tokens per step)."""
    return _frozenlake("frozenlake_cpu", "FrozenLake default, 3 seeds, equal tokens per step")


def frozenlake_weak() -> str:
    """The older protocol's weak-regime table."""
    return _frozenlake("frozenlake_weak_cpu",
                       "FrozenLake warm_start.steps=100 rollout.k=2 rollout.alpha=0.08, 3 seeds, equal tokens per step")


def serve() -> str:
    """Generated tok/s of the server on SmolLM2-135M at each concurrency, cache on and off, beside
    transformers ``generate`` (``benchmarks.serve``)."""
    data = load("serve_cpu.json")
    server = next(s for s in data["server"] if s["model"] == "smollm2-135m")
    levels = {(lv["concurrency"], lv["prefix_cache"]): lv for lv in server["levels"]}
    cs = sorted({c for c, _ in levels})
    hf = {b["batch"]: b["tokens_per_s"] for b in data["transformers"]["batches"]}
    ratio = {(r["batch"], r["prefix_cache"]): r["ratio"] for r in data["comparison"]}

    def row(label, cell):
        return f"| {label} | " + " | ".join(cell(c) for c in cs) + " |"

    def tps(cache):
        return lambda c: f"{levels[c, cache]['tokens_per_s']:.1f}" if (c, cache) in levels else ""

    lines = ["| generated tok/s | " + " | ".join(map(str, cs)) + " |", "|---" * (len(cs) + 1) + "|",
             row("ours, concurrency (prefix cache on)", tps(True)), row("ours, cache off", tps(False)),
             row("transformers `generate` (float32, eager), batch", lambda c: f"{hf[c]:.1f}" if c in hf else ""),
             row("ours / transformers (cache on; off)",
                 lambda c: f"{ratio[c, True]:.2f}x; {ratio[c, False]:.2f}x" if (c, True) in ratio else ""),
             row("ours, p50 latency (s)", lambda c: f"{levels[c, True]['latency_median_s']:.2f}")]
    return "\n".join(lines) + f"\n\nFrom {source('serve_cpu.json', data)}."


BLOCKS: dict[str, Callable[[], str]] = {
    "serve": serve,
    "headline": headline, "sokoban": sokoban, "chaos": chaos,
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
            ("frozenlake_cpu", "frozenlake_default.png", "FrozenLake default, 3 seeds, equal tokens per step"),
            ("frozenlake_weak_cpu", "frozenlake_weak.png",
             "FrozenLake weak warm start, k=2, alpha=0.08, 3 seeds, equal tokens per step")]:
        data = load(f"{folder}/results.json")
        path = DOCS / "img" / name
        plot(data["runs"], path, f"{title} ({source(folder + '/results.json', data)})",
             data.get("token_budget") if data.get("budget") == "total" else None)
        made.append(path)
    return made


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
