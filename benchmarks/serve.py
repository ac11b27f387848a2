"""Generation-server benchmark: our engine vs Hugging Face ``generate`` (and llama.cpp), and PaTR
rollouts with the prefix cache on vs off.

    python -m benchmarks.serve [--json PATH] [--models tiny,smollm2-135m] [--concurrency 1,8,32,64]
                               [--hf-batches 1,32] [--skip-hf] [--skip-patr] [--anchor llamacpp]

1. **Server levels** (per model): an in-process server (``ServerHandle``, continuous batching, prefix
   cache on) on 127.0.0.1; per concurrency ``c``, ``c`` asyncio clients in a child process (so the
   load generator does not share the server's GIL) each send ``--requests-per-client``
   ``/v1/completions`` back to back: the chat prompt of ``PROMPT_MESSAGES`` made distinct per request
   by a suffix (every request shares the template's system and user text, as RL rollouts share
   their system prompt), greedy, ``max_tokens`` with ``ignore_eos``. Each level first runs once
   untimed, then timed, after every decode and prefill shape the levels can meet was compiled ahead
   of time; ``recompiles`` counts programs compiled during the timed run (should be 0). Reported: generated tok/s, prompt + generated tok/s, latency p50 / p90,
   mean time to first token (server metric), mean rows per decode call, prompt tokens served from
   the prefix cache. The concurrencies in ``--no-cache-levels`` run again with the cache off (the
   like-for-like comparison with transformers, which has none).
2. **Hugging Face transformers** ``generate`` (PyTorch eager, float32, SDPA attention; on CUDA when
   torch sees a GPU, ``--hf-device``) on ``--hf-model`` (the same GGUF, or the same directory, e.g.
   a ``benchmarks.shape_twin`` on a machine the GGUF cannot reach) with the same prompts, greedy,
   exactly ``max_tokens`` new tokens, batches of ``--hf-batches`` (left padding), warm.
3. **PaTR rollouts** (``--skip-patr`` to skip): ``python -m jaxprm.train steps=0`` warm-starts the
   default tiny policy and exports it; then the default PaTR setting (``rollout.*`` of the default
   config: 8 groups of budget 8, B0 = 4, K, M, top-k, the progress branch scorer) is rolled out
   against the embedded server for ``--patr-rounds`` rounds with the prefix cache on and off
   (alternating, same seeds): prefilled prompt tokens, cached tokens and wall time per round.
4. **llama.cpp** (``--anchor llamacpp``): llama-cpp-python's OpenAI server (found in this
   environment, else built from source: ``find_or_build_llamacpp``) on SmolLM2's GGUF, the Q4_1
   file our engine dequantizes, ``--anchor-threads`` threads; the same clients, prompts and levels
   as section 1 (one warm-up round per level), and ours / llama.cpp per concurrency.

Every section records ``os.getloadavg()`` (this machine is shared: compare numbers taken under
similar load).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import httpx  # noqa: E402

from benchmarks._harness import free_port, loadavg, wait_healthy  # noqa: E402
from benchmarks.provenance import write_result  # noqa: E402
from jaxprm.models import load_model  # noqa: E402
from jaxprm.serve import ServerHandle  # noqa: E402
from jaxprm.serve.sampling import buckets_up_to  # noqa: E402

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


def _prompt_text(tok) -> str:
    return tok.apply_chat_template(PROMPT_MESSAGES, add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------------------------------------
# 1. server levels

async def _run_level(url: str, model_name: str, prompt: str, concurrency: int, per_client: int, max_tokens: int,
                     tag: str):
    latencies: list[float] = []
    tokens = prompt_tokens = cached = 0

    async def worker(cid: int, client: httpx.AsyncClient):
        nonlocal tokens, prompt_tokens, cached
        for j in range(per_client):
            body = dict(model=model_name, prompt=prompt + f"Episode {tag}-{cid}-{j}.", max_tokens=max_tokens,
                        temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            usage = r.json()["usage"]
            tokens += usage["completion_tokens"]
            prompt_tokens += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0  # llama.cpp: none

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, client) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return dict(concurrency=concurrency, requests=len(latencies), tokens=tokens, wall_s=wall,
                tokens_per_s=tokens / wall, prompt_plus_generated_tokens_per_s=(tokens + prompt_tokens) / wall,
                latency_median_s=statistics.median(latencies), latency_p90_s=_percentile(latencies, 0.9),
                latency_max_s=max(latencies),
                prompt_tokens=prompt_tokens, cached_prompt_tokens=cached)


def _level_main(args):
    return asyncio.run(_run_level(*args))


def _run_level_in_child(*args):
    """Run the load generator in a separate process so that it does not share the server's GIL."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_level_main, (args,))


