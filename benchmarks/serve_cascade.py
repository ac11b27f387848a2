"""Cascade decode attention: several groups' prompt prefixes gathered once each, against today's
per-row gather, one decode call of the engine's program, timed alternately in one process.

    python -m benchmarks.serve_cascade [--model smollm2-135m] [--groups 4] [--rows 8] [--prompt 128]
                                       [--generated 16] [--repeats 15] [--json PATH]

The batch is ``--groups`` GRPO-like groups of ``--rows`` rows (``c = groups * rows``); each group
has its own ``--prompt``-token prompt (distinct between groups, so the groups share nothing, as
the issue's setting asks) cached once in the pool, and each row ``--generated`` tokens of its own
after it. Every row decodes its next token (greedy, one step: the engine's ``decode_steps`` for a
model of this size). Variants, both over the same pool and weights, with the engine's window
buckets:

* ``per_row``: each row's table holds its whole window (prefix blocks included): the prefix keys
  and values are gathered once per row (what the engine did before cascade decode, and still
  does with ``shared_prefix_attention`` off);
* ``cascade``: the ``groups`` prefixes in ``shared_table [S, ns]``, each gathered once for the
  batch; each row's table holds only its own blocks (``jaxprm.serve.cascade`` / ``programs``);
* ``own_only`` (a bound, not a method): the same step with the prefixes left out (each row attends
  its own ``generated`` positions only; wrong tokens): what the step costs with free prefixes,
  the most any prefix sharing can gain here.

Reported: best and median milliseconds per decode call, generated tok/s of the best, the speed-up
``per_row / cascade`` (best and median), the outputs' agreement (same greedy tokens), compile
seconds and ``os.getloadavg()``. The issue's goal: >= 1.3x at c = 32 (4 groups x 8 rows, 128-token
prompts).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks.provenance import write_result  # noqa: E402
from benchmarks._harness import loadavg  # noqa: E402
from jaxprm.models import load_model  # noqa: E402
from jaxprm.serve import Engine  # noqa: E402
from jaxprm.serve.cascade import group_slots  # noqa: E402
from jaxprm.serve.programs import ModelRunner, decode_input_shapes  # noqa: E402
from jaxprm.serve.sampler import Sampler  # noqa: E402
from jaxprm.serve.sampling import bucket_for  # noqa: E402


def _inputs(B: int, nb: int, position: int, ns: int = 0, S: int = 0, R: int = 0) -> dict[str, np.ndarray]:
    inp = {k: np.zeros(v.shape, v.dtype) for k, v in decode_input_shapes(B, nb, ns, S or 1, R).items()}
    inp["token"][:] = np.arange(B) % 1000 + 5
    inp["position"][:] = position
    inp["active"][:] = True
    inp["remaining"][:] = 1 << 20
    inp["top_p"][:] = 1.0
    inp["stop_ids"][:] = -1
    return inp


def bench(model_name: str, groups: int, rows: int, prompt: int, generated: int, repeats: int) -> dict:
    model, tok = load_model(model_name)
    B = groups * rows
    sampler = Sampler(model, eos_token_ids=tok.eos_token_ids, max_batch=B)
    engine = Engine(sampler, max_batch=B, kv_cache_tokens=B * 512, shared_prefix_attention=True)
    bs = engine.block_size
    if prompt % bs:
        raise SystemExit(f"--prompt must be a multiple of the block size {bs}")
    position = prompt + generated  # the position each row's decode step writes
    Bb = bucket_for(B, engine.batch_buckets, "batch")
    W = bucket_for(position + 1, engine.window_buckets, "window")
    own_w = bucket_for(position + 1 - prompt, engine.own_window_buckets, "window")
    ns = bucket_for(prompt, engine.window_buckets, "shared window") // bs
    S = group_slots(groups)
    # pool layout: block 0 null; group g's prefix blocks; then every row's own blocks
    pn, on = prompt // bs, -(-(position + 1 - prompt) // bs)
    prefix = [1 + g * pn + np.arange(pn) for g in range(groups)]
    first_own = 1 + groups * pn
    own = [first_own + r * on + np.arange(on) for r in range(B)]
    num_blocks = first_own + B * on + 1
    params, _ = sampler.snapshot()
    runner = dict(per_row=ModelRunner(sampler.graphdef, sampler.rest, sampler.config, num_blocks=num_blocks,
                                      block_size=bs, cache_dtype=sampler.cache_dtype))
    runner["own_only"] = ModelRunner(sampler.graphdef, sampler.rest, sampler.config, num_blocks=num_blocks,
                                     block_size=bs, cache_dtype=sampler.cache_dtype)
    runner["cascade"] = ModelRunner(sampler.graphdef, sampler.rest, sampler.config, num_blocks=num_blocks,
                                    block_size=bs, cache_dtype=sampler.cache_dtype)
    # the same random prompts' KV in both pools, written by the runner's prefill
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 1000, (1, prompt)).astype(np.int32) for _ in range(groups)]
    for r in runner.values():
        for g, toks in enumerate(prompts):
            tables = np.zeros((1, W // bs), np.int32)
            tables[0, :pn] = prefix[g]
            r.prefill(params, toks, np.arange(prompt, dtype=np.int32)[None], tables)
    full = _inputs(Bb, W // bs, position)
    R = min(Bb, group_slots(rows))
    casc = _inputs(Bb, own_w // bs, position, ns, S, R)
    casc["shared_rows"][:] = -1
    casc["shared_table"][:groups, :pn] = np.stack(prefix)
    casc["shared_len"][:groups] = prompt
    for b in range(B):
        g = b // rows
        full["tables"][b, :pn] = prefix[g]
        full["tables"][b, pn: pn + on] = own[b]
        casc["tables"][b, :on] = own[b]
        casc["shared_rows"][g, b % rows] = b
    full["active"][B:] = casc["active"][B:] = False
    full["position"][B:] = casc["position"][B:] = -1
    bound = _inputs(Bb, own_w // bs, position - prompt)
    bound["tables"][:] = casc["tables"]
    bound["active"][B:] = False
    bound["position"][B:] = -1
    inputs = dict(per_row=full, cascade=casc, own_only=bound)
    compile_s, tokens = {}, {}
    for name, r in runner.items():
        t0 = time.perf_counter()
        out = r.decode(params, inputs[name], steps=1, top_n=0, filtering=False)
        compile_s[name] = time.perf_counter() - t0
        tokens[name] = np.asarray(out["token"][0, :B])
    times = {name: [] for name in runner}
    for _ in range(repeats):
        for name, r in runner.items():
            t0 = time.perf_counter()
            r.decode(params, inputs[name], steps=1, top_n=0, filtering=False)
            times[name].append(time.perf_counter() - t0)
    res = dict(model=model_name, params=model.num_params(), groups=groups, rows_per_group=rows, batch=B,
               batch_bucket=Bb, prompt_tokens=prompt, generated_tokens=generated, window=W, own_window=own_w,
               shared_window=ns * bs, shared_slots=S, group_rows=R, repeats=repeats,
               same_greedy_tokens=bool((tokens["per_row"] == tokens["cascade"]).all()), variants={})
    for name, ts in times.items():
        best, med = min(ts), float(np.median(ts))
        res["variants"][name] = dict(best_ms=1e3 * best, median_ms=1e3 * med, tokens_per_s=B / best,
                                     first_call_s=compile_s[name], times_ms=[1e3 * t for t in ts])
    v = res["variants"]
    res["speedup_best"] = v["per_row"]["best_ms"] / v["cascade"]["best_ms"]
    res["speedup_median"] = v["per_row"]["median_ms"] / v["cascade"]["median_ms"]
    res["bound_speedup_median"] = v["per_row"]["median_ms"] / v["own_only"]["median_ms"]
    res["goal"] = ">= 1.3x per_row at c=32 (4 groups x 8 rows, 128-token prompts)"
    res["goal_met"] = bool(res["speedup_median"] >= 1.3)
    res["loadavg_end"] = loadavg()
    return res


def print_table(res: dict) -> None:
    print(f"\n{res['model']}: one decode step of {res['groups']} groups x {res['rows_per_group']} rows, "
          f"{res['prompt_tokens']}-token prompts + {res['generated_tokens']} generated "
          f"(window {res['window']}; cascade: {res['shared_slots']} x {res['shared_window']} shared + "
          f"{res['own_window']} own)")
    print(f"{'variant':>8s} {'best ms':>8s} {'median ms':>9s} {'tok/s':>7s} {'compile s':>9s}")
    for name, v in res["variants"].items():
        print(f"{name:>8s} {v['best_ms']:8.1f} {v['median_ms']:9.1f} {v['tokens_per_s']:7.0f} {v['first_call_s']:9.1f}")
    print(f"speed-up per_row / cascade: {res['speedup_best']:.2f}x best, {res['speedup_median']:.2f}x median "
          f"(goal 1.3x: {'met' if res['goal_met'] else 'missed'}); same greedy tokens: {res['same_greedy_tokens']}; "
          f"bound (prefixes free): {res['bound_speedup_median']:.2f}x median")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_cascade", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--rows", type=int, default=8, help="rows per group")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per group (a multiple of 16)")
    p.add_argument("--generated", type=int, default=16, help="tokens each row generated before the timed step")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = dict(loadavg_start=loadavg())
    print(f"cascade decode on {args.model}: {args.groups} x {args.rows} rows ...", flush=True)
    res.update(bench(args.model, args.groups, args.rows, args.prompt, args.generated, args.repeats))
    print_table(res)
    if args.json:
        write_result(args.json, res)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
