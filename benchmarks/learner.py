"""Learner step, flat rows vs tree-packed rows: tokens forwarded per group and step time.

    python -m benchmarks.learner [--factors 1,2,4,8] [--patr-groups 16] [--repeats 3]
                                 [--json benchmarks/results/learner_cpu.json]

Cases:

* ``synthetic f=F``: ``--groups`` groups of ``--leaves`` leaves; each leaf is a shared prefix of
  ``P`` tokens (a 32-token prompt, then generated turns) plus its own ``--suffix`` generated tokens,
  with ``P`` chosen so that flat tokens / packed tokens = ``F`` exactly (``F = 1``: nothing shared).
* ``prompt P, suffix A-B`` (``--prompt-cases P:A:B,...``): flat GRPO's shape, ``--groups`` groups
  of ``--leaves`` leaves sharing only a ``P``-token prompt, each leaf's own tokens uniform in
  ``[A, B)``, laid out with the trainer's buckets (``ppo.len_buckets``, ``ppo.packed_len_buckets``,
  128 flat rows). These cases also report the learner's layout choice (``layout_costs``: the
  estimated packed / flat cost) against the measured times.
* ``patr default``: ``--patr-groups`` PaTR groups with the default trainer's rollout settings
  (4x4 FrozenLake, compact prompt, b0=4, k=5, m=2, top_k=2, 8 trajectories, refill) against the
  scripted navigator server (``rollout.testing``, test tokenizer); skipped with ``--no-patr``.

Both layouts run the same learner step with the trainer's defaults (the tiny policy, AdamW, 2 PPO
epochs x 4 minibatches, microbatches of 8 rows / the same token budget packed) on the same
advantages; the step time is the best of ``--repeats`` after compilation. ``ideal`` is flat tokens
/ packed tokens, ``efficiency`` = (flat time / packed time) / ideal. Each JSON records the load
average (``os.getloadavg()``) before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.provenance import write_result
import optax

import jaxprm
from jaxprm.learner.batch import RowData
from jaxprm.train.packed import PackedTrainStep, packed_row_buckets, packed_step_inputs
from jaxprm.train.policy import Policy
from jaxprm.train.step import TrainStep, step_inputs

LEN_BUCKETS = (64, 128, 256, 384, 512, 640, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def synthetic_rows(factor: float, *, groups: int, leaves: int, suffix: int, vocab: int, seed: int = 0) -> list[RowData]:
    """Star-shaped groups with sharing factor ``factor`` (flat tokens / packed tokens)."""
    rng = np.random.default_rng(seed)
    G, S = leaves, suffix
    P = 0 if factor <= 1 else int(round(S * G * (factor - 1) / (G - factor)))
    rows = []
    for g in range(groups):
        prefix = rng.integers(3, vocab, P)
        pmask = (np.arange(P) >= 32).astype(np.float32)
        plp = np.where(pmask > 0, -rng.random(P) * 2, 0.0).astype(np.float32)
        for i in range(G):
            # Distinct first suffix tokens (and first tokens when nothing is shared) keep leaves apart.
            suf = rng.integers(3, vocab, S)
            suf[0] = 3 + i
            toks = np.concatenate([prefix, suf]).astype(np.int32)
            mask = np.concatenate([pmask, np.ones(S, np.float32)])
            if P == 0:
                mask[0] = 0.0
            lp = np.concatenate([plp, -rng.random(S).astype(np.float32) * 2]) * mask
            rows.append(RowData(tokens=toks, loss_mask=mask, logprobs=lp.astype(np.float32),
                                outcome_reward=float(rng.random() < 0.5), group_id=g))
    return rows


def patr_rows(n_groups: int, seed: int = 0) -> tuple[list[RowData], dict[str, Any]]:
    """PaTR groups with the default trainer settings against the scripted navigator."""
    from benchmarks._harness import start_scripted_upstream
    from rollout.chat import PromptBuilder
    from rollout.client import ClientConfig, GenerationClient
    from rollout.envs import make_tasks
    from rollout.export import group_rows
    from rollout.stats import describe_groups
    from rollout.testing import make_test_tokenizer
    from rollout.tree import run_groups
    from scorers import FrozenLakeProgressScorer

    from jaxprm.train.config import TrainConfig
    from jaxprm.train.adapters import env_factory, tree_config

    cfg = dataclasses.replace(TrainConfig(), seed=seed)
    e = cfg.env
    tasks, _ = make_tasks(seed, n_groups, 0, sizes=(e.size,), p_frozen=e.p, max_turns=e.max_turns)
    tree = tree_config(cfg, max_context=None)  # the trainer's own mapping, so nothing is lost on the way
    proc, url = start_scripted_upstream("frozenlake", "--p-good", "0.6")
    try:
        async def go():
            async with GenerationClient(ClientConfig(endpoints=(url,), max_concurrency=64)) as client:
                return await run_groups(tasks, env_factory=env_factory(cfg), client=client,
                                        prompts=PromptBuilder(make_test_tokenizer()), config=tree,
                                        scorer=FrozenLakeProgressScorer(), group_seed=seed)

        groups = asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    rows = []
    for gid, g in enumerate(groups):
        rows += group_rows(g, gid)
    d = describe_groups(groups)
    return rows, {k: d[k] for k in ("groups", "trajectories", "generated_tokens", "expanded", "pruned", "refills")}


def _best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def prompt_rows(prompt: int, suffix: tuple[int, int], *, groups: int, leaves: int, vocab: int,
                seed: int = 0) -> list[RowData]:
    """Flat GRPO groups: ``leaves`` rows per group sharing a ``prompt``-token prefix (no loss on it),
    then ``U[suffix)`` tokens of their own (a tenth of them trained on, like actions among observations)."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        head = rng.integers(3, vocab, prompt)
        for i in range(leaves):
            own = rng.integers(3, vocab, int(rng.integers(*suffix)))
            own[0] = 3 + i
            toks = np.concatenate([head, own]).astype(np.int32)
            mask = np.concatenate([np.zeros(prompt, np.float32), (rng.random(len(own)) < 0.1).astype(np.float32)])
            rows.append(RowData(tokens=toks, loss_mask=mask, logprobs=(-rng.random(len(toks)) * mask).astype(np.float32),
                                outcome_reward=float(rng.random() < 0.5), group_id=g))
    return rows