def bench_server(name: str, *, concurrency, no_cache_levels, per_client: int, max_tokens: int, max_batch: int,
                 decode_steps: int | None):
    t0 = time.perf_counter()
    model, tok = load_model(name)
    load_s = time.perf_counter() - t0
    prompt = _prompt_text(tok)
    result = dict(model=name, params=model.num_params(), prompt_tokens=len(tok.encode(prompt)),
                  max_tokens=max_tokens, load_s=load_s, loadavg_start=loadavg())
    with ServerHandle.start(model, tok, model_name=name, sampler_kwargs={"max_batch": max_batch},
                            decode_steps=decode_steps) as server:
        engine = server.engine
        result["kv_cache_tokens"] = engine.kv_cache_tokens
        result["decode_steps"] = engine.decode_steps
        # Compile every decode batch bucket and prefill shape the levels can meet (packing depends on
        # timing), so that the timed runs measure the steady state.
        longest = result["prompt_tokens"] + 16 + max_tokens + engine.decode_steps
        windows = [w for w in engine.window_buckets if w < longest] + [
            next(w for w in engine.window_buckets if w >= longest)]
        sizes = [b for b in engine.batch_buckets if b <= max([*concurrency, *no_cache_levels])]
        # The requests share the chat template's blocks: shared-prefix decode programs for them too.
        a, b = (tok.encode(prompt + f"Episode {x}.") for x in ("a-0-0", "b-1-1"))
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shared = common // engine.block_size * engine.block_size
        own = range(result["prompt_tokens"] - shared, longest - shared + 1, engine.block_size)
        result["precompile_s"] = engine.precompile(batch_sizes=sizes, windows=windows, shared_windows=[shared] if shared else [],
                                                   own_windows=list(own) if shared else None)
        result["shared_prefix_attention"] = engine.shared_prefix_attention
        result["precompiled_programs"] = engine.num_compilations
        print(f"  {name}: precompiled {engine.num_compilations} programs in {result['precompile_s']:.0f} s",
              flush=True)
        levels = []
        plan = [(c, True) for c in concurrency] + [(c, False) for c in no_cache_levels]
        for c, cache in plan:
            engine.set_prefix_caching(cache).result(60)
            t0 = time.perf_counter()
            for i in range(3):  # until a round compiles nothing new (the cache state settles too)
                n0 = engine.num_compilations
                _run_level_in_child(server.url, name, prompt, c, per_client, max_tokens, f"warm{i}-{c}{cache}")
                if engine.num_compilations == n0:
                    break
            warm_s = time.perf_counter() - t0
            st = engine.stats
            b0, r0, n0, sp0 = st.batches, st.rows, engine.num_compilations, st.shared_prefix_calls
            ttft_sum0, ttft_n0 = _ttft(engine, name)
            level = _run_level_in_child(server.url, name, prompt, c, per_client, max_tokens, f"run{c}{cache}")
            ttft_sum, ttft_n = _ttft(engine, name)
            level.update(prefix_cache=cache, warmup_s=warm_s, recompiles=engine.num_compilations - n0,
                         shared_prefix_calls=st.shared_prefix_calls - sp0,
                         mean_rows_per_batch=(st.rows - r0) / max(1, st.batches - b0),
                         ttft_mean_s=(ttft_sum - ttft_sum0) / max(1, ttft_n - ttft_n0), loadavg=loadavg())
            levels.append(level)
            print(f"  {name}: concurrency {c:3d} (cache {'on' if cache else 'off'}): {level['tokens_per_s']:8.1f} "
                  f"tok/s, p50 latency {level['latency_median_s']:.2f} s, TTFT {level['ttft_mean_s']:.2f} s, "
                  f"{level['mean_rows_per_batch']:.1f} rows/step, recompiles {level['recompiles']}, "
                  f"load {level['loadavg'][0]}", flush=True)
        engine.set_prefix_caching(True).result(60)
        result["levels"] = levels
        result["compilations"] = engine.num_compilations
    return result


