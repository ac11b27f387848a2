"""The training loop: rollout -> process rewards -> filter -> export -> advantages -> PPO step -> sync.

``train(cfg, resume=False)`` runs a whole job and returns a :class:`Summary`. One step:

1. ``tasks_per_step`` training maps (a seeded permutation per pass over the task list; the position
   is checkpointed) are rolled out as groups with ``rollout.tree.run_groups`` (flat / tree_random /
   patr) against the generation server.
2. If process rewards are active, ``scorers.PRMRunner.score_branches`` scores every root-to-leaf
   branch of each group's tree; a rejected group is dropped (reason counted).
3. An optional group filter (``scorers.filter_mixed_or_penalized_all_wrong[_mask_no_eos]``).
4. ``rollout.export.export_groups`` -> a fixed-shape ``jaxprm.Batch`` (rows padded to the
   capacity, length to ``ppo.len_buckets``) -> ``jaxprm.compute_advantages``.
5. The jitted PPO step (``jaxprm.train.step.TrainStep``) under the configured mesh.
6. New weights to the server: in-process swap (embedded) or ``save_pretrained`` +
   ``POST /update_weights_from_disk`` (external).
7. Periodic held-out evaluation, metrics rows, checkpoints (orbax, async, keep last N).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxprm.train.config import TrainConfig, dump_yaml

__all__ = ["TrainError", "Summary", "train", "build_advantage_config"]


class TrainError(RuntimeError):
    """A run could not start or continue (bad model path, unreachable server, bad run dir ...)."""


@dataclasses.dataclass
class Summary:
    run_dir: str
    steps: int
    warm_start: dict[str, Any]
    first_eval: dict[str, Any] | None
    last_eval: dict[str, Any] | None
    wall_s: float
    timings: dict[str, float]

    def describe(self) -> str:
        lines = [f"run dir: {self.run_dir}", f"steps: {self.steps}  wall: {self.wall_s:.0f}s"]
        if self.warm_start:
            lines.append("warm start: " + json.dumps({k: self.warm_start[k] for k in
                         ("demo_success", "sft_loss_last", "cached", "seconds") if k in self.warm_start}))
        for name, ev in (("first eval", self.first_eval), ("last eval", self.last_eval)):
            if ev:
                lines.append(f"{name} (step {ev.get('step')}): " + ", ".join(
                    f"{k}={v:.3f}" for k, v in ev.items() if isinstance(v, float)))
        if self.first_eval and self.last_eval:
            d = self.last_eval.get("success", 0.0) - self.first_eval.get("success", 0.0)
            lines.append(f"sampled success change: {d * 100:+.1f} points")
        lines.append("time: " + ", ".join(f"{k}={v:.0f}s" for k, v in self.timings.items()))
        return "\n".join(lines)


def build_advantage_config(cfg: TrainConfig):
    """``jaxprm.AdvantageConfig`` from the ``advantage`` and ``prm`` sections."""
    import jaxprm

    a = cfg.advantage
    sh = cfg.prm.advantage_shaping
    return jaxprm.AdvantageConfig(
        reward_scale=a.reward_scale, reward_bias=a.reward_bias, reward_clip=a.reward_clip,
        group_reward_norm=a.group_reward_norm, group_reward_std=a.group_reward_std,
        kl_ctl=a.kl_ctl, kl_estimator=a.kl_estimator, gamma=a.gamma, lam=a.lam, gae_method=a.gae_method,
        adv_mean_level=a.adv_mean_level, adv_std_level=a.adv_std_level, adv_unbiased=a.adv_unbiased,
        adv_eps=a.adv_eps, shaping_mode=sh.mode if cfg.prm.active else None,
        negative_scale=sh.negative_scale, zero_penalty=sh.zero_penalty, zero_eps=sh.zero_eps,
        token_rewards_as_adv=a.token_rewards_as_adv, mask_no_eos_with_zero=a.mask_no_eos_with_zero,
    )


# ----------------------------------------------------------------------------------------------
# setup helpers
# ----------------------------------------------------------------------------------------------


def _init_distributed(cfg: TrainConfig) -> None:
    d = cfg.distributed
    if not d.enabled:
        return
    kw = {}
    if d.coordinator_address is not None:
        kw = dict(coordinator_address=d.coordinator_address, num_processes=d.num_processes, process_id=d.process_id)
    try:
        jax.distributed.initialize(**kw)
    except Exception as e:
        raise TrainError(f"distributed: jax.distributed.initialize failed: {e}") from e


def env_factory(cfg: TrainConfig):
    """A zero-argument constructor of the configured environment (``env.system_prompt`` and
    ``env.invalid_ends_episode`` applied)."""
    from rollout.envs.frozenlake import COMPACT_SYSTEM_PROMPT, SYSTEM_PROMPT, FrozenLakeEnv

    prompt = {"compact": COMPACT_SYSTEM_PROMPT, "full": SYSTEM_PROMPT, "none": None}[cfg.env.system_prompt]
    return functools.partial(FrozenLakeEnv, prompt, invalid_ends_episode=cfg.env.invalid_ends_episode)


def _load_policy(cfg: TrainConfig):
    from flax import nnx

    from jaxprm.models import Transformer, load_model, tiny_config
    from jaxprm.train.policy import Policy

    try:
        model, tok = load_model(cfg.model.name, dtype=cfg.model.dtype, seed=cfg.seed)
    except FileNotFoundError as e:
        raise TrainError(f"model.name={cfg.model.name!r}: {e}") from None
    if cfg.model.overrides:
        if cfg.model.name != "tiny":
            raise TrainError("model.overrides only applies to the 'tiny' preset")
        try:
            mc = tiny_config(vocab_size=tok.vocab_size, param_dtype=cfg.model.dtype).replace(**cfg.model.overrides)
        except (TypeError, ValueError) as e:
            raise TrainError(f"model.overrides: {e}") from None
        model = Transformer(mc, rngs=nnx.Rngs(cfg.seed))
    return Policy(model, tok)


def _row_capacity(cfg: TrainConfig, n_devices: int) -> int:
    r = cfg.rollout
    per_group = r.group_size if r.strategy == "flat" else (r.max_branches or r.group_size)
    cap = cfg.ppo.max_rows or r.tasks_per_step * per_group
    mult = math.lcm(cfg.ppo.num_minibatches, n_devices)
    return int(-(-cap // mult) * mult)


def _prepare_run_dir(cfg: TrainConfig, resume: bool) -> Path:
    run_dir = Path(cfg.run_dir)
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise TrainError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        base, i = run_dir, 1
        while run_dir.exists() and any(run_dir.iterdir()):
            run_dir = base.with_name(f"{base.name}-{i}")
            i += 1
        cfg.run_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    return run_dir


async def _check_server(url: str, retries: int, timeout: float, api_key: str | None) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last: Exception | None = None
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as http:
        for attempt in range(retries + 1):
            try:
                for path in ("/health", "/v1/models"):
                    r = await http.get(url.rstrip("/") + path)
                    if r.status_code < 500 and r.status_code != 404:
                        return
                last = RuntimeError(f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                last = e
            if attempt < retries:
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
    raise TrainError(f"generation server {url} unreachable after {retries + 1} attempts: "
                     f"{type(last).__name__}: {last}")


class _TaskStream:
    """Training tasks in a seeded permutation per pass; ``pos`` counts tasks consumed."""

    def __init__(self, tasks: list, seed: int, pos: int = 0) -> None:
        self.tasks, self.seed, self.pos = tasks, seed, pos

    def take(self, n: int) -> list:
        out = []
        N = len(self.tasks)
        for _ in range(n):
            epoch, i = divmod(self.pos, N)
            perm = np.random.default_rng([self.seed, epoch]).permutation(N)
            out.append(self.tasks[perm[i]])
            self.pos += 1
        return out


# ----------------------------------------------------------------------------------------------
# the job
# ----------------------------------------------------------------------------------------------


class _Job:
    def __init__(self, cfg: TrainConfig, resume: bool, log) -> None:
        self.cfg, self.resume, self.log = cfg, resume, log
        self.timings: dict[str, float] = {"warm_start": 0.0, "rollout": 0.0, "score": 0.0, "learn": 0.0,
                                          "sync": 0.0, "eval": 0.0, "checkpoint": 0.0}

    # -- setup --------------------------------------------------------------------------------
    def setup(self) -> None:
        import jaxprm
        from rollout.envs.frozenlake import make_tasks

        from jaxprm.train.rundir import Checkpointer, MetricsLog
        from jaxprm.train.step import TrainStep, make_mesh, make_optimizer

        cfg = self.cfg
        _init_distributed(cfg)
        self.run_dir = _prepare_run_dir(cfg, self.resume)
        self.policy = _load_policy(cfg)
        e = cfg.env
        self.train_tasks, self.eval_tasks = make_tasks(e.seed, e.train_tasks, e.eval_tasks, sizes=(e.size,),
                                                       p_frozen=e.p, max_turns=e.max_turns,
                                                       random_start_goal=e.random_start_goal)
        self.eval_tasks = self.eval_tasks[: cfg.eval.num_tasks]
        self.env_factory = env_factory(cfg)
        try:
            self.mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
        except ValueError as err:
            raise TrainError(f"mesh: {err}") from None
        n_dev = self.mesh.devices.size
        self.capacity = _row_capacity(cfg, n_dev)
        self.step_fn = TrainStep(
            self.policy.apply_fn, make_optimizer(cfg), jaxprm.policy_loss,
            epochs=cfg.ppo.epochs, num_minibatches=cfg.ppo.num_minibatches,
            loss_kwargs=dict(eps_clip=cfg.ppo.eps_clip, eps_clip_higher=cfg.ppo.eps_clip_higher,
                             c_clip=cfg.ppo.c_clip, agg=cfg.ppo.agg),
            mesh=self.mesh if n_dev > 1 else None, microbatch_rows=cfg.ppo.microbatch_rows,
        )
        self.adv_cfg = build_advantage_config(cfg)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save)

        # Warm start (fresh runs only: a resumed run restores its params from the checkpoint).
        self.warm_report: dict[str, Any] = {}
        restore_step = self.ckpt.latest_step() if self.resume else None
        if self.resume and restore_step is None:
            self.log(f"resume: no checkpoint in {self.run_dir}; starting from step 0")
        if cfg.warm_start.enabled and restore_step is None:
            from jaxprm.train.warmstart import warm_start

            t0 = time.perf_counter()
            params, self.warm_report = warm_start(cfg, self.policy, self.train_tasks, env_factory=self.env_factory,
                                                  log=self.log)
            self.policy.params = params
            self.timings["warm_start"] = time.perf_counter() - t0
        self.ref_params = None
        if cfg.advantage.kl_ctl > 0:
            self.ref_params = jax.tree.map(jnp.copy, self.policy.params)
        self.state = self.step_fn.init_state(self.policy.params)
        self.base_key = jax.random.key(cfg.seed)
        self.start_step, data_pos, meta = 0, 0, {}
        if restore_step is not None:
            target = {"train": self.state, "rng": jax.random.key_data(self.base_key)}
            if self.ref_params is not None:
                target["ref"] = self.ref_params
            step, restored, meta = self.ckpt.restore(target, restore_step)
            self.state = restored["train"]
            self.base_key = jax.random.wrap_key_data(restored["rng"])
            self.ref_params = restored.get("ref", self.ref_params)
            self.start_step, data_pos = step, int(meta.get("data_pos", 0))
            self.warm_report = meta.get("warm_start", {})
            self.policy.params = self.state.params
            self.log(f"resumed from step {step} ({self.run_dir})")
        self.metrics = MetricsLog(self.run_dir, resume_step=self.start_step if self.resume else None)
        self.stream = _TaskStream(self.train_tasks, cfg.seed, data_pos)
        rows = _read_rows(self.run_dir)
        self.history = [r for r in rows if r.get("kind") == "eval"]
        if restore_step is None and self.warm_report and not any(r.get("kind") == "warm_start" for r in rows):
            self.metrics.log(0, "warm_start", {k: v for k, v in self.warm_report.items()
                                                if isinstance(v, (int, float, bool))})

    # -- server ---------------------------------------------------------------------------------
    async def start_server(self) -> None:
        from rollout.chat import PromptBuilder
        from rollout.client import ClientConfig, GenerationClient

        cfg, s = self.cfg, self.cfg.server
        self.server = None
        if s.kind == "embedded":
            from jaxprm.serve import ServerHandle

            ctx = self.policy.config.max_position_embeddings
            self.server = ServerHandle.start(
                self.policy.module(self._server_params()), self.policy.tokenizer, host="127.0.0.1", port=0,
                model_name="jaxprm", sampler_kwargs={"max_batch": s.max_batch, "max_context": ctx},
                collect_window_s=s.batch_window_ms / 1000.0)
            urls = [self.server.url]
            self.log(f"embedded server on {self.server.url}")
        else:
            urls = list(s.urls)
            for u in urls:
                await _check_server(u, s.max_retries, min(s.timeout_s, 10.0), s.api_key)
        self.client = GenerationClient(ClientConfig(
            endpoints=tuple(urls), dialect=s.dialect, model=s.model_name or "jaxprm", timeout_s=s.timeout_s,
            max_retries=s.max_retries, max_concurrency=s.concurrency, require_tokens=s.token_backed))
        self.prompts = PromptBuilder(self.policy.tokenizer)
        self.max_context = self.policy.config.max_position_embeddings
        if s.kind == "external" and self.start_step > 0:
            await self.sync_weights(self.start_step)

    def _server_params(self):
        return jax.tree.map(jnp.copy, self.policy.params)  # the train step donates its own copy

    async def sync_weights(self, step: int) -> None:
        t0 = time.perf_counter()
        s = self.cfg.server
        if self.server is not None:
            self.server.update_weights(self._server_params(), version=step)
        else:
            import httpx

            from jaxprm.models import save_pretrained

            out = Path(s.weight_sync_dir or (self.run_dir / "weights")).absolute() / f"step-{step}"
            save_pretrained(self.policy.module(), self.policy.tokenizer, out)
            headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
            async with httpx.AsyncClient(timeout=s.timeout_s, headers=headers) as http:
                for u in s.urls:
                    for attempt in range(s.max_retries + 1):
                        try:
                            r = await http.post(u.rstrip("/") + "/update_weights_from_disk", json={"model_path": str(out)})
                            if r.status_code < 300:
                                break
                            err = f"HTTP {r.status_code}: {r.text[:200]}"
                        except httpx.HTTPError as e:
                            err = f"{type(e).__name__}: {e}"
                        if attempt == s.max_retries:
                            raise TrainError(f"update_weights_from_disk on {u} failed: {err}")
                        await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
            prev = out.parent / f"step-{step - 1}"
            if prev.exists():
                shutil.rmtree(prev, ignore_errors=True)
        self.timings["sync"] += time.perf_counter() - t0

    async def stop_server(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            await client.aclose()
        if getattr(self, "server", None) is not None:
            self.server.stop()

    # -- pieces of a step -----------------------------------------------------------------------
    def tree_config(self, step: int):
        from rollout.client import SamplingParams
        from rollout.tree import TreeConfig

        r, cfg = self.cfg.rollout, self.cfg
        return TreeConfig(
            strategy=r.strategy, group_size=r.group_size, b0=r.b0, k=r.k, m=r.m, top_k=r.top_k, alpha=r.alpha,
            theta=r.theta, max_turns=cfg.env.max_turns, max_branches=r.max_branches or r.group_size,
            refill=r.refill, group_mode=r.keep,
            sampling=SamplingParams(max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p),
            max_context_tokens=self.max_context, seed=cfg.seed)

    def branch_scorer(self):
        if self.cfg.rollout.strategy != "patr":
            return None
        from rollout.tree import ScorerAdapter
        from scorers.runner import resolve_scorer_class

        try:
            cls = resolve_scorer_class(self.cfg.rollout.branch_scorer, where="rollout.branch_scorer")
        except Exception as e:
            raise TrainError(f"rollout.branch_scorer={self.cfg.rollout.branch_scorer!r}: {e}") from None
        return ScorerAdapter(cls())

    async def score(self, groups) -> tuple[list, list, dict[str, float]]:
        """Process rewards per group (PRM active) and the group filter; returns kept groups."""
        from scorers import (ScoringRejected, filter_mixed_or_penalized_all_wrong,
                             filter_mixed_or_penalized_all_wrong_mask_no_eos)

        stats: dict[str, float] = {}
        rewards: list = [None] * len(groups)
        if self.prm is not None:
            kept_g, kept_r = [], []
            for g in groups:
                try:
                    sc = await self.prm.score_branches(g.tree, {"task": g.task})
                except ScoringRejected as e:
                    stats["prm_rejected_groups"] = stats.get("prm_rejected_groups", 0) + 1
                    self.log(f"process rewards rejected group {g.group_key}: {e}")
                    continue
                self.prm_metrics.merge(sc.metrics)
                kept_g.append(g)
                kept_r.append(sc.token_rewards)
            groups, rewards = kept_g, kept_r
        f = self.cfg.rollout.filter
        if f != "none":
            fn = (filter_mixed_or_penalized_all_wrong if f == "mixed_or_penalized_all_wrong"
                  else filter_mixed_or_penalized_all_wrong_mask_no_eos)
            counters: dict[str, int] = {}
            kept_g, kept_r = [], []
            for g, pr in zip(groups, rewards):
                samples = []
                for lf in g.leaves:
                    tr = None
                    if pr is not None and lf.leaf_id in pr:
                        parts = [np.asarray(v, np.float32) for v in pr[lf.leaf_id].values()]
                        tr = np.concatenate(parts) if parts else None
                    samples.append({"reward": lf.outcome_reward, "token_rewards": tr, "truncated": lf.truncated})
                if fn(samples, counters=counters):
                    kept_g.append(g)
                    kept_r.append(pr)
            for k, v in counters.items():
                stats[f"filter/{k}"] = v
            groups, rewards = kept_g, kept_r
        return groups, rewards, stats

    def learn(self, groups, rewards, step: int) -> dict[str, float]:
        import jaxprm

        if self.cfg.rollout.export == "tree_packed":
            from jaxprm.train.packed import learn_packed

            return learn_packed(self, groups, rewards, step)
        from rollout.export import export_groups

        from jaxprm.train.step import gather_logprobs, step_inputs

        batch, meta = export_groups(
            groups, process_rewards=rewards if self.prm is not None else None,
            row_buckets=(self.capacity,), len_buckets=tuple(self.cfg.ppo.len_buckets), min_rows=self.capacity)
        if self.ref_params is not None:
            T = batch.tokens.shape[1]
            pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), batch.tokens.shape)
            ref = _ref_logprobs(self.policy.apply_fn, self.ref_params, batch.tokens, pos)
            batch = batch.replace(ref_logprobs=ref * batch.loss_mask)
        adv = jaxprm.compute_advantages(batch, self.adv_cfg)
        data = step_inputs(batch, adv.advantages)
        key = jax.random.fold_in(self.base_key, step)
        self.state, m = self.step_fn(self.state, data, key)
        self.policy.params = self.state.params
        out = {k: float(v) for k, v in jax.device_get(m).items()}
        out["rows"] = len(meta)
        out["seq_len"] = int(batch.tokens.shape[1])
        out["adv_abs_mean"] = float(jnp.sum(jnp.abs(adv.advantages) * batch.loss_mask) / jnp.maximum(batch.loss_mask.sum(), 1))
        if self.prm is not None:
            pr = batch.process_rewards
            out["process_reward_mean"] = float(jnp.sum(pr) / jnp.maximum(batch.loss_mask.sum(), 1))
        return out

    async def run_eval(self, step: int) -> dict[str, float]:
        from jaxprm.train.evaluate import evaluate

        t0 = time.perf_counter()
        ev = self.cfg.eval
        res = await evaluate(self.eval_tasks, client=self.client, prompts=self.prompts, env_factory=self.env_factory,
                             samples=ev.samples, temperature=ev.temperature, greedy=ev.greedy,
                             max_turns=self.cfg.env.max_turns, max_new_tokens=self.cfg.rollout.max_new_tokens,
                             seed=self.cfg.seed, max_context_tokens=self.max_context)
        dt = time.perf_counter() - t0
        self.timings["eval"] += dt
        res["eval_s"] = dt
        row = self.metrics.log(step, "eval", res)
        self.history.append(row)
        return res

    def checkpoint(self, step: int) -> None:
        t0 = time.perf_counter()
        self.metrics.sync()  # rows of this step are durable before its checkpoint starts
        tree = {"train": self.state, "rng": jax.random.key_data(self.base_key)}
        if self.ref_params is not None:
            tree["ref"] = self.ref_params
        self.ckpt.save(step, tree, {"step": step, "data_pos": self.stream.pos, "warm_start": self.warm_report})
        self.timings["checkpoint"] += time.perf_counter() - t0

    # -- main -----------------------------------------------------------------------------------
    async def run(self) -> Summary:
        from rollout.export import describe_groups
        from rollout.tree import run_groups
        from tqdm import tqdm

        from jaxprm.train import plots

        cfg = self.cfg
        t_start = time.perf_counter()
        await self.start_server()
        self.prm = None
        if cfg.prm.active:
            from scorers import MetricsAccumulator, PRMRunner

            from jaxprm.train.compat import prm_config_dict

            try:
                self.prm = await PRMRunner.create(prm_config_dict(cfg))
            except Exception as e:
                raise TrainError(f"prm: could not build the scorers: {type(e).__name__}: {e}") from e
            self.prm_metrics = MetricsAccumulator()
        scorer = self.branch_scorer()
        first_eval = next((r for r in self.history), None)
        last_eval = self.history[-1] if self.history else None
        example_tree = None
        try:
            if self.start_step == 0 and cfg.eval.at_start and not any(r["step"] == 0 for r in self.history):
                res = await self.run_eval(0)
                first_eval = last_eval = {"step": 0, **res}
                self.log(f"eval @0 (warm-started policy): " + _fmt(res))
            bar = tqdm(total=cfg.steps, initial=self.start_step, disable=not cfg.progress, dynamic_ncols=True,
                       desc="train")
            step = self.start_step
            while step < cfg.steps:
                step += 1
                t0 = time.perf_counter()
                tasks = self.stream.take(cfg.rollout.tasks_per_step)
                groups = await run_groups(tasks, env_factory=self.env_factory, client=self.client, prompts=self.prompts,
                                          config=self.tree_config(step), scorer=scorer, group_seed=step * 10_000)
                t1 = time.perf_counter()
                self.timings["rollout"] += t1 - t0
                desc = describe_groups(groups)
                if cfg.rollout.strategy != "flat":
                    cand = max(groups, key=lambda g: (g.stats.expanded + g.stats.pruned, g.stats.successes))
                    if example_tree is None or cand.stats.expanded + cand.stats.pruned >= \
                            example_tree.stats.expanded + example_tree.stats.pruned:
                        example_tree = cand
                kept, rewards, fstats = await self.score(groups)
                t2 = time.perf_counter()
                self.timings["score"] += t2 - t1
                row: dict[str, Any] = {
                    "reward": float(np.mean([lf.outcome_reward for g in groups for lf in g.leaves] or [0.0])),
                    "success": desc["success_rate"], "groups_with_success": desc["groups_with_success"],
                    "mixed_groups": desc["mixed_groups"], "trajectories": desc["trajectories"],
                    "sampled_actions": desc["sampled_actions"], "invalid_rate": desc["invalid_rate"],
                    "expanded": desc["expanded"], "pruned": desc["pruned"],
                    "loop_stopped": desc["loop_stopped"], "refills": desc["refills"],
                    "generated_tokens": desc["generated_tokens"], "kept_groups": len(kept), **fstats,
                }
                if kept:
                    row.update(self.learn(kept, rewards, step))
                else:
                    self.state = dataclasses.replace(self.state, step=self.state.step + 1)
                    row["skipped"] = True
                t3 = time.perf_counter()
                self.timings["learn"] += t3 - t2
                await self.sync_weights(step)
                row.update(rollout_s=t1 - t0, learn_s=t3 - t2, step_s=time.perf_counter() - t0)
                if self.prm is not None:
                    row.update({f"prm/{k}": v for k, v in self.prm_metrics.summary().items()})
                    from scorers import MetricsAccumulator

                    self.prm_metrics = MetricsAccumulator()
                self.metrics.log(step, "train", row)
                if step % cfg.eval.every_steps == 0 or step == cfg.steps:
                    res = await self.run_eval(step)
                    last_eval = {"step": step, **res}
                    first_eval = first_eval or last_eval
                    tqdm.write(f"eval @{step}: " + _fmt(res)) if cfg.progress else self.log(f"eval @{step}: " + _fmt(res))
                if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps:
                    self.checkpoint(step)
                bar.set_postfix(succ=f"{row['success']:.2f}", loss=f"{row.get('loss', 0.0):.3f}",
                                ev=f"{(last_eval or {}).get('success', float('nan')):.2f}", refresh=False)
                bar.update(1)
            bar.close()
            self.ckpt.wait()
            if cfg.plots:
                try:
                    plots.training_curves(self.run_dir / "metrics.jsonl", self.run_dir / "plots" / "training.png")
                    if example_tree is not None:
                        plots.tree_png(example_tree, self.run_dir / "plots" / "patr_tree.png")
                except Exception as e:  # plots never fail a finished run
                    self.log(f"plots failed: {type(e).__name__}: {e}")
            if cfg.export_final:
                from jaxprm.models import save_pretrained

                save_pretrained(self.policy.module(), self.policy.tokenizer, self.run_dir / "policy")
        finally:
            if self.prm is not None:
                await self.prm.aclose()
            await self.stop_server()
            self.metrics.close()
            self.ckpt.close()
        if first_eval is not None and "step" in first_eval:
            first_eval = {k: v for k, v in first_eval.items() if k != "kind"}
        if last_eval is not None:
            last_eval = {k: v for k, v in last_eval.items() if k != "kind"}
        summary = Summary(run_dir=str(self.run_dir), steps=cfg.steps, warm_start=self.warm_report,
                          first_eval=first_eval, last_eval=last_eval, wall_s=time.perf_counter() - t_start,
                          timings=self.timings)
        (self.run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1, default=str))
        return summary


_REF_CACHE: dict = {}


def _ref_logprobs(apply_fn, params, tokens, pos):
    from jaxprm.train.step import gather_logprobs

    fn = _REF_CACHE.get(id(apply_fn))
    if fn is None:
        fn = jax.jit(lambda p, t, q: gather_logprobs(apply_fn(p, t, q), t))
        _REF_CACHE[id(apply_fn)] = fn
    return fn(params, tokens, pos)


def _read_rows(run_dir: Path) -> list[dict]:
    from jaxprm.train.rundir import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def _fmt(res: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in res.items() if isinstance(v, float) and not k.endswith("_s"))


def train(cfg: TrainConfig, *, resume: bool = False, log=None) -> Summary:
    """Run (or resume) a training job; see the module docstring."""
    log = log or (lambda msg: print(msg, flush=True))
    job = _Job(cfg, resume, log)
    job.setup()
    return asyncio.run(job.run())