def run_case(name: str, rows: list[RowData], policy: Policy, *, repeats: int, epochs: int, minibatches: int,
             micro_rows: int, trainer_buckets: bool = False) -> dict[str, Any]:
    """Flat and packed step times on ``rows``; ``trainer_buckets``: lay them out as the trainer does
    (its default length buckets and rows) and report its layout choice."""
    from jaxprm.train.adapters import row_capacity
    from jaxprm.train.config import TrainConfig
    from jaxprm.train.packed import layout_costs, prefer_packed

    n_groups = len({r.group_id for r in rows})
    trainer = TrainConfig()
    ppo = trainer.ppo
    flat_len, packed_len = ((tuple(ppo.len_buckets), tuple(ppo.packed_len_buckets)) if trainer_buckets
                            else (LEN_BUCKETS, LEN_BUCKETS))
    flat = jaxprm.pad_rows(rows, len_buckets=flat_len,
                           min_rows=row_capacity(trainer, 1) if trainer_buckets else minibatches * micro_rows)
    packed = jaxprm.pack_rows(rows, flat_shape=flat.shape, len_buckets=packed_len,
                              row_buckets=packed_row_buckets(minibatches))
    adv = jaxprm.compute_advantages(flat, jaxprm.AdvantageConfig(group_reward_norm=True)).advantages
    loss_kw = {"eps_clip": 0.2, "agg": "token-mean"}
    flat_step = TrainStep(policy.apply_fn, optax.adamw(1e-4), jaxprm.policy_loss, epochs=epochs,
                          num_minibatches=minibatches, loss_kwargs=loss_kw, microbatch_rows=micro_rows)
    # the trainer's packed microbatch: micro_rows rows of its longest flat bucket
    packed_step = PackedTrainStep.like(flat_step, microbatch_tokens=micro_rows * (
        max(ppo.len_buckets) if trainer_buckets else flat.shape[1]))
    fd = step_inputs(flat, adv)
    pd = packed_step_inputs(packed, flat, adv, agg="token-mean")
    key = jax.random.key(0)
    s_flat = flat_step.init_state(policy.params)
    s_pack = packed_step.init_state(policy.params)
    # The step donates its state: each call gets a fresh copy.
    t_flat = _best(lambda: flat_step(jax.tree.map(jnp.copy, s_flat), fd, key)[1]["loss"], repeats)
    t_pack = _best(lambda: packed_step(jax.tree.map(jnp.copy, s_pack), pd, key)[1]["loss"], repeats)
    flat_tokens = int(np.asarray(flat.seq_lens).sum())
    packed_tokens = int(np.asarray(packed.lengths).sum())
    ideal = flat_tokens / packed_tokens
    flat_cost, packed_cost = layout_costs(policy.config, flat.shape, packed.shape, packed.block_shape)
    choice = {"estimated_packed_over_flat": packed_cost / flat_cost,
              "chosen": "packed" if prefer_packed(flat_cost, packed_cost) else "flat",
              "faster": "packed" if t_pack < t_flat else "flat"} if trainer_buckets else {}
    return {
        "case": name, "groups": n_groups, "leaves": len(rows),
        "flat_tokens_per_group": flat_tokens / n_groups, "packed_tokens_per_group": packed_tokens / n_groups,
        "flat_shape": list(flat.shape), "packed_shape": list(packed.shape),
        "flat_forwarded": int(np.prod(flat.shape)), "packed_forwarded": int(np.prod(packed.shape)),
        "ideal_ratio": ideal, "flat_step_s": t_flat, "packed_step_s": t_pack, "speedup": t_flat / t_pack,
        "efficiency": t_flat / t_pack / ideal, **choice,
    }