def _ttft(engine, name: str) -> tuple[float, float]:
    """(sum, count) of the engine's time-to-first-token histogram."""
    reg, labels = engine.metrics.registry, {"model_name": engine.metrics.model_name}
    return (reg.get_sample_value("jaxprm:time_to_first_token_seconds_sum", labels) or 0.0,
            reg.get_sample_value("jaxprm:time_to_first_token_seconds_count", labels) or 0.0)


# ---------------------------------------------------------------------------------------------
# 2. Hugging Face transformers

def bench_hf(name: str, batches, max_tokens: int, device: str = "auto"):
    """transformers ``generate`` on ``name``: ``"smollm2-135m"`` (its GGUF) or a Hugging Face directory
    (e.g. a ``benchmarks.shape_twin``), float32, on ``device`` (``auto``: CUDA when torch sees it)."""
    import torch
    import transformers

    from jaxprm.models import smollm2_gguf_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if name == "smollm2-135m":
        g = smollm2_gguf_path()
        src, kw_src = g.parent, dict(gguf_file=g.name)
    elif Path(name).is_dir():
        src, kw_src = Path(name), {}
    else:
        raise ValueError(f"the transformers comparison runs on smollm2-135m or a model directory, not {name!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = transformers.AutoTokenizer.from_pretrained(src, **kw_src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, **kw_src, dtype=torch.float32).eval().to(device)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    prompt = tok.apply_chat_template(PROMPT_MESSAGES, add_generation_prompt=True, tokenize=False)
    out = dict(model=name, device=device, torch=torch.__version__, transformers=transformers.__version__,
               torch_threads=torch.get_num_threads(), attn_implementation=model.config._attn_implementation,
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, batches=[])
    for b in batches:
        enc = tok([prompt + f"Episode hf-{b}-{i}." for i in range(b)], return_tensors="pt", padding=True,
                  add_special_tokens=False).to(device)
        kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        with torch.inference_mode():
            model.generate(**enc, **kw)  # warm
            sync()
            t0 = time.perf_counter()
            gen = model.generate(**enc, **kw)
            sync()
            wall = time.perf_counter() - t0
        n = (gen.shape[1] - enc["input_ids"].shape[1]) * b
        row = dict(batch=b, tokens=n, wall_s=wall, tokens_per_s=n / wall, loadavg=loadavg())
        out["batches"].append(row)
        print(f"  transformers generate: batch {b:3d}: {row['tokens_per_s']:8.1f} tok/s ({wall:.2f} s), "
              f"load {row['loadavg'][0]}", flush=True)
    return out


# ---------------------------------------------------------------------------------------------
# 3. PaTR rollouts, prefix cache on vs off

def bench_patr(rounds: int, workdir: Path):
    from rollout.chat import PromptBuilder
    from rollout.client import GenerationClient
    from rollout.tree import run_groups

    from jaxprm.train import adapters
    from jaxprm.train.config import load_config

    run = workdir / "patr_policy"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxprm.train", f"run_dir={run}", "steps=0", "eval.at_start=false",
                    "plots=false", "progress=false"], check=True, capture_output=True, text=True)
    warm_s = time.perf_counter() - t0
    # The trainer's own translations of the default config (tasks, env, tree, branch scorer, client).
    cfg = load_config(None, [])
    r, e, s = cfg.rollout, cfg.env, cfg.server
    model, tok = load_model(str(run / "policy"))
    ctx = model.config.max_position_embeddings
    tasks, _ = adapters.tasks(cfg)
    tree = adapters.tree_config(cfg, max_context=ctx)
    scorer = adapters.branch_scorer(cfg)
    env_factory = adapters.env_factory(cfg)
    out = dict(setting=dict(tasks_per_step=r.tasks_per_step, group_size=r.group_size, b0=r.b0, k=r.k, m=r.m,
                            top_k=r.top_k, max_new_tokens=r.max_new_tokens, max_turns=e.max_turns,
                            branch_scorer=r.branch_scorer.path), warm_start_s=warm_s, rounds=[])
    with ServerHandle.start(model, tok, host="127.0.0.1", port=0, config=s.serve_config(api_key=None),
                            sampler_kwargs={"max_batch": s.max_batch, "max_context": ctx,
                                            "batch_buckets": buckets_up_to(s.batch_buckets, s.max_batch)}) as server:
        engine = server.engine
        windows = [w for w in engine.window_buckets if w <= 1024]
        # every batch and prefill shape, in the decode variant the rollout client asks for
        out["precompile_s"] = engine.precompile(windows=windows, top_logprobs=s.dialect == "vllm",
                                                filtering=r.temperature > 0 and r.top_p < 1.0)

        async def one_round(i: int, cache: bool):
            engine.set_prefix_caching(cache).result(60)
            st = engine.stats
            p0, c0, q0, n0 = st.prefill_tokens, st.cached_tokens, st.prompt_tokens, engine.num_compilations
            client_cfg = cfg.server.client_config([server.url], api_key=None)
            batch = [tasks[(i * r.tasks_per_step + j) % len(tasks)] for j in range(r.tasks_per_step)]
            async with GenerationClient(client_cfg) as client:
                t0 = time.perf_counter()
                groups = await run_groups(batch, env_factory=env_factory, client=client,
                                          prompts=PromptBuilder(tok), config=tree, scorer=scorer,
                                          group_seed=1000 + i)
                wall = time.perf_counter() - t0
            leaves = [tuple(tuple(it.model_response.output_tokens.tolist()) for it in branch) for g in groups
                      for branch in g.tree.branches()]
            return dict(round=i, prefix_cache=cache, wall_s=wall, prompt_tokens=st.prompt_tokens - q0,
                        prefilled_tokens=st.prefill_tokens - p0, cached_tokens=st.cached_tokens - c0,
                        expanded=sum(g.stats.expanded for g in groups), pruned=sum(g.stats.pruned for g in groups),
                        sampled_actions=sum(g.stats.sampled_actions for g in groups), loadavg=loadavg(),
                        recompiles=engine.num_compilations - n0, branches=leaves)

        for i in range(3):  # warm-up until a round compiles nothing new
            n0 = engine.num_compilations
            asyncio.run(one_round(-1 - i, True))
            asyncio.run(one_round(-1 - i, False))
            if engine.num_compilations == n0:
                break
        for i in range(rounds):
            for cache in (True, False):
                row = asyncio.run(one_round(i, cache))
                out["rounds"].append(row)
                print(f"  PaTR round {i} cache {'on ' if cache else 'off'}: {row['wall_s']:.2f} s, prefilled "
                      f"{row['prefilled_tokens']} of {row['prompt_tokens']} prompt tokens "
                      f"(cached {row['cached_tokens']}), load {row['loadavg'][0]}", flush=True)
    for cache in (True, False):
        rows = [x for x in out["rounds"] if x["prefix_cache"] == cache]
        out["cache_on" if cache else "cache_off"] = dict(
            wall_s=sum(x["wall_s"] for x in rows), prefilled_tokens=sum(x["prefilled_tokens"] for x in rows),
            prompt_tokens=sum(x["prompt_tokens"] for x in rows))
    on, off = out["cache_on"], out["cache_off"]
    out["prefill_cut"] = off["prefilled_tokens"] / max(1, on["prefilled_tokens"])
    out["wall_speedup"] = off["wall_s"] / max(1e-9, on["wall_s"])
    # Same seeds on and off: branches differ only where float rounding flipped a sampled token.
    same = total = 0
    for a, b in zip(out["rounds"][0::2], out["rounds"][1::2]):
        common = set(a["branches"]) & set(b["branches"])
        same += len(common)
        total += len(a["branches"])
    for row in out["rounds"]:
        row["branches"] = len(row.pop("branches"))
    out["identical_branches_fraction"] = same / max(1, total)
    return out


