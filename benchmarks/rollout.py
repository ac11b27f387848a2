"""Rollout benchmark: flat GRPO vs Tree-Random vs PaTR on FrozenLake against the scripted server.

    python -m benchmarks.rollout [--tasks 32] [--group 8] [--sizes 5,6] [--p-frozen 0.75]
                                 [--max-turns 12] [--p-good 0.6] [--json runs/bench_rollout.json]

The scripted server (``rollout.testing``, a subprocess so it does not share this process's GIL) plays
a noisy navigator: a shortest-path move with probability ``--p-good``, else a random one. Every
strategy gets the same number of trajectories per group (flat: G samples; trees: ``max_branches = G``
with dead slots refilled). Reported per strategy: success rate, groups with any success, sampled
actions, generated / prompt / prefix-shareable tokens, requests per second, and the client overhead
per turn (synchronous rollout work: building and parsing requests, template diffs, env steps,
bookkeeping; target < 2 ms) next to the whole client process's CPU time per turn (includes the HTTP
client, aiohttp, and asyncio).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from benchmarks._harness import start_scripted_upstream
from benchmarks.provenance import write_result

from rollout.chat import PromptBuilder
from rollout.client import ClientConfig, GenerationClient, SamplingParams
from rollout.envs import FrozenLakeEnv, make_tasks
from rollout.export import export_groups
from rollout.stats import describe_groups
from rollout.testing import make_test_tokenizer
from rollout.groups import TreeConfig
from rollout.tree import run_groups
from scorers import FrozenLakeProgressScorer


async def _bench(url: str, tasks: list, cfg: TreeConfig, scorer: Any, prompts: PromptBuilder, seed: int) -> dict[str, Any]:
    async with GenerationClient(ClientConfig(endpoints=(url,), max_concurrency=64)) as client:
        cpu0, t0 = time.process_time(), time.perf_counter()
        groups = await run_groups(tasks, env_factory=FrozenLakeEnv, client=client, prompts=prompts, config=cfg,
                                  scorer=scorer, group_seed=seed)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        cstats = client.stats()
    d = describe_groups(groups)
    turns = max(d["sampled_actions"], 1)
    overhead = sum(g.stats.overhead_s for g in groups)
    t_exp = time.perf_counter()
    batch, _ = export_groups(groups)
    export_s = time.perf_counter() - t_exp
    d.update({
        "strategy": cfg.strategy,
        "wall_s": wall,
        "requests": cstats["requests"],
        "retries": cstats["retries"],
        "requests_per_s": cstats["requests"] / wall,
        "overhead_ms_per_turn": 1e3 * overhead / turns,
        "client_cpu_ms_per_turn": 1e3 * cpu / turns,
        "cache_reusable_tokens": sum(g.stats.cache_reusable_tokens for g in groups),
        "trajectories_per_group": d["trajectories"] / max(d["groups"], 1),
        "actions_per_group": d["sampled_actions"] / max(d["groups"], 1),
        "export_s": export_s,
        "batch_shape": list(batch.shape),
    })
    return d


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="trajectories per group (flat G = tree max_branches)")
    ap.add_argument("--b0", type=int, default=4)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--sizes", default="5,6")
    ap.add_argument("--p-frozen", type=float, default=0.75)
    ap.add_argument("--max-turns", type=int, default=12)
    ap.add_argument("--p-good", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="runs/bench_rollout.json")
    args = ap.parse_args(argv)

    tok = make_test_tokenizer()
    prompts = PromptBuilder(tok)
    tasks, _ = make_tasks(args.seed, args.tasks, 0, sizes=[int(s) for s in args.sizes.split(",")],
                          p_frozen=args.p_frozen, max_turns=args.max_turns)
    scorer, scorer_name = FrozenLakeProgressScorer(), "scorers.FrozenLakeProgressScorer"
    sampling = SamplingParams(max_tokens=32)
    common = dict(max_turns=args.max_turns, sampling=sampling, seed=args.seed, theta=6)
    configs = [
        TreeConfig(strategy="flat", group_size=args.group, **common),
        TreeConfig(strategy="tree_random", b0=args.b0, k=args.k, max_branches=args.group, **common),
        TreeConfig(strategy="patr", b0=args.b0, k=args.k, max_branches=args.group, **common),
    ]
    proc, url = start_scripted_upstream("frozenlake", "--p-good", str(args.p_good))
    try:
        # warm-up (connection pool, server code paths)
        asyncio.run(_bench(url, tasks[:2], configs[0], scorer, prompts, 10_000))
        results = [asyncio.run(_bench(url, tasks, cfg, scorer, prompts, args.seed)) for cfg in configs]
    finally:
        proc.terminate()
        proc.wait(timeout=10)

    cols = [("strategy", "{:>11}"), ("trajectories_per_group", "{:>6.2f}"), ("success_rate", "{:>6.3f}"),
            ("groups_with_success", "{:>6.3f}"), ("mixed_groups", "{:>6.3f}"), ("actions_per_group", "{:>7.1f}"),
            ("expanded", "{:>5d}"), ("pruned", "{:>5d}"), ("loop_stopped", "{:>5d}"), ("refills", "{:>5d}"),
            ("generated_tokens", "{:>7d}"), ("prompt_tokens", "{:>9d}"), ("sibling_shared_tokens", "{:>8d}"),
            ("requests_per_s", "{:>7.1f}"), ("overhead_ms_per_turn", "{:>6.3f}"), ("client_cpu_ms_per_turn", "{:>6.3f}")]
    heads = ["strategy", "traj/g", "succ", "g_any", "mixed", "act/g", "exp", "prune", "loop", "refil",
             "gen_tok", "prompt_tok", "sib_shr", "req/s", "ovh_ms", "cpu_ms"]
    widths = [len(f.format(results[0][k])) for k, f in cols]
    print(f"FrozenLake: {args.tasks} tasks, sizes {args.sizes}, p_frozen {args.p_frozen}, max_turns {args.max_turns}, "
          f"scripted navigator p_good {args.p_good}; PaTR scorer: {scorer_name}")
    print(" ".join(h.rjust(w) for h, w in zip(heads, widths)))
    for r in results:
        print(" ".join(f.format(r[k]) for k, f in cols))
    for r in results:
        if r["per_checkpoint"]:
            print(f"{r['strategy']} per checkpoint:", [(c["index"], c["active"], c["expanded"], c["pruned"])
                                                        for c in r["per_checkpoint"]], "(index, active, expanded, pruned)")
    out = {"args": vars(args), "scorer": scorer_name, "results": results}
    if args.json:
        write_result(args.json, out)
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