HEAD = (f"{'case':<16}{'leaves':>7}{'flat tok/g':>11}{'packed tok/g':>13}{'flat BxT':>11}{'packed RxL':>11}"
        f"{'ideal':>7}{'flat s':>8}{'packed s':>9}{'speedup':>8}{'eff.':>6}")


def _row(r: dict[str, Any]) -> str:
    return (f"{r['case']:<16}{r['leaves']:>7}{r['flat_tokens_per_group']:>11.0f}{r['packed_tokens_per_group']:>13.0f}"
            f"{'x'.join(map(str, r['flat_shape'])):>11}{'x'.join(map(str, r['packed_shape'])):>11}"
            f"{r['ideal_ratio']:>7.2f}{r['flat_step_s']:>8.3f}{r['packed_step_s']:>9.3f}{r['speedup']:>8.2f}"
            f"{r['efficiency']:>6.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", default="1,2,4,8")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--patr-groups", type=int, default=16)
    ap.add_argument("--no-patr", action="store_true")
    ap.add_argument("--prompt-cases", default="", help="P:A:B,... flat GRPO groups: a P-token prompt shared, "
                    "own tokens in [A, B) (e.g. 200:150:700 Sokoban-like, 180:40:300 FrozenLake-like)")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the --factors cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--micro-rows", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from flax import nnx

    from jaxprm.models import Transformer, tiny_config

    load_before = os.getloadavg()
    policy = Policy(Transformer(tiny_config(), rngs=nnx.Rngs(0)))
    vocab = policy.config.vocab_size
    kw = dict(repeats=args.repeats, epochs=args.epochs, minibatches=args.minibatches, micro_rows=args.micro_rows)
    print(f"jax {jax.__version__} on {jax.default_backend()}; tiny policy; load {load_before[0]:.2f}")
    print(HEAD, flush=True)
    results = []
    if not args.no_patr:
        rows, info = patr_rows(args.patr_groups)
        results.append({**run_case("patr default", rows, policy, **kw), "rollout": info})
        print(_row(results[-1]), flush=True)
    for case in filter(None, args.prompt_cases.split(",")):
        P, A, B = (int(x) for x in case.split(":"))
        rows = prompt_rows(P, (A, B), groups=16, leaves=8, vocab=vocab)
        results.append(run_case(f"prompt {P}, suffix {A}-{B}", rows, policy, **kw, trainer_buckets=True))
        r = results[-1]
        print(_row(r) + f"  estimated packed/flat {r['estimated_packed_over_flat']:.2f}: chooses {r['chosen']}, "
              f"faster {r['faster']}", flush=True)
    for f in () if args.no_synthetic else (float(x) for x in args.factors.split(",")):
        rows = synthetic_rows(f, groups=args.groups, leaves=args.leaves, suffix=args.suffix, vocab=vocab)
        results.append(run_case(f"synthetic f={f:g}", rows, policy, **kw))
        print(_row(results[-1]), flush=True)
    out = {
        "machine": {"backend": jax.default_backend()},  # with write_result's machine facts
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "args": vars(args), "results": results,
    }
    if args.json:
        write_result(args.json, out)
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