# ---------------------------------------------------------------------------------------------

def print_table(results) -> None:
    print()
    print(f"{'model':14s} {'conc':>5s} {'cache':>5s} {'gen tok/s':>10s} {'all tok/s':>10s} {'p50 s':>8s} "
          f"{'p90 s':>8s} {'TTFT s':>8s} {'rows/step':>9s} {'cached %':>8s} {'load':>6s}")
    for r in results.get("server", []):
        for lv in r["levels"]:
            cached = 100.0 * lv["cached_prompt_tokens"] / max(1, lv["prompt_tokens"])
            print(f"{Path(r['model']).name[:14]:14s} {lv['concurrency']:>5d} {'on' if lv['prefix_cache'] else 'off':>5s} "
                  f"{lv['tokens_per_s']:>10.1f} {lv['prompt_plus_generated_tokens_per_s']:>10.1f} "
                  f"{lv['latency_median_s']:>8.2f} {lv['latency_p90_s']:>8.2f} {lv['ttft_mean_s']:>8.2f} "
                  f"{lv['mean_rows_per_batch']:>9.1f} {cached:>8.1f} {lv['loadavg'][0]:>6.2f}")
    hf = results.get("transformers")
    if hf:
        print()
        for b in hf["batches"]:
            print(f"transformers generate ({hf['model']}, batch {b['batch']}): {b['tokens_per_s']:.1f} tok/s "
                  f"(load {b['loadavg'][0]})")
    cmp = results.get("comparison")
    if cmp:
        print()
        for row in cmp:
            print(f"ours / transformers at {row['batch']:>3d} (cache {row['prefix_cache']}): {row['ratio']:.2f}x")
    ll = results.get("llamacpp")
    if ll:
        print()
        for lv in ll["levels"]:
            print(f"llama.cpp ({ll['gguf']}, {ll['threads']} threads) at {lv['concurrency']:>3d}: "
                  f"{lv['tokens_per_s']:.1f} tok/s")
        for row in results.get("llamacpp_comparison", []):
            print(f"ours / llama.cpp at {row['concurrency']:>3d}: {row['ours_over_llamacpp']:.2f}x")
    patr = results.get("patr")
    if patr:
        print()
        print(f"PaTR rollouts ({len(patr['rounds']) // 2} rounds): prefilled tokens {patr['cache_off']['prefilled_tokens']}"
              f" -> {patr['cache_on']['prefilled_tokens']} ({patr['prefill_cut']:.2f}x less), wall "
              f"{patr['cache_off']['wall_s']:.1f} s -> {patr['cache_on']['wall_s']:.1f} s "
              f"({patr['wall_speedup']:.2f}x); identical branches on/off: "
              f"{100 * patr['identical_branches_fraction']:.0f}%")


