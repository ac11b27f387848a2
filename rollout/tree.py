"""Group rollouts: flat GRPO / DAPO, Tree-Random, PaTR and ARPO over one machinery (layer 4).

A *group* is every trajectory sampled for one task. All strategies share the same loop:

    A <- B0 fresh branches (flat, dapo: G);  C <- {}
    while A is not empty (or, with refill, free slots remain):
        advance every branch of A concurrently for up to K turns   (flat, dapo: until it ends; arpo: 1)
        move branches that ended (env done, max_turns, context full, theta-loop) to C
        if A is not empty (tree strategies only):
            tree_random / patr (a checkpoint):
                (theta_at="checkpoint": branches of A whose last theta actions are identical -> C, "loop")
                s_i = score(branch_i) in [0, 1]          (patr: branch scorer; tree_random: uniform)
                E = the top_k branches by score that fit under max_branches
                L = branches of A \\ E with s_i < median(s over A) - alpha    (pruned)
                A <- (A \\ (E u L)) u {M children of each e in E};  C <- C u L
            arpo (entropy-adaptive branching, after every turn = tool-call boundary):
                for each branch b of A in order, while free slots remain:
                    u ~ U(0, 1);  p = clip(u - w * (H_now(b) - H_init(b)), 0, 1)
                    if p <= branch_probability: add min(beam_size - 1, free) children of b to A
        if A is empty, refill and max_branches - |C| > 0:
            tree_random / patr: branch again from the best-scored checkpoint states seen so far
                (from the root if none), one slot at a time (up to B0 at once)
            arpo: restart one branch from the root (ARPO restarts a finished sample from its prompt)

``max_branches`` (default ``group_size``) is a hard cap on live + finished branches, so with refill a
tree group has exactly that many trajectories, the same budget as a flat group of that size (dead slots left by
branches that fell into holes early are refilled rather than lost). ``"dapo"`` rolls out exactly
like ``"flat"`` (DAPO's dynamic sampling and overlong shaping live in the trainer).

Theta rule: with ``theta_at="turn"`` (default) a branch whose last ``theta`` actions are identical
is stopped right after that turn, for every strategy (so that a loop does not burn the rest of an
interval); with ``theta_at="checkpoint"`` (the PaTR paper) the rule is checked only among the
active branches at a tree checkpoint, just before scoring, so flat / dapo / arpo groups never
loop-stop. Pruned and loop-stopped branches stay in the group as negatives under
``keep="keep_all"`` and are dropped under ``"best_n"``.

ARPO's entropy of a turn is the mean of the per-token entropies of its response's first
``arpo.entropy_tokens`` tokens (:attr:`rollout.client.Generated.entropies`, the top
``arpo.top_logprobs`` distribution renormalised; arpo requests ask for them); ``H_init`` is the
entropy of the first turn of a branch's lineage (children inherit it). The ``u`` draws come from a
generator seeded by (config seed, group seed, round index).

Children copy the parent's token prefix, messages and env state (``env.clone()``); all requests of a
group use one sticky route key, so a server with prefix caching sees siblings' shared prefixes.
Per-request seeds are derived from (config seed, group seed, branch id, turn), so a group is
reproducible against a deterministic server. Give every group of a training run its own
``group_seed`` (e.g. ``step * groups_per_step + i``): it also names the group's interactions.

Entry points: ``run_group`` / ``run_groups`` return :class:`GroupResult` (tree, the group's leaves,
:class:`GroupStats`); ``rollout.export.export_groups`` turns a list of them into a ``jaxprm.Batch``.
This module is the loop every strategy shares (the group runner); what each strategy does between
intervals is in ``rollout.strategies``; the configs and results are in ``rollout.groups``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from rollout.branches import Branch, gather
from rollout.chat import ChatTokenizer, PromptBuilder, check_extends
from rollout.client import GenerationClient
from rollout.envs.base import Env
from rollout.groups import (DROPPED_UNDER_BEST_N, GroupRejected, GroupResult, GroupStats, LeafRecord, RolloutError,
                            TreeConfig, request_seed)
from rollout.strategies import strategy_for
from rollout.types import Interaction, InteractionTree
from scorers import BaseScorer

__all__ = ["run_group", "run_groups"]


class _GroupRun:
    """One group being rolled out (the ``rollout.strategies.GroupRunner`` its strategy sees)."""

    def __init__(self, task: Any, env_factory: Callable[[], Env], client: GenerationClient, prompts: PromptBuilder,
                 config: TreeConfig, scorer: BaseScorer | None, group_seed: int, group_key: str):
        self.task, self.env_factory, self.client, self.prompts = task, env_factory, client, prompts
        self.cfg, self.group_seed, self.key = config, group_seed, group_key
        self.strategy = strategy_for(config, scorer)
        self.tree = InteractionTree()
        self.stats = GroupStats(strategy=config.strategy)
        self.finished: list[Branch] = []
        self._n_branches = 0
        self._sent_from: set[str | None] = set()
        self._root: Branch | None = None

    # ------------------------------------------------------------------ branches

    def _new_id(self) -> str:
        bid = f"b{self._n_branches}"
        self._n_branches += 1
        self.stats.branches_started += 1
        return bid

    async def root_branch(self, origin: str = "root") -> Branch:
        """A new branch from the task's first prompt (the env is reset once per group, then cloned)."""
        if self._root is None:
            env = self.env_factory()
            obs = await asyncio.wait_for(env.reset(self.task), self.cfg.env_timeout_s)
            system = env.system_prompt(self.task)
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": obs}]
            self._root = Branch(id="root", env=env, messages=msgs, prompt=self.prompts.initial(msgs), last_id=None,
                                depth=0, actions=[], reward=0.0, origin="root")
        b = self._root.fork(self._new_id(), origin)
        if origin == "root":
            self.stats.roots += 1
        else:
            self.stats.refills += 1
        return b

    def fork(self, parent: Branch, origin: str) -> Branch:
        """A copy of ``parent`` under a new id (``origin``: ``child`` or ``refill``), counted."""
        child = parent.fork(self._new_id(), origin)
        if origin == "refill":
            self.stats.refills += 1
        else:
            self.stats.children += 1
        return child

    async def _turn(self, b: Branch) -> None:
        cfg = self.cfg
        params = dataclasses.replace(self.strategy.sampling, seed=request_seed(cfg.seed, self.group_seed, b.id, b.depth))
        # Prefix-cache accounting: identical prompts share their parent interaction id.
        plen = len(b.prompt)
        if b.last_id in self._sent_from and plen > b.lineage_len:
            self.stats.sibling_shared_tokens += plen - b.lineage_len
            self.stats.cache_reusable_tokens += plen
        else:
            self.stats.cache_reusable_tokens += min(b.lineage_len, plen)
        self._sent_from.add(b.last_id)
        gen = await self.client.generate(b.prompt, params, route_key=self.key)
        t0 = time.perf_counter()
        resp = gen.response
        if resp.input_tokens.tolist() != b.prompt:
            raise RolloutError(f"branch {b.id}: the response's prompt differs from the prompt sent")
        text = gen.text if gen.text is not None else self.prompts.tokenizer.decode(resp.output_tokens)
        self.stats.sampled_actions += 1
        self.stats.generated_tokens += resp.output_len
        self.stats.prompt_tokens += plen
        self.stats.http_s += gen.http_s
        self.strategy.observe_turn(self, b, gen)
        t1 = time.perf_counter()
        step = await asyncio.wait_for(b.env.step(text), cfg.env_timeout_s)
        t2 = time.perf_counter()
        inter = Interaction(id=f"{self.key}/{b.id}/t{b.depth}", parent_id=b.last_id, messages=b.messages,
                            output_messages=[{"role": "assistant", "content": text}], model_response=resp,
                            reward=float(step.reward), env_state=dict(step.info))
        self.tree.add(inter)
        b.last_id = inter.id
        b.depth += 1
        b.reward += float(step.reward)
        b.truncated = resp.truncated
        b.actions.append(step.info.get("action", text.strip()))
        if step.info.get("valid") is False:
            self.stats.invalid_actions += 1
        b.lineage_len = plen + resp.output_len
        if step.done:
            if step.info.get("success"):
                b.status = "success"
            elif step.info.get("truncated"):
                b.status = "max_turns"
            else:  # the env ended it: on an invalid answer (info["valid"] False) or otherwise (a hole)
                b.status = "invalid" if step.info.get("valid") is False else "done"
        elif b.depth >= cfg.max_turns:
            b.stop("max_turns")
        elif cfg.theta_at == "turn" and b.loops(cfg.theta):
            b.stop("loop")
        else:
            new_msgs = [{"role": step.role, "content": step.observation}]
            tail = self.prompts.continuation(b.messages, text, new_msgs, resp.output_tokens)
            new_prompt = b.prompt + resp.output_tokens.tolist() + [int(t) for t in tail]
            check_extends(b.prompt, new_prompt)
            b.messages = [*b.messages, {"role": "assistant", "content": text}, *new_msgs]
            b.prompt = new_prompt
            if cfg.max_context_tokens is not None and len(new_prompt) + cfg.sampling.max_tokens > cfg.max_context_tokens:
                b.stop("context")
        self.stats.overhead_s += (t1 - t0) + (time.perf_counter() - t2) + gen.client_s

    async def _advance(self, b: Branch, turns: int) -> None:
        for _ in range(turns):
            await self._turn(b)
            if b.status is not None:
                return


    # ------------------------------------------------------------------ main loop

    def free_slots(self, n_active: int) -> int:
        """Branches the group may still start, with ``n_active`` live ones: budget - live - ended."""
        return self.cfg.budget - n_active - len(self.finished)

    def collect(self, active: list[Branch]) -> list[Branch]:
        """Move the ended branches of ``active`` to ``finished`` (counted by why); the live ones."""
        alive = []
        for b in active:
            if b.status is None:
                alive.append(b)
                continue
            self.finished.append(b)
            if b.status == "loop":
                self.stats.loop_stopped += 1
            elif b.status == "context":
                self.stats.context_stopped += 1
            else:
                self.stats.completed += 1
        return alive

    async def run(self) -> GroupResult:
        cfg, strategy = self.cfg, self.strategy
        t_start = time.perf_counter()
        active = [await self.root_branch() for _ in range(strategy.initial_branches)]
        index = 0
        while active:
            await gather([self._advance(b, strategy.interval) for b in active])
            active = self.collect(active)
            if active:
                active = await strategy.between(self, active, index)
                index += 1
            if not active and cfg.refill and self.free_slots(0) > 0:
                active = await strategy.refill(self)
        strategy.finish(self.stats)
        self.stats.wall_s = time.perf_counter() - t_start
        all_leaves = [LeafRecord(leaf_id=b.last_id, branch_id=b.id, outcome_reward=b.reward, status=b.status,
                                 turns=b.depth, truncated=b.truncated, origin=b.origin, score=b.score)
                      for b in self.finished if b.last_id is not None]
        group = [lf for lf in all_leaves
                 if cfg.keep == "keep_all" or lf.status not in DROPPED_UNDER_BEST_N]
        self.stats.leaves = len(group)
        self.stats.successes = sum(1 for lf in group if lf.status == "success")
        return GroupResult(group_key=self.key, task=self.task, tree=self.tree, leaves=group, all_leaves=all_leaves,
                           stats=self.stats)


