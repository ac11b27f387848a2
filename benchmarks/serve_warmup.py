"""First-request latency at each concurrency, cold and warm, with and without the server's
background warm-up (``jaxprm.serve.warmup``).

    python -m benchmarks.serve_warmup [--model smollm2-135m] [--concurrency 1,8,32] [--max-tokens 32]
                                      [--json PATH]

Two fresh servers, each in its own process (127.0.0.1, ``max_batch`` the largest concurrency, JAX's
persistent cache and the executable store off, so that no program comes from the other server or
an earlier process):

* ``off``: no warm-up. Per concurrency ``c`` (ascending), ``c`` clients (a child process) each send
  one request at once: ``benchmarks.serve``'s chat prompt made distinct by a suffix, greedy,
  ``--max-tokens`` with ``ignore_eos``. The first round is **cold** (it meets its shapes first),
  then the same round again is **warm**.
* ``warmup``: ``warmup=True`` with ``warmup_max_len`` the prompt + output rounded up; the rounds start
  once the warm-up has finished (its programs and seconds are reported), and are timed the same way
  (first round, then again).

Reported per server and concurrency: latency p50 / max of the first and the repeated round, the
programs compiled during each round (0 means no compile inside a request), and the warm-up's
programs and seconds; ``os.getloadavg()``. The issue's goal: no compile inside a timed request at a
warmed concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks.provenance import write_result  # noqa: E402
from benchmarks._harness import loadavg  # noqa: E402
from benchmarks.serve import _prompt_text, _run_level_in_child  # noqa: E402
from jaxprm.models import load_model  # noqa: E402
from jaxprm.serve import ServerHandle  # noqa: E402
from jaxprm.serve.programs import num_compilations  # noqa: E402


def run_server(name: str, model, tok, *, warmup: bool, concurrency, max_tokens: int) -> dict:
    prompt = _prompt_text(tok)
    prompt_tokens = len(tok.encode(prompt)) + 8
    max_len = prompt_tokens + max_tokens
    out = dict(server="warmup" if warmup else "off", levels=[])
    with ServerHandle.start(model, tok, model_name=name, sampler_kwargs={"max_batch": max(concurrency)},
                            warmup=warmup, warmup_max_len=max_len) as server:
        if warmup:
            warm = server.app.state.server.warmup
            warm.wait()
            out.update(warmup_programs=warm.done, warmup_planned=warm.total, warmup_s=warm.seconds,
                       warmup_error=repr(warm.error) if warm.error else None)
            print(f"  warm-up: {warm.done}/{warm.total} programs in {warm.seconds:.0f} s", flush=True)
        for c in concurrency:
            level = dict(concurrency=c)
            for phase in ("first", "again"):
                n0 = num_compilations()
                r = _run_level_in_child(server.url, name, prompt, c, 1, max_tokens, f"{phase}-{c}")
                level[phase] = dict(latency_median_s=r["latency_median_s"], latency_max_s=r["latency_max_s"],
                                    tokens_per_s=r["tokens_per_s"], compiled=num_compilations() - n0)
            level["loadavg"] = loadavg()
            out["levels"].append(level)
            f, a = level["first"], level["again"]
            print(f"  {out['server']:6s} c={c:3d}: first p50 {f['latency_median_s']:6.2f} s (max "
                  f"{f['latency_max_s']:6.2f}, {f['compiled']} compiled), again p50 {a['latency_median_s']:6.2f} s "
                  f"(max {a['latency_max_s']:6.2f}, {a['compiled']} compiled)", flush=True)
    return out


def print_table(res: dict) -> None:
    print(f"\n{res['model']}: latency of one request per client (p50 / max seconds; programs compiled in the round)")
    print(f"{'server':>7s} {'c':>4s} {'first round':>26s} {'repeated round':>26s}")
    for srv in res["servers"]:
        for lv in srv["levels"]:
            f, a = lv["first"], lv["again"]
            print(f"{srv['server']:>7s} {lv['concurrency']:4d} "
                  f"{f['latency_median_s']:7.2f} / {f['latency_max_s']:6.2f} ({f['compiled']:3d}) "
                  f"{a['latency_median_s']:13.2f} / {a['latency_max_s']:6.2f} ({a['compiled']:3d})")
    for srv in res["servers"]:
        if "warmup_s" in srv:
            print(f"warm-up: {srv['warmup_programs']} of {srv['warmup_planned']} programs in {srv['warmup_s']:.0f} s")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_warmup", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--arm", choices=("off", "warmup"), default=None, help=argparse.SUPPRESS)  # one server (child)
    args = p.parse_args(argv)
    concurrency = sorted(int(c) for c in args.concurrency.split(","))
    if args.arm:
        import jax

        jax.config.update("jax_compilation_cache_dir", None)
        model, tok = load_model(args.model)
        out = run_server(args.model, model, tok, warmup=args.arm == "warmup", concurrency=concurrency,
                         max_tokens=args.max_tokens)
        with open(args.json, "w") as f:
            json.dump(out, f)
        return out
    res = dict(model=args.model, max_tokens=args.max_tokens, concurrency=concurrency,
               loadavg_start=loadavg(), servers=[])
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in ("off", "warmup"):
            print(f"{args.model}: server with warm-up {arm if arm == 'off' else 'on'} ...", flush=True)
            path = os.path.join(tmp, f"{arm}.json")
            subprocess.run([sys.executable, "-m", "benchmarks.serve_warmup", "--arm", arm, "--model", args.model,
                            "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--json", path],
                           check=True, env=env)
            with open(path) as f:
                res["servers"].append(json.load(f))
    res["wall_s"] = time.perf_counter() - t0
    res["loadavg_end"] = loadavg()
    print_table(res)
    if args.json:
        write_result(args.json, res)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