# ---------------------------------------------------------------------------------------------
# 4. llama.cpp (the CPU user's single-stream reference)

LLAMACPP_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
LLAMACPP_VERSION = "0.3.36"


def find_or_build_llamacpp() -> str:
    """The installed ``llama_cpp`` version; else build llama-cpp-python ``LLAMACPP_VERSION`` from
    source into this environment (~18 minutes on 2 cores) with ``LLAMACPP_CMAKE_ARGS`` (no native
    tuning: some VMs advertise AMX and trap on it), plus its server's extras."""
    try:
        import llama_cpp

        return llama_cpp.__version__
    except ImportError:
        pass
    print(f"  building llama-cpp-python {LLAMACPP_VERSION} from source (~18 min on 2 cores) ...", flush=True)
    env = dict(os.environ, CMAKE_ARGS=LLAMACPP_CMAKE_ARGS)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"llama-cpp-python[server]=={LLAMACPP_VERSION}"],
                   check=True, env=env)
    import llama_cpp

    return llama_cpp.__version__


def bench_llamacpp(*, concurrency, per_client: int, max_tokens: int, threads: int) -> dict:
    """llama-cpp-python's OpenAI server on SmolLM2's GGUF (the file our engine loads), ``threads``
    threads, the same prompts and clients as the server levels (greedy, ``max_tokens``); it serves
    requests one after another."""
    from jaxprm.models.loading import smollm2_gguf_path

    version = find_or_build_llamacpp()
    _, tok = load_model("smollm2-135m")
    prompt = _prompt_text(tok)
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()), "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", str(threads), "--n_ctx", "2048", "--model_alias", "smollm2-135m"]
    log = tempfile.TemporaryFile("w+")  # llama.cpp logs a lot: a pipe nobody reads would block it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, proc, timeout=300, path="/v1/models")
        except RuntimeError as e:
            log.seek(0)
            raise RuntimeError(f"llama.cpp server: {e}: {log.read()[-2000:]}") from None
        levels = []
        for c in concurrency:
            _run_level_in_child(url, "smollm2-135m", prompt, c, 1, max_tokens, f"llwarm-{c}")
            level = _run_level_in_child(url, "smollm2-135m", prompt, c, per_client, max_tokens, f"llrun-{c}")
            level["loadavg"] = loadavg()
            levels.append(level)
            print(f"  llama.cpp: concurrency {c:3d}: {level['tokens_per_s']:8.1f} tok/s, p50 latency "
                  f"{level['latency_median_s']:.2f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    return dict(engine="llama.cpp", llama_cpp_python=version, gguf=smollm2_gguf_path().name, threads=threads,
                cmake_args=LLAMACPP_CMAKE_ARGS, levels=levels)