async def run_group(task: Any, *, env_factory: Callable[[], Env], client: GenerationClient,
                    prompts: PromptBuilder | ChatTokenizer, config: TreeConfig, scorer: BaseScorer | None = None,
                    group_seed: int = 0, group_key: str | None = None) -> GroupResult:
    """Roll out one group for ``task`` with ``config.strategy`` (see the module docstring).

    Args:
      task: passed to ``env.reset``.
      env_factory: makes a fresh env (one per group; children use ``env.clone()``).
      client: the generation client (requests use ``group_key`` as the sticky route key).
      prompts: a :class:`PromptBuilder`, or a tokenizer to build one from.
      config: the strategy and its parameters.
      scorer: the branch scorer (required for ``"patr"``): a ``scorers.BaseScorer`` whose reward for a
        partial branch's last turn (mean over its tokens) must lie in [0, 1]; scored through
        ``scorers.score_branch``, the same isolation and validation as export-time scoring.
        Other strategies ignore it (``"arpo"`` branches on the server's token entropies instead, so
        its server must answer top logprobs).
      group_seed: distinguishes groups (and steps) for per-request seeds.
      group_key: prefix of interaction ids and the route key; default ``f"g{group_seed}"``.

    Raises ``ValueError`` for a bad call (``"patr"`` without a scorer) before anything runs;
    :class:`GroupRejected` if the branch scorer rejects a checkpoint; :class:`RolloutError` (with the
    cause chained) if anything else fails during the rollout (a request, an env step, the prompt
    chain); the other branches are cancelled first. Cancelling the caller cancels every branch.
    """
    if not isinstance(prompts, PromptBuilder):
        prompts = PromptBuilder(prompts)
    key = group_key if group_key is not None else f"g{group_seed}"
    run = _GroupRun(task, env_factory, client, prompts, config, scorer, group_seed, key)  # checks the scorer
    try:
        return await run.run()
    except (asyncio.CancelledError, RolloutError):
        raise
    except Exception as e:  # an env, the server or the tokenizer failed mid-rollout (ValueError included)
        raise RolloutError(f"group {key!r} failed: {type(e).__name__}: {e}") from e
    finally:
        client.release(key)


async def run_groups(tasks: Sequence[Any], *, rejected: list[GroupRejected] | None = None,
                     **kwargs: Any) -> list[GroupResult]:
    """``run_group`` for several tasks concurrently; group ``i`` uses ``group_seed = base + i``
    where ``base = kwargs.pop("group_seed", 0)``, and key ``f"g{group_seed}"``.

    With ``rejected`` (a list), a group that its branch scorer rejects is left out of the result and
    its :class:`GroupRejected` appended there (the other groups go on); without it, it is raised.
    Any other failure cancels every group and is raised."""
    base = kwargs.pop("group_seed", 0)

    async def one(i: int, task: Any) -> GroupResult | None:
        try:
            return await run_group(task, group_seed=base + i, **kwargs)
        except GroupRejected as e:
            if rejected is None:
                raise
            rejected.append(e)
            return None

    results = await gather([one(i, t) for i, t in enumerate(tasks)])
    return [g for g in results if g is not None]
