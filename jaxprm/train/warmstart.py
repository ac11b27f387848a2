"""Supervised warm start: noisy FrozenLake demonstrations -> a mediocre but format-following policy.

RL from a random tiny model would never see a valid action, let alone a success. An instruct model
already emits valid actions sometimes; this stage gives the tiny model that starting point:

1. Demonstrations: for ``num_demos`` training maps, play an episode where each move is the
   BFS-optimal one with probability ``optimal_prob`` and a uniformly random action otherwise
   (so demos fall into holes and wander). Each assistant reply is ```` ```Action``` ````.
2. Each episode is tokenized exactly as a rollout would see it (``rollout.chat.PromptBuilder``:
   first prompt, then sampled tokens + template continuation per turn); the loss mask covers the
   assistant tokens (reply + end-of-turn).
3. SFT: token-mean cross-entropy on the masked tokens, AdamW, ``steps`` updates of ``batch_size``
   episodes, length-bucketed so only a few shapes compile.

The result is cached under ``cache_dir/<hash>/params.npz`` keyed by a hash of everything that
determines it (model, env, warm-start settings, and the demonstrations themselves, made first:
~1 s), so later runs skip the SFT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxprm.learner.batch import RowData, pad_rows
from jaxprm.models import next_token_logprobs
from jaxprm.train.config import config_hash
from rollout.chat import PromptBuilder
from rollout.envs.base import ACTIONS
from rollout.envs.frozenlake import FrozenLakeEnv

__all__ = ["Demo", "make_demos", "demo_row", "sft", "sft_batch_rows", "warm_start", "warm_start_key", "params_digest"]


@dataclasses.dataclass
class Demo:
    tokens: list[int]
    mask: list[float]
    success: bool
    turns: int


async def _play(task, prompts, rng: random.Random, optimal_prob: float, env_factory,
                imitate_noise: bool = True) -> Demo:
    env = env_factory()
    obs = await env.reset(task)
    messages: list[dict[str, Any]] = []
    sp = env.system_prompt(task)
    if sp:
        messages.append({"role": "system", "content": sp})
    messages.append({"role": "user", "content": obs})
    tokens = list(prompts.initial(messages))
    mask = [0.0] * len(tokens)
    eos = prompts.eos_token_id
    success, turns = False, 0
    while True:
        opt = env.optimal_actions()
        action = rng.choice(opt) if opt and rng.random() < optimal_prob else rng.choice(ACTIONS)
        # the env's answer format (a tool call's arguments after the prompts' prefill), else a fenced move
        text = env.demo_answer(action) if hasattr(env, "demo_answer") else f"```{action}```"
        sampled = list(prompts.tokenizer.encode(text)) + [eos]
        tokens += sampled
        supervised = imitate_noise or action in opt
        mask += [1.0 if supervised else 0.0] * len(sampled)
        res = await env.step(text)
        turns += 1
        if res.done:
            success = bool(res.info.get("success"))
            break
        new = [{"role": res.role, "content": res.observation}]
        cont = prompts.continuation(messages, text, new, sampled)
        messages += [{"role": "assistant", "content": text}, *new]
        tokens += cont
        mask += [0.0] * len(cont)
    return Demo(tokens=tokens, mask=mask, success=success, turns=turns)


def make_demos(tasks, tokenizer, *, n: int, optimal_prob: float, seed: int, env_factory=None,
               imitate_noise: bool = True, prompts: PromptBuilder | None = None) -> list[Demo]:
    """``n`` noisy demonstration episodes on ``tasks`` (cycled), tokenized like rollouts.

    ``env_factory`` builds the environment (default ``FrozenLakeEnv()``); use the one rollouts use,
    so that demonstrations carry the same system prompt. ``imitate_noise=False`` keeps the random
    moves in the episodes (they still steer it into holes and detours) but out of the loss mask.
    ``prompts``: the rollouts' ``PromptBuilder`` (default: a plain one over ``tokenizer``), so that a
    tool-call format's tools and prefill are in the demonstrations too.
    """
    env_factory = env_factory or FrozenLakeEnv

    prompts = prompts or PromptBuilder(tokenizer)
    rng = random.Random(seed)

    async def go():
        return [await _play(tasks[i % len(tasks)], prompts, rng, optimal_prob, env_factory, imitate_noise)
                for i in range(n)]

    return asyncio.run(go())


def demo_row(d: Demo) -> RowData:
    toks = np.asarray(d.tokens, np.int32)
    return RowData(tokens=toks, loss_mask=np.asarray(d.mask, np.float32), logprobs=np.zeros(len(toks), np.float32),
                   outcome_reward=float(d.success), group_id=0)


def sft_batch_rows(T: int, batch_size: int, max_batch_tokens: int | None) -> int:
    """Rows of an SFT batch padded to length ``T``: ``batch_size``, or with a token budget
    ``min(batch_size, max(1, max_batch_tokens // T))``."""
    return batch_size if max_batch_tokens is None else min(batch_size, max(1, max_batch_tokens // T))


def sft(apply_fn, params, demos: list[Demo], *, steps: int, batch_size: int, lr: float, seed: int,
        len_buckets=(256, 384, 512, 640, 768, 1024, 2048, 4096), max_batch_tokens: int | None = None,
        log=None, frozen: Any = None) -> tuple[Any, list[float]]:
    """Masked next-token cross-entropy SFT; returns ``(params, losses)``. ``frozen``: weights
    ``apply_fn`` needs but SFT does not train (LoRA's base): it then gets ``(params, frozen)``.

    Loss per batch: ``-sum_t mask[b,t] log p(tokens[b,t+1] | tokens[b,:t+1]) / sum mask`` (prediction
    positions; ``mask`` covers the assistant tokens). Each step draws one length bucket (in
    proportion to its demos) and :func:`sft_batch_rows` demos of it; with ``max_batch_tokens`` the
    buckets are the multiples of 256 (``len_buckets`` unused), so a batch pads little.
    """
    if max_batch_tokens is not None:
        len_buckets = tuple(range(256, 256 * (-(-max(len(d.tokens) for d in demos) // 256)) + 1, 256))
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps, lr * 0.1),
                                 weight_decay=0.0))
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    # Bucket demos by padded length so each minibatch has one of a few shapes.
    lens = np.array([len(d.tokens) for d in demos])
    buckets: dict[int, list[int]] = {}
    for i, L in enumerate(lens):
        b = next((x for x in sorted(len_buckets) if L <= x), int(-(-L // 1024) * 1024))
        buckets.setdefault(b, []).append(i)
    keys = sorted(buckets)
    weights = np.array([len(buckets[k]) for k in keys], np.float64)
    weights /= weights.sum()

    def loss_fn(p, fr, tokens, mask):
        T = tokens.shape[1]
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), tokens.shape)
        lp = next_token_logprobs(apply_fn(p if fr is None else (p, fr), tokens, pos), tokens)
        return -(lp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    @jax.jit
    def update(p, o, fr, tokens, mask):
        loss, g = jax.value_and_grad(loss_fn)(p, fr, tokens, mask)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    losses = []
    for s in range(steps):
        b = keys[rng.choice(len(keys), p=weights)]
        rows = sft_batch_rows(b, batch_size, max_batch_tokens)
        idx = rng.choice(buckets[b], size=rows, replace=len(buckets[b]) < rows)
        batch = pad_rows([demo_row(demos[i]) for i in idx], row_buckets=(rows,), len_buckets=(b,))
        params, opt_state, loss = update(params, opt_state, frozen, batch.tokens, batch.loss_mask)
        if s % 25 == 0 or s == steps - 1:
            losses.append(float(loss))
            if log is not None:
                log(s, float(loss))
    return params, losses


def warm_start_key(key_data: dict[str, Any], demos: list[Demo]) -> str:
    """The cache key: a hash of the settings that determine the warm-started params
    (``jaxprm.train.adapters.warm_start_key_data``) and of the demonstrations' tokens and masks, so
    a change the settings do not name (an environment's rendering or rewards, a prompt, the
    tokenizer) misses the cache too."""
    h = hashlib.sha256()
    for d in demos:
        h.update(np.asarray(d.tokens, np.int64).tobytes())
        h.update(np.asarray(d.mask, np.float32).tobytes())
    return config_hash({**key_data, "demos_sha256": h.hexdigest()})


def params_digest(params) -> str:
    """sha256 of every leaf's path, dtype, shape and bytes: two runs with the same digest start from
    bit-identical parameters (what a comparison paired by warm start relies on)."""
    h = hashlib.sha256()
    for k, v in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.asarray(v)
        h.update(f"{jax.tree_util.keystr(k)}:{a.dtype}:{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _save_npz(path: Path, params) -> None:
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **flat)
    tmp.replace(path)


def _load_npz(path: Path, like) -> Any:
    data = np.load(path)
    leaves = []
    for k, v in jax.tree_util.tree_flatten_with_path(like)[0]:
        arr = data[jax.tree_util.keystr(k)]
        if arr.shape != v.shape:
            raise ValueError(f"cached warm start {path}: {jax.tree_util.keystr(k)} has shape {arr.shape}, expected {v.shape}")
        leaves.append(jnp.asarray(arr, v.dtype))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)


def warm_start(w, policy, train_tasks, *, key_data: dict[str, Any], env_factory=None,
               prompts: PromptBuilder | None = None, log=print) -> tuple[Any, dict[str, Any]]:
    """Warm-started params for ``policy`` (cached under :func:`warm_start_key` of ``key_data``) and a
    report dict; ``w`` is the warm-start section (demos, SFT steps, batch size, lr, seed, cache dir)."""
    t0 = time.perf_counter()
    demos = make_demos(train_tasks, policy.tokenizer, n=w.num_demos, optimal_prob=w.optimal_prob, seed=w.seed,
                       env_factory=env_factory, imitate_noise=w.imitate_noise, prompts=prompts)
    t_demo = time.perf_counter() - t0
    key = warm_start_key(key_data, demos)
    cache = Path(w.cache_dir).expanduser() / key
    pfile, rfile = cache / "params.npz", cache / "report.json"
    if pfile.is_file() and rfile.is_file():
        try:
            params = _load_npz(pfile, policy.params)
            report = json.loads(rfile.read_text())
            report["cached"] = True
            report["params_sha256"] = params_digest(params)  # of what was loaded (older caches lack it)
            log(f"warm start: loaded cached params from {cache}")
            return params, report
        except Exception as e:  # a corrupt cache is rebuilt, not fatal
            log(f"warm start: ignoring unreadable cache {cache}: {e}")
    log(f"warm start: {len(demos)} demos (success {np.mean([d.success for d in demos]):.2f}, "
        f"mean {np.mean([len(d.tokens) for d in demos]):.0f} tokens) in {t_demo:.1f}s; SFT {w.steps} steps")
    params, losses = sft(policy.apply_fn, policy.params, demos, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
                         max_batch_tokens=w.max_batch_tokens, frozen=policy.base,
                         seed=w.seed, log=lambda s, l: log(f"warm start: step {s} loss {l:.4f}") if s % 100 == 0 else None)
    report = {
        "key": key,
        "demos": len(demos),
        "demo_success": float(np.mean([d.success for d in demos])),
        "demo_turns": float(np.mean([d.turns for d in demos])),
        "demo_tokens": float(np.mean([len(d.tokens) for d in demos])),
        "sft_steps": w.steps,
        "sft_loss_first": losses[0],
        "sft_loss_last": losses[-1],
        "seconds": time.perf_counter() - t0,
        "cached": False,
        "params_sha256": params_digest(params),
    }
    cache.mkdir(parents=True, exist_ok=True)
    _save_npz(pfile, params)
    rfile.write_text(json.dumps(report, indent=1))
    return params, report
