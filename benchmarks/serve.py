"""Generation-server benchmark: tokens/s vs concurrency, compile time, time to first token.

    python -m benchmarks.serve [--json PATH] [--models tiny,smollm2-135m] [--concurrency 1,8,32,64]

For each model an in-process server (``ServerHandle``, dynamic batching) is started on 127.0.0.1.
Then, per concurrency level ``c``, ``c`` asyncio clients (in a child process, so that the load
generator does not compete with the server for the GIL) each send ``--requests-per-client``
``/v1/completions`` requests back to back (the same chat-formatted prompt made distinct per request, ``max_tokens`` tokens with
``ignore_eos`` so every request generates exactly that many, temperature 1, distinct seeds).

Reported:

* ``compile_s``: ahead-of-time compilation (``Sampler.precompile``) of each batch bucket the run can
  hit (1 .. max batch), per bucket and in total, done before timing so the throughput numbers are
  steady state (``recompiled_during_levels`` checks it);
* ``ttft_s``: time to first token on an idle server, measured as the median latency of a
  ``max_tokens=1`` request (the server does not stream, so this is prefill + one decode step + HTTP);
* per concurrency: generated tokens/s over the whole level ("gen tok/s"), prompt + generated tokens/s
  ("all tok/s": every request also prefills its prompt, which dominates the work on a CPU), request
  latency (median / p90), the mean rows per batch the engine ran;
* ``direct``: the sampler without HTTP at batch 1 / 8 / 32 / 64 (``--compare-loops`` also times the
  host-driven decode loop against the on-device ``while_loop``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import httpx  # noqa: E402
import jax  # noqa: E402

from jaxprm.models import load_model  # noqa: E402
from jaxprm.serve.sampler import Sampler, SamplingParams  # noqa: E402
from jaxprm.serve import ServerHandle  # noqa: E402

PROMPT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": (
        "You are walking on a frozen lake.\nFrozenLake Quick Guide\nGoal: Reach the goal (G).\n"
        "Symbols: _ Frozen | O Hole | G Goal | P Player\nRules:\n1. Avoid falling into holes (O).\n"
        "2. Frozen tiles are slippery, you may move perpendicular to your intended direction.\n"
        "Valid Action (separated by | ): Up | Down | Left | Right\n"
        "Current observation:\nP _ _ _\n_ O _ O\n_ _ _ O\nO _ _ G\n"
        "Please show your thinking process and put the final action in ``` ```.")},
]


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _run_level(url: str, model_name: str, prompt: str, concurrency: int, per_client: int, max_tokens: int):
    latencies: list[float] = []
    tokens = 0
    prompt_tokens = 0

    async def worker(cid: int, client: httpx.AsyncClient):
        nonlocal tokens, prompt_tokens
        for j in range(per_client):
            # a distinct prompt per request (as in RL rollouts), so that no prefill is shared
            body = dict(model=model_name, prompt=prompt + f"Episode {cid}-{j}.", max_tokens=max_tokens, temperature=1.0,
                        seed=cid * 1000 + j, ignore_eos=True)
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            usage = r.json()["usage"]
            tokens += usage["completion_tokens"]
            prompt_tokens += usage["prompt_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return dict(concurrency=concurrency, requests=len(latencies), tokens=tokens, wall_s=wall,
                tokens_per_s=tokens / wall, prompt_plus_generated_tokens_per_s=(tokens + prompt_tokens) / wall, latency_median_s=statistics.median(latencies),
                latency_p90_s=_percentile(latencies, 0.9))


def _level_main(args):
    return asyncio.run(_run_level(*args))


def _run_level_in_child(*args):
    """Run the load generator in a separate process so that it does not share the server's GIL."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_level_main, (args,))