def _per_model(spec: str, name: str, default: int) -> int:
    """``"64"`` -> 64; ``"tiny=64,smollm2-135m=32"`` -> the value for ``name`` (else ``default``)."""
    if "=" not in spec:
        return int(spec)
    table = {k.strip(): int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    return table.get(name, default)


def _ints(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",") if x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2-135m")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--no-cache-levels", default="1,32", help="concurrencies rerun with the prefix cache off")
    p.add_argument("--requests-per-client", default="tiny=4,smollm2-135m=1",
                   help="requests each client sends per level: an int, or name=int pairs")
    p.add_argument("--max-tokens", default="tiny=64,smollm2-135m=32",
                   help="tokens per request: an int, or name=int pairs")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=None, help="default: the engine's choice")
    p.add_argument("--hf-batches", default="1,32")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--hf-model", default="smollm2-135m",
                   help="the model of --models that transformers runs too (smollm2-135m or a directory)")
    p.add_argument("--hf-device", default="auto", help="torch device for transformers (auto: cuda if present)")
    p.add_argument("--skip-patr", action="store_true")
    p.add_argument("--patr-rounds", type=int, default=3)
    p.add_argument("--anchor", default="", choices=("", "llamacpp"),
                   help="llamacpp: also run llama-cpp-python's server on the same GGUF (found, or built from source)")
    p.add_argument("--anchor-threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    results: dict = dict(loadavg_start=loadavg(), server=[])  # the machine and versions: write_result's provenance
    models = [m for m in args.models.split(",") if m]
    for name in models:
        print(f"benchmarking the server on {name} ...", flush=True)
        results["server"].append(bench_server(
            name, concurrency=_ints(args.concurrency), no_cache_levels=_ints(args.no_cache_levels),
            per_client=_per_model(args.requests_per_client, name, 1),
            max_tokens=_per_model(args.max_tokens, name, 32), max_batch=args.max_batch,
            decode_steps=args.decode_steps))
    if not args.skip_hf and args.hf_model in models:
        print("benchmarking transformers generate ...", flush=True)
        hf = results["transformers"] = bench_hf(args.hf_model, _ints(args.hf_batches),
                                                 _per_model(args.max_tokens, args.hf_model, 32), args.hf_device)
        ours = next(r for r in results["server"] if r["model"] == args.hf_model)
        results["comparison"] = [
            dict(batch=b["batch"], prefix_cache=lv["prefix_cache"], ratio=lv["tokens_per_s"] / b["tokens_per_s"])
            for b in hf["batches"] for lv in ours["levels"] if lv["concurrency"] == b["batch"]]
    if args.anchor == "llamacpp":
        print("benchmarking llama.cpp on the same GGUF ...", flush=True)
        results["llamacpp"] = bench_llamacpp(concurrency=_ints(args.concurrency),
                                             per_client=_per_model(args.requests_per_client, "smollm2-135m", 1),
                                             max_tokens=_per_model(args.max_tokens, "smollm2-135m", 32),
                                             threads=args.anchor_threads)
        ours = next((r for r in results["server"] if r["model"] == "smollm2-135m"), None)
        if ours is not None:
            results["llamacpp_comparison"] = [
                dict(concurrency=ll["concurrency"], ours_over_llamacpp=lv["tokens_per_s"] / ll["tokens_per_s"])
                for ll in results["llamacpp"]["levels"] for lv in ours["levels"]
                if lv["concurrency"] == ll["concurrency"] and lv["prefix_cache"]]
    if not args.skip_patr:
        print("benchmarking PaTR rollouts (prefix cache on / off) ...", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            results["patr"] = bench_patr(args.patr_rounds, Path(tmp))
    results["loadavg_end"] = loadavg()
    print_table(results)
    if args.json:
        write_result(args.json, results)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
