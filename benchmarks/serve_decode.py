"""The engine's decode program, A/B in one process: the current one vs the layer scan and vs an
older commit's (the anchor), timed alternately so that every variant sees the same machine load.

    python -m benchmarks.serve_decode [--model smollm2-135m] [--batches 1,8,32,64] [--window 256]
                                      [--steps 1,4] [--anchor main] [--repeats 10] [--json PATH]

For each batch size ``B`` every variant owns a KV pool of ``B`` rows of ``--window`` positions and
runs one decode call of ``--steps`` steps (default: the engine's ``decode_steps`` for the model) of
``B`` active rows at position ``--position``, greedy and sampled (temperature 1), including the copy of the
outputs to the host, exactly as the engine calls it. Variants:

* ``current``: ``jaxprm.serve.programs`` as the engine runs it (layers unrolled on CPU);
* ``scan``: the current program with the layers in a ``lax.scan`` (``unroll_layers=False``);
* ``anchor``: the ``ModelRunner`` of ``--anchor REV`` (``benchmarks.anchor.load_anchor``) over the
  same weights (``--anchor ''`` skips it).

Reported per variant and batch: best and median milliseconds per call, generated tok/s of the best,
compile seconds; and ``os.getloadavg()`` (this machine is shared: compare numbers taken together).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from benchmarks._harness import loadavg  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402

from jaxprm.models import load_model  # noqa: E402
from jaxprm.serve import Engine  # noqa: E402
from jaxprm.serve.programs import ModelRunner, decode_input_shapes  # noqa: E402
from jaxprm.serve.sampler import Sampler  # noqa: E402


def decode_inputs(B: int, window: int, block_size: int, position: int, temperature: float) -> dict[str, np.ndarray]:
    """Decode inputs of ``B`` active rows at ``position``, row ``b`` on blocks ``1 + b nb ..``."""
    nb = window // block_size
    inp = {k: np.zeros(v.shape, v.dtype) for k, v in decode_input_shapes(B, nb).items()}
    inp["token"][:] = np.arange(B) % 1000 + 5
    inp["position"][:] = position
    inp["active"][:] = True
    inp["remaining"][:] = 1 << 20
    inp["temperature"][:] = temperature
    inp["top_p"][:] = 1.0
    inp["stop_ids"][:] = -1
    inp["key_data"][:, 0] = np.arange(B)
    inp["tables"][:] = 1 + np.arange(B)[:, None] * nb + np.arange(nb)[None, :]
    return inp


def _runner(cls, sampler: Sampler, num_blocks: int, block_size: int, **kw):
    return cls(sampler.graphdef, sampler.rest, sampler.config, num_blocks=num_blocks, block_size=block_size,
               cache_dtype=sampler.cache_dtype, **kw)


def bench(model_name: str, batches, window: int, position: int, repeats: int, anchor: str | None, steps_list=None):
    model, tok = load_model(model_name)
    sampler = Sampler(model, eos_token_ids=tok.eos_token_ids, max_batch=max(batches))
    engine_steps = Engine(sampler, max_batch=max(batches), kv_cache_tokens=window).decode_steps
    steps_list = list(steps_list or [engine_steps])
    params, _ = sampler.snapshot()
    bs = 16
    old = None
    if anchor:
        from benchmarks.anchor import load_anchor

        old = load_anchor(anchor, ("jaxprm/__init__.py", "jaxprm/modes.py", "jaxprm/learner", "jaxprm/models",
                                   "jaxprm/serve"))
        import importlib

        old = importlib.import_module(f"{old.__name__}.serve.programs")
    rows = []
    for B in batches:
        nblocks = B * (window // bs) + 1
        variants = {"current": _runner(ModelRunner, sampler, nblocks, bs),
                    "scan": _runner(ModelRunner, sampler, nblocks, bs, unroll_layers=False)}
        if old is not None:
            variants["anchor"] = _runner(old.ModelRunner, sampler, nblocks, bs)
        for steps, temperature in [(k, t) for k in steps_list for t in (0.0, 1.0)]:
            inp = decode_inputs(B, window, bs, position - steps, temperature)
            compile_s = {}
            for name, r in variants.items():
                t0 = time.perf_counter()
                r.decode(params, inp, steps=steps, top_n=0, filtering=False)
                compile_s[name] = time.perf_counter() - t0
            times = {name: [] for name in variants}
            for _ in range(repeats):
                for name, r in variants.items():
                    t0 = time.perf_counter()
                    r.decode(params, inp, steps=steps, top_n=0, filtering=False)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                best = min(ts)
                row = dict(variant=name, batch=B, temperature=temperature, steps=steps, window=window,
                           best_ms=1e3 * best, median_ms=1e3 * float(np.median(ts)),
                           tokens_per_s=B * steps / best, first_call_s=compile_s[name], loadavg=loadavg())
                rows.append(row)
                print(f"  B={B:3d} k={steps} T={temperature:.0f} {name:8s}: best {row['best_ms']:8.1f} ms, median "
                      f"{row['median_ms']:8.1f} ms, {row['tokens_per_s']:8.1f} tok/s (first call "
                      f"{row['first_call_s']:.1f} s), load {row['loadavg'][0]}", flush=True)
        del variants
    return dict(model=model_name, params=model.num_params(), decode_steps=engine_steps, rows=rows)


def print_table(res) -> None:
    print(f"\n{res['model']}: one decode call of k steps (engine default k = {res['decode_steps']}), best ms "
          "(generated tok/s) and time relative to current")
    names = list(dict.fromkeys(r["variant"] for r in res["rows"]))
    print(f"{'batch':>5s} {'k':>3s} {'temp':>4s} " + " ".join(f"{n:>22s}" for n in names))
    keys = list(dict.fromkeys((r["batch"], r["steps"], r["temperature"]) for r in res["rows"]))
    for b, k, t in keys:
        cells = {r["variant"]: r for r in res["rows"] if (r["batch"], r["steps"], r["temperature"]) == (b, k, t)}
        cur = cells["current"]["best_ms"]
        print(f"{b:>5d} {k:>3d} {t:>4.0f} " + " ".join(
            f"{cells[n]['best_ms']:8.1f} ({cells[n]['tokens_per_s']:6.0f}) {cells[n]['best_ms'] / cur:4.2f}x"
            for n in names))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--window", type=int, default=256, help="KV window per row (a window bucket)")
    p.add_argument("--position", type=int, default=180, help="position every row's last step writes")
    p.add_argument("--steps", default="", help="decode steps per call, e.g. 1,4 (default: the engine's choice)")
    p.add_argument("--anchor", default="main", help="git revision whose engine is timed too ('' to skip)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    load_start = loadavg()  # the machine and versions: write_result's provenance
    print(f"decode programs of {args.model} (anchor {args.anchor or 'none'}) ...", flush=True)
    res = bench(args.model, [int(b) for b in args.batches.split(",")], args.window, args.position, args.repeats,
                args.anchor or None, [int(k) for k in args.steps.split(",") if k])
    res.update(anchor=args.anchor, loadavg_start=load_start, loadavg_end=loadavg())
    print_table(res)
    if args.json:
        write_result(args.json, res)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