def _direct(sampler: Sampler, prompt_ids, batch_sizes, max_tokens: int):
    out = []
    sampler.precompile(batch_sizes, len(prompt_ids), max_tokens)
    for b in batch_sizes:
        sp = [SamplingParams(max_new_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(b)]
        prompts = [[i] + list(prompt_ids[1:]) for i in range(b)]  # distinct: no shared prefill
        t0 = time.perf_counter()
        res = sampler.generate(prompts, sp)
        dt = time.perf_counter() - t0
        out.append(dict(batch=b, tokens_per_s=sum(len(c.token_ids) for c in res) / dt, wall_s=dt))
    return out


def bench_model(name: str, *, concurrency, per_client: int, max_tokens: int, max_batch: int, compare_loops: bool):
    t0 = time.perf_counter()
    model, tok = load_model(name)
    load_s = time.perf_counter() - t0
    prompt = tok.apply_chat_template(PROMPT_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=True)
    eos = tuple(tok.eos_token_ids)
    sampler = Sampler(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id or 0, max_batch=max_batch)

    # compile (ahead of time, without running) every batch bucket the engine can hit for this prompt
    # and output length, plus batch 1 for the max_tokens=1 requests of the TTFT measurement
    compile_s = sampler.precompile(sampler.batch_buckets, len(prompt_ids), max_tokens)
    sampler.precompile([1], len(prompt_ids), 1)
    n_params = sum(int(x.size) for x in jax.tree.leaves(sampler.params))

    result = dict(model=name, params=n_params, prompt_tokens=len(prompt_ids), max_tokens=max_tokens,
                  load_s=load_s, compile_s=compile_s, compile_total_s=sum(compile_s.values()),
                  compilations=sampler.num_compilations)
    with ServerHandle.from_sampler(sampler, tok, model_name=name, max_batch=max_batch) as server:
        with httpx.Client(base_url=server.url, timeout=3600) as h:
            ttft = []
            for i in range(5):
                t = time.perf_counter()
                h.post("/v1/completions", json=dict(model=name, prompt=prompt, max_tokens=1, seed=i)).raise_for_status()
                ttft.append(time.perf_counter() - t)
        result["ttft_s"] = statistics.median(ttft)
        levels = []
        stats = server.app.state.server.engine.stats
        for c in concurrency:
            b0, r0 = stats.batches, stats.rows
            level = _run_level_in_child(server.url, name, prompt, c, per_client, max_tokens)
            level["mean_rows_per_batch"] = (stats.rows - r0) / max(1, stats.batches - b0)
            levels.append(level)
            print(f"  {name}: concurrency {c:3d}: {level['tokens_per_s']:9.1f} tok/s "
                  f"(median latency {level['latency_median_s']:.2f} s, {level['mean_rows_per_batch']:.1f} rows/batch)",
                  flush=True)
        result["levels"] = levels
        result["recompiled_during_levels"] = sampler.num_compilations - result["compilations"]
    result["direct"] = {"device": _direct(sampler, prompt_ids, [1, 8, 32, 64], max_tokens)}
    if compare_loops:
        host = Sampler(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id or 0, max_batch=max_batch, loop="host")
        result["direct"]["host"] = _direct(host, prompt_ids, [1, 8, 32, 64], max_tokens)
    return result


def print_table(results) -> None:
    print()
    print(f"{'model':14s} {'params':>10s} {'conc':>5s} {'gen tok/s':>10s} {'all tok/s':>10s} {'lat p50 s':>10s} "
          f"{'lat p90 s':>10s} {'rows/batch':>10s}")
    for r in results:
        for lv in r["levels"]:
            print(f"{r['model']:14s} {r['params']:>10d} {lv['concurrency']:>5d} {lv['tokens_per_s']:>10.1f} "
                  f"{lv['prompt_plus_generated_tokens_per_s']:>10.1f} "
                  f"{lv['latency_median_s']:>10.3f} {lv['latency_p90_s']:>10.3f} {lv['mean_rows_per_batch']:>10.1f}")
    print()
    for r in results:
        comp = ", ".join(f"B={b}: {s:.1f}s" for b, s in r["compile_s"].items())
        print(f"{r['model']}: prompt {r['prompt_tokens']} tokens, {r['max_tokens']} new tokens; TTFT (idle, 1-token "
              f"request) {r['ttft_s'] * 1000:.0f} ms; compile total {r['compile_total_s']:.1f} s ({comp}); "
              f"recompiles during the timed levels: {r['recompiled_during_levels']}")
        for loop, rows in r["direct"].items():
            print(f"  direct sampler ({loop} loop): " + ", ".join(f"B={x['batch']}: {x['tokens_per_s']:.0f} tok/s" for x in rows))


def _per_model(spec: str, name: str, default: int) -> int:
    """``"64"`` -> 64; ``"tiny=64,smollm2-135m=32"`` -> the value for ``name`` (else ``default``)."""
    if "=" not in spec:
        return int(spec)
    table = {k.strip(): int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    return table.get(name, default)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests-per-client", default="tiny=4,smollm2-135m=1",
                   help="requests each client sends per level: an int, or name=int pairs")
    p.add_argument("--max-tokens", default="tiny=64,smollm2-135m=32",
                   help="tokens per request: an int, or name=int pairs")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--compare-loops", action="store_true", help="also time the host-driven decode loop")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    results = []
    for name in [m for m in args.models.split(",") if m]:
        mt = _per_model(args.max_tokens, name, 32)
        print(f"benchmarking {name} ...", flush=True)
        results.append(bench_model(name, concurrency=[int(c) for c in args.concurrency.split(",")],
                                   per_client=_per_model(args.requests_per_client, name, 2), max_tokens=mt,
                                   max_batch=args.max_batch,
                                   compare_loops=args.compare_loops))
    print_table(results)
    if args.json:
        env = dict(platform=platform.platform(), python=platform.python_version(), jax=jax.__version__,
                   devices=[str(d) for d in jax.devices()], cpu_count=os.cpu_count())
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, results=results), f, indent=2, default=str)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
