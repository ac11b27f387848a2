"""The training loop: rollout -> process rewards -> filter -> export -> advantages -> PPO step -> sync.

``train(cfg, resume=False)`` runs a whole job and returns a :class:`Summary`. One step:

1. ``tasks_per_step`` training maps (a seeded permutation per pass over the task list; the position
   is checkpointed) are rolled out as groups with ``rollout.tree.run_groups`` (flat / tree_random /
   patr) against the generation server (``jaxprm.train.generation``).
2. If process rewards are active, ``rollout.scoring.score_groups`` scores the exported root-to-leaf
   branches of every group (groups concurrently, branches in order); a rejected group is dropped
   (reason counted). A group whose PaTR branch scorer failed is dropped at rollout (counted).
3. An optional group filter (``rollout.export.filter_groups``).
4. ``rollout.export.export_groups`` -> a fixed-shape ``jaxprm.Batch`` (rows padded to the
   capacity, length to ``ppo.len_buckets``) -> ``jaxprm.compute_advantages``.
5. The jitted PPO step under the configured mesh (``jaxprm.train.learner.Learner``: flat or
   tree-packed, reference log-probs, advantages; it owns the train state).
6. New weights to the server (``Generation.sync``).
7. Periodic held-out evaluation (``rollout.evaluate``; its groups are scored too, in the
   ``eval-rollout`` metrics namespace, but not learned from), metrics rows, checkpoints (orbax,
   async, keep last N).

With ``rollout.source: agent`` steps 1-4 are ``jaxprm.train.agent_rollouts``: OpenAI-SDK agents run
against the recording proxy (in-process, on loopback), which scores on export and returns rows.
Held-out evaluation stays on the tree path (same environment, same prompts).

Resources (checkpointer, metrics log, generation server and client, scorers) are closed in reverse
order of opening, each even when another fails; an error that stops the run is what the caller sees,
with cleanup failures attached to it as notes.

With ``rollout.asynchronous`` steps 1-4 of later steps run while the learner trains
(``jaxprm.train.overlap``): the learner takes each step's groups from a producer, drops those more
than ``rollout.max_staleness`` weight versions behind it, and learns in a worker thread. Compile
seconds that the producer's rollouts spend then count in the learner's phase.

In a distributed run (``distributed.enabled``, ``jaxprm.train.multihost``) each process rolls out
and scores its share of the step's tasks, the groups are gathered to every process, and the learner
steps on the mesh over all of them; process 0 writes the run directory.

The translations from the config to each package's settings are in ``jaxprm.train.adapters``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from jaxprm.models import save_pretrained
from jaxprm.train import adapters, dapo, multihost, plots
from jaxprm.train.agent_rollouts import AgentRollouts
from jaxprm.train.compilation import (METER, BackgroundCompiler, CompileTotals, PhaseTimes, Span,
                                      enable_persistent_cache, measured)
from jaxprm.train.config import FLAT_STRATEGIES, TrainConfig
from jaxprm.train.generation import Generation
from jaxprm.train.learner import Learner
from jaxprm.train.overlap import RolloutProducer, drop_stale
from jaxprm.train.resume import record_resume
from jaxprm.train.rundir import CheckpointError, Checkpointer, MetricsLog, read_metrics
from jaxprm.train.setup import (Cleanup, TaskStream, TrainError, init_distributed, load_policy, lock_run_dir,
                                prepare_run_dir, train_error)
from jaxprm.train.step import make_mesh
from jaxprm.train.warmstart import warm_start
from rollout.evaluate import EvalResult, eval_metrics, evaluate
from rollout.export import filter_groups
from rollout.scoring import ScoredGroups, score_groups
from rollout.stats import describe_groups
from rollout.client import GenerationError
from rollout.tree import GroupRejected, RolloutError, run_groups
from scorers import PRMRunner

__all__ = ["TrainError", "Summary", "train"]


def _summed_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Row stats of several rounds (or processes): integer counters add up, means are averaged."""
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for p in parts for k in p):
        vals = [p[k] for p in parts if k in p]
        out[k] = sum(vals) if all(isinstance(v, int) for v in vals) else float(np.mean(vals))
    return out


def _summed_spans(spans: list[Span]) -> Span:
    """One span for phases run in several rounds (their wall and compile seconds added)."""
    return Span(wall=sum(s.wall for s in spans), compile=sum(s.compile for s in spans))


@dataclasses.dataclass
class Summary:
    run_dir: str
    steps: int
    warm_start: dict[str, Any]
    first_eval: dict[str, Any] | None
    last_eval: dict[str, Any] | None
    wall_s: float
    timings: dict[str, float]
    compiled_programs: int = 0
    compile_cache_hits: int = 0
    # the programs this run spent the most compile seconds on: name -> [programs, seconds]
    compile_top: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    # compile.precompile: [programs, seconds] compiled ahead of time in the background thread
    # (overlapping the run's work, so not a phase of wall_s)
    background_compile: list[float] | None = None

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
        parts = [f"{k.replace('_', ' ')} {v:.0f} s" for k, v in self.timings.items()]
        lines.append(f"where the time went ({self.wall_s:.0f} s): " + ", ".join(parts)
                     + f"; {self.compiled_programs} programs compiled, {self.compile_cache_hits} from the cache")
        if self.compile_top:
            lines.append("most compile time: " + ", ".join(
                f"{name} {sec:.0f} s ({int(n)}x)" for name, (n, sec) in list(self.compile_top.items())[:5]))
        if self.background_compile:
            n, sec = self.background_compile
            lines.append(f"compiled ahead of time in the background (overlapping the run): {int(n)} programs, {sec:.0f} s")
        return "\n".join(lines)


def _fmt(res: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in res.items() if isinstance(v, float) and not k.endswith("_s"))


# ----------------------------------------------------------------------------------------------
# the job
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Collected:
    """One step's rollouts, scored and filtered: the train row so far, the groups to learn from
    (carrying their process rewards), the weight version the server had as their rollouts started
    (``overlap.group_version``'s default), the task stream's position after the step's tasks, and
    the rollout and scoring spans."""

    step: int
    row: dict[str, Any]
    kept: list
    served: int
    data_pos: int
    rollout: Any
    scoring: Any


class _Job:
    def __init__(self, cfg: TrainConfig, resume: bool, log) -> None:
        self.cfg, self.resume, self.log = cfg, resume, log
        self.cleanup = Cleanup(log)
        self.times = PhaseTimes()
        self._compile_base = METER.by_function()

    # -- setup --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        init_distributed(cfg)
        self.primary, self.multi = multihost.is_primary(), multihost.process_count() > 1
        if not self.primary:
            log, index = self.log, multihost.process_index()
            self.log = lambda msg: log(f"[process {index}] {msg}")
        if self.multi and cfg.rollout.source == "agent":
            raise TrainError("distributed: rollout.source=agent runs in one process; use rollout.source=tree "
                             "(each process rolls out its share of the step's tasks)")
        # process 0 makes the run directory (or checks it, on resume); the others take its name
        run_dir = prepare_run_dir(cfg, self.resume) if self.primary or self.resume else None
        self.run_dir = Path(multihost.broadcast_object(None if run_dir is None else str(run_dir)))
        self.cfg = cfg = dataclasses.replace(cfg, run_dir=str(self.run_dir))
        self.cleanup.push("run directory lock", lock_run_dir(self.run_dir).release)
        self.policy = load_policy(cfg)
        self.train_tasks, self.eval_tasks = adapters.tasks(cfg)
        self.env_factory = adapters.env_factory(cfg)
        try:
            self.mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp)
        except ValueError as err:
            raise TrainError(f"mesh: {err}") from None
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save)
        self.cleanup.push("checkpointer", self.ckpt.close)
        self.precompiler = None
        if cfg.compile_cache.enabled and cfg.compile_cache.precompile:  # it compiles into the cache
            self.precompiler = BackgroundCompiler()
            self.cleanup.push("background compiler", self.precompiler.close)
            self._background_base = METER.background()
        self.learner = Learner(cfg, self.policy, self.mesh, multi=self.multi, precompiler=self.precompiler)

        # Warm start (fresh runs only: a resumed run restores its params from the checkpoint).
        self.warm_report: dict[str, Any] = {}
        restore_step = self.ckpt.latest_step() if self.resume else None
        if self.resume and restore_step is None:
            self.log(f"resume: no checkpoint in {self.run_dir}; starting from step 0")
        if cfg.warm_start.enabled and restore_step is None:
            with self.times.phase("warm_start"):  # on process 0; the others get its weights
                params, self.warm_report = self.policy.params, {}
                if self.primary:
                    params, self.warm_report = warm_start(
                        cfg.warm_start, self.policy, self.train_tasks, env_factory=self.env_factory,
                        key_data=adapters.warm_start_key_data(cfg, self.policy.config), log=self.log)
                params = multihost.broadcast_arrays(params)
                self.warm_report = multihost.broadcast_object(self.warm_report)
            self.policy.params = params
        self.learner.start(self.policy.params)
        self.start_step, data_pos, meta = 0, 0, {}
        if restore_step is not None:
            try:  # the newest checkpoint that restores; a changed architecture fails here, named
                step, restored, meta = self.ckpt.restore_latest(self.learner.checkpoint_tree(), log=self.log)
            except CheckpointError as e:
                raise TrainError(f"--resume: {e}") from None
            self.learner.restore(restored)
            self.start_step, data_pos = step, int(meta.get("data_pos", 0))
            self.warm_report = meta.get("warm_start", {})
            self.log(f"resumed from step {step} ({self.run_dir})")
        self.metrics = MetricsLog(self.run_dir, resume_step=self.start_step if self.resume else None,
                                  write=self.primary)
        self.cleanup.push("metrics log", self.metrics.close)
        multihost.barrier("jaxprm-metrics-log")  # read below after process 0 truncated it (resume)
        self.stream = TaskStream(self.train_tasks, cfg.seed, data_pos)
        self.consumed_pos = data_pos  # the tasks learned from (asynchronous rollouts take them ahead)
        if cfg.rollout.asynchronous and cfg.rollout.max_staleness > 0 and not cfg.ppo.decoupled:
            self.log(f"WARNING: rollout.asynchronous with max_staleness={cfg.rollout.max_staleness} learns from "
                     "groups sampled by older weights; ppo.decoupled=true corrects for it")
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        self.history = [r for r in rows if r.get("kind") == "eval"]
        if restore_step is None and self.warm_report and not any(r.get("kind") == "warm_start" for r in rows):
            self.metrics.log(0, "warm_start", {k: v for k, v in self.warm_report.items()
                                                if isinstance(v, (int, float, bool))})
        if self.resume and self.primary:
            path, changes = record_resume(self.run_dir, cfg)
            what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes) or "no overrides"
            self.log(f"resume config recorded in {path.relative_to(self.run_dir)} ({what})")

    # -- pieces of a step -----------------------------------------------------------------------
    async def score(self, groups, scored: ScoredGroups | None = None) -> tuple[list, dict[str, float]]:
        """Process rewards per group (PRM active) and the group filter; returns the kept groups
        (carrying their process rewards) and the row's stats (rejections by reason, the spec's
        ``rollout/prm_...`` metrics of the scored groups, filter counters). ``scored``: the groups'
        scoring, already done (a distributed step scores each process's share, then gathers them; see
        ``train_step``)."""
        stats: dict[str, float] = {}
        if self.prm is not None:
            scored = scored if scored is not None else await score_groups(self.prm, groups)
            for key, reason in scored.reasons:
                self.log(f"process rewards rejected group {key}: {reason}")
            stats["prm_rejected_groups"] = sum(scored.rejected.values())
            stats.update({f"prm_rejected/{kind}": n for kind, n in scored.rejected.items()})
            stats.update(scored.metrics.summary())
            groups = scored.groups
        if self.cfg.rollout.filter != "none":
            counters: dict[str, int] = {}
            groups = filter_groups(groups, self.cfg.rollout.filter, counters)
            stats.update({f"filter/{k}": v for k, v in counters.items()})
        return groups, stats

    async def run_eval(self, step: int) -> dict[str, float]:
        with self.times.phase("eval") as span:
            settings = adapters.eval_settings(self.cfg, max_context=self.gen.max_context)
            offset, tasks = multihost.process_share(self.eval_tasks)  # all of them in one process
            result = EvalResult(metrics={}, groups=[])
            if tasks:
                result = await evaluate(tasks, client=self.gen.client, prompts=self.gen.prompts,
                                        env_factory=self.env_factory, settings=settings, group_offset=offset)
            scored = None
            if self.prm is not None:  # scored for the metrics only (eval-rollout namespace), never learned from
                scored = await score_groups(self.prm, result.groups, is_eval=True)
            res = result.metrics
            if self.multi:  # the metrics of every process's groups, as one process would compute them
                parts = multihost.allgather_objects((result.groups, result.greedy_groups, scored))
                res = eval_metrics([g for p in parts for g in p[0]], [g for p in parts for g in p[1]], settings)
                scored = ScoredGroups.concat([p[2] for p in parts]) if scored is not None else None
            if scored is not None:
                res["prm_rejected_groups"] = float(sum(scored.rejected.values()))
                res.update(scored.metrics.summary())
        res["eval_s"] = span.wall - span.compile
        res["compile_s"] = span.compile
        res["loop_s"] = self._loop_s()
        row = self.metrics.log(step, "eval", res)
        self.history.append(row)
        return res

    def checkpoint(self, step: int) -> None:
        with self.times.phase("checkpoint"):
            self.metrics.sync()  # rows of this step are durable before its checkpoint starts
            self.ckpt.save(step, self.learner.checkpoint_tree(), {"step": step, "data_pos": self.consumed_pos, "warm_start": self.warm_report})

    # -- main -----------------------------------------------------------------------------------
    async def agent_step(self, step: int) -> dict[str, Any]:
        """``rollout.source: agent``: agents through the recording proxy (scored on export) -> learn ->
        weight sync; logs and returns the step's row."""
        t0 = time.perf_counter()
        tasks = self.stream.take(self.cfg.rollout.tasks_per_step)
        with self.times.phase("rollout") as rollout:
            res = await self.agents.rollout(tasks, step)
        row = dict(res.stats)
        row.update(res.prm_metrics.summary())  # the exports' prm_stats, recorded after they returned
        with self.times.phase("learn") as learning:
            row.update(self._learn_or_skip(step, lambda: self.learner.learn_rows(res.rows, step) if res.rows else None))
        self.consumed_pos = self.stream.pos
        return await self._finish_step(step, row, t0, rollout, (rollout, learning))

    async def train_step(self, step: int, scorer) -> dict[str, Any]:
        """Rollout -> scoring -> filter -> learn -> weight sync for one step; logs and returns its row."""
        t0 = time.perf_counter()
        c = await self.collect(step, scorer)
        return await self.learn_step(c, t0, (c.rollout, c.scoring))

    async def async_step(self, step: int, producer: RolloutProducer) -> dict[str, Any]:
        """``rollout.asynchronous``: the step's groups from the producer (rolled out while earlier
        steps learned; the wait is the step's rollout phase), the stale ones dropped, then learn (in
        a worker thread, so that the producer's rollouts go on) and push the weights."""
        t0 = time.perf_counter()
        with self.times.phase("rollout") as waiting:
            c = await producer.get()
        assert c.step == step, (c.step, step)
        c.kept, stale = drop_stale(c.kept, served=c.served, learner_version=step - 1,
                                   max_staleness=producer.max_staleness)
        c.row.update(stale, kept_groups=len(c.kept), rollout_wait_s=waiting.wall, rollouts_ahead=producer.ahead)
        row = await self.learn_step(c, t0, (waiting,), in_thread=True)
        await producer.served(step)
        return row

    async def learn_step(self, c: _Collected, t0: float, spans: tuple, *, in_thread: bool = False) -> dict[str, Any]:
        """Learn from a collected step, push the weights, log the row (``spans``: the phases before
        learning whose compile time the row counts)."""
        step = c.step

        def learn() -> dict[str, Any]:
            return self._learn_or_skip(step, lambda: self.learner.learn_groups(c.kept, step) if c.kept else None)

        with self.times.phase("learn") as learning:
            c.row.update(await asyncio.to_thread(learn) if in_thread else learn())
        self.consumed_pos = c.data_pos
        return await self._finish_step(step, c.row, t0, c.rollout, (*spans, learning))

    async def _collect_round(self, step: int, rnd: int, scorer, phase, n_tasks: int):
        """One round of a step's rollouts: the next ``n_tasks`` tasks rolled out (this
        process's share), overlong shaping, process rewards and the filter, gathered over the
        processes. Returns ``(groups, kept, rejected, stats, groups per process, rollout span,
        scoring span)``."""
        cfg = self.cfg
        # every process takes the same tasks and rolls out its share (all of them in one process);
        # group i of the step keeps its seed whichever process runs it
        offset, tasks = multihost.process_share(self.stream.take(n_tasks))
        branch_rejected: list[GroupRejected] = []
        with phase("rollout") as rollout:
            groups = await run_groups(tasks, env_factory=self.env_factory, client=self.gen.client,
                                      prompts=self.gen.prompts,
                                      config=adapters.tree_config(cfg, max_context=self.gen.max_context),
                                      scorer=scorer, rejected=branch_rejected,
                                      group_seed=step * 10_000 + rnd * cfg.rollout.tasks_per_step + offset)
            groups, stats = dapo.shape_overlong(groups, cfg.rollout.max_new_tokens, dapo.overlong_buffer(cfg),
                                                cfg.rollout.dapo.overlong_factor)
        with phase("score") as scoring:
            scored = await score_groups(self.prm, groups) if self.prm is not None else None
            split = [len(groups)]
            if self.multi:  # every process gets every process's groups (and scoring), in task order
                parts = multihost.allgather_objects((groups, branch_rejected, scored, stats))
                groups = [g for p in parts for g in p[0]]
                branch_rejected = [r for p in parts for r in p[1]]
                scored = ScoredGroups.concat([p[2] for p in parts]) if scored is not None else None
                split = [len(p[0]) for p in parts]
                stats = _summed_stats([p[3] for p in parts])
            kept, fstats = await self.score(groups, scored)
        return groups, kept, branch_rejected, {**stats, **fstats}, split, rollout, scoring

    async def collect(self, step: int, scorer, *, timed: bool = True) -> _Collected:
        """Rollout -> scoring -> filter for step ``step`` (``timed``: as phases of the run; the
        asynchronous producer's overlap them and are measured only). With dynamic sampling (DAPO)
        groups of equal outcome rewards are dropped and more tasks rolled out, up to
        ``rollout.dapo.max_rounds`` rounds of ``tasks_per_step``; the row counts every round."""
        cfg = self.cfg
        phase = self.times.phase if timed else (lambda name: measured())
        served = self.gen.version  # the weights the server has as the rollouts start
        dynamic = dapo.dynamic_sampling(cfg)
        want = cfg.rollout.tasks_per_step
        groups, kept, branch_rejected, rounds = [], [], [], []
        tasks_so_far, capped = 0, False
        while not rounds or (dynamic and len(kept) < want and len(rounds) < cfg.rollout.dapo.max_rounds):
            n_tasks = dapo.round_tasks(want, tasks_so_far=tasks_so_far, max_tokens=cfg.rollout.dapo.max_tokens_per_step,
                                       tokens_so_far=sum(g.stats.generated_tokens for g in groups))
            capped = n_tasks < want
            if n_tasks == 0:  # the step's token cap is spent
                break
            r_groups, r_kept, r_rejected, r_stats, r_split, r_roll, r_score = await self._collect_round(
                step, len(rounds), scorer, phase, n_tasks)
            tasks_so_far += n_tasks
            groups += r_groups
            branch_rejected += r_rejected
            if dynamic:
                mixed = [g for g in r_kept if dapo.is_mixed(g)]
                r_stats["dynamic_dropped_groups"] = len(r_kept) - len(mixed)
                r_kept = mixed
            kept += r_kept
            rounds.append((r_stats, r_split, r_roll, r_score))
        fstats = _summed_stats([r[0] for r in rounds])
        process_groups = [sum(parts) for parts in zip(*(r[1] for r in rounds))]
        rollout, scoring = _summed_spans([r[2] for r in rounds]), _summed_spans([r[3] for r in rounds])
        if dynamic:
            kept = kept[:want]
            fstats["dynamic_rounds"] = len(rounds)
            fstats["dynamic_token_capped"] = float(capped)
        data_pos = self.stream.pos
        for r in branch_rejected:
            cause = f" [cause: {' <- '.join(r.causes)}]" if r.causes else ""
            self.log(f"branch scorer rejected group {r.group_key}: {r}{cause}")
        desc = describe_groups(groups)
        self._keep_example_tree(groups)
        row: dict[str, Any] = {
            "reward": float(np.mean([lf.outcome_reward for g in groups for lf in g.leaves] or [0.0])),
            "success": desc["success_rate"], "groups_with_success": desc["groups_with_success"],
            "mixed_groups": desc["mixed_groups"], "trajectories": desc["trajectories"],
            "sampled_actions": desc["sampled_actions"], "invalid_rate": desc["invalid_rate"],
            "expanded": desc["expanded"], "pruned": desc["pruned"], "checkpoints": desc["checkpoints"],
            "loop_stopped": desc["loop_stopped"], "refills": desc["refills"],
            "generated_tokens": desc["generated_tokens"], "kept_groups": len(kept), **fstats,
        }
        if self.multi:  # how the step's groups were split over the processes
            row["process_groups"] = process_groups
        if branch_rejected:
            row["branch_rejected_groups"] = len(branch_rejected)
            row.update({f"branch_rejected/{k}": n for k, n in collections.Counter(r.kind for r in branch_rejected).items()})
            # the innermost error of each rejection (the scorer's own: ScorerHTTPError, ConnectionError, ...)
            row.update({f"branch_rejected_cause/{k}": n for k, n in
                        collections.Counter(r.causes[-1] for r in branch_rejected if r.causes).items()})
        return _Collected(step, row, kept, served, data_pos, rollout, scoring)

    def _learn_or_skip(self, step: int, learn) -> dict[str, Any]:
        """``learn()``'s metrics, or (nothing to learn from: it returned ``None``) a skipped step."""
        out = learn()
        if out is None:
            self.learner.skip_step()
            return {"skipped": True}
        return out

    async def _finish_step(self, step: int, row: dict[str, Any], t0: float, rollout, spans) -> dict[str, Any]:
        """Check that the sampler was the learner's policy, push the new weights, log the row."""
        learning = spans[-1]
        row.update(rollout_s=rollout.wall - rollout.compile, learn_s=learning.wall - learning.compile)
        try:  # before the new weights are pushed: a sampler that is not the learner's policy stops the run
            self.gen.check_behavior(step, row)
        except TrainError:
            self.metrics.log(step, "train", row)
            raise
        with self.times.phase("sync") as sync:
            await self.gen.sync(step)
        row.update(compile_s=sum(sp.compile for sp in (*spans, sync)), step_s=time.perf_counter() - t0,
                   loop_s=self._loop_s())
        self.metrics.log(step, "train", row)
        return row

    def _loop_s(self) -> float:
        """Seconds since the training loop started (0 before): rows' time axis."""
        t = getattr(self, "t_loop", None)
        return 0.0 if t is None else time.perf_counter() - t

    def _keep_example_tree(self, groups) -> None:
        """Remember the group with the most checkpoint activity so far, for the PaTR tree plot."""
        if self.cfg.rollout.strategy in FLAT_STRATEGIES or not groups:
            return
        activity = lambda g: (g.stats.expanded + g.stats.pruned, g.stats.successes)  # noqa: E731
        cand = max(groups, key=activity)
        if self.example_tree is None or activity(cand)[0] >= activity(self.example_tree)[0]:
            self.example_tree = cand

    async def run(self) -> Summary:
        try:
            first_eval, last_eval = await self._run()
        except BaseException as err:
            await self.cleanup.aclose(err)
            raise
        await self.cleanup.aclose(None)
        # after shutdown, so that the phases (with ``other`` for the unmeasured rest) cover the whole run
        wall = time.perf_counter() - self.t_start
        summary = Summary(run_dir=str(self.run_dir), steps=self.cfg.steps, warm_start=self.warm_report,
                          first_eval=first_eval, last_eval=last_eval, wall_s=wall, timings=self.times.account(wall),
                          compiled_programs=self.times.programs, compile_cache_hits=self.times.cache_hits,
                          compile_top=self._compile_top(), background_compile=self._background())
        if self.primary:
            (self.run_dir / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1, default=str))
        return summary

    async def _run(self) -> tuple[dict | None, dict | None]:
        cfg = self.cfg
        self.gen = Generation(cfg, self.policy, self.run_dir, self.log)
        self.cleanup.push("generation server and client", self.gen.aclose)
        with self.times.phase("setup"):
            await self.gen.start(resume_step=self.start_step, push_weights=bool(self.warm_report))
        self.prm = None
        if cfg.prm.active:
            try:
                self.prm = await PRMRunner.create(adapters.prm_config(cfg))
            except Exception as e:  # the scorers built so far were closed (their failures are notes on e)
                raise train_error(f"prm: could not build the scorers: {type(e).__name__}: {e}", e) from e
            self.cleanup.push("process-reward scorers", self.prm.aclose)  # closed first: scoring is drained by then
        try:
            scorer = adapters.branch_scorer(cfg)
        except Exception as e:  # e.g. a PRM tokenizer file that is not there
            raise train_error(f"rollout.branch_scorer: could not build {cfg.rollout.branch_scorer.path}: "
                              f"{type(e).__name__}: {e}", e) from e
        if scorer is not None:
            self.cleanup.push("branch scorer", scorer.aclose)
        self.agents = None
        if cfg.rollout.source == "agent":  # the recording proxy (jaxprm.train.agent_rollouts); scores on export
            self.agents = AgentRollouts(cfg, self.policy.tokenizer, self.gen.client.config,
                                        max_context_tokens=self.gen.max_context, log=self.log)
            self.cleanup.push("recording proxy", self.agents.close)
            with self.times.phase("setup"):
                await self.agents.start()
        first_eval = next((r for r in self.history), None)
        last_eval = self.history[-1] if self.history else None
        self.example_tree = None
        if self.start_step == 0 and cfg.eval.at_start and not any(r["step"] == 0 for r in self.history):
            res = await self.run_eval(0)
            first_eval = last_eval = {"step": 0, **res}
            self.log("eval @0 (warm-started policy): " + _fmt(res))
        producer = None
        if cfg.rollout.asynchronous and self.agents is None:
            producer = RolloutProducer(lambda k: self.collect(k, scorer, timed=False), first=self.start_step + 1,
                                       last=cfg.steps, max_staleness=cfg.rollout.max_staleness,
                                       learner_version=self.start_step)
            self.cleanup.push("rollout producer", producer.aclose)  # stopped before the server
        self.t_loop = time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.start_step, disable=not (cfg.progress and self.primary),
                   dynamic_ncols=True, desc="train")
        step = self.start_step
        while step < cfg.steps:
            step += 1
            if self.agents is not None:
                row = await self.agent_step(step)
            elif producer is not None:
                row = await self.async_step(step, producer)
            else:
                row = await self.train_step(step, scorer)
            if step % cfg.eval.every_steps == 0 or step == cfg.steps:
                res = await self.run_eval(step)
                last_eval = {"step": step, **res}
                first_eval = first_eval or last_eval
                (tqdm.write if cfg.progress and self.primary else self.log)(f"eval @{step}: " + _fmt(res))
            if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps:
                self.checkpoint(step)
            bar.set_postfix(succ=f"{row['success']:.2f}", loss=f"{row.get('loss', 0.0):.3f}",
                            ent=f"{row.get('entropy', float('nan')):.2f}",
                            ev=f"{(last_eval or {}).get('success', float('nan')):.2f}", refresh=False)
            bar.update(1)
        bar.close()
        self.ckpt.wait()
        self.policy.params = self.learner.host_params()  # this host's copy of the final weights (for the export)
        with self.times.phase("export"):
            self._export_outputs()
        if first_eval is not None and "step" in first_eval:
            first_eval = {k: v for k, v in first_eval.items() if k != "kind"}
        if last_eval is not None:
            last_eval = {k: v for k, v in last_eval.items() if k != "kind"}
        return first_eval, last_eval

    def _export_outputs(self) -> None:
        """The finished run's plots and its HuggingFace-format policy (process 0 only)."""
        cfg = self.cfg
        if cfg.plots and self.primary:
            try:
                plots.training_curves(self.run_dir / "metrics.jsonl", self.run_dir / "plots" / "training.png")
                if self.example_tree is not None:
                    plots.tree_png(self.example_tree, self.run_dir / "plots" / "patr_tree.png")
            except Exception as e:  # plots never fail a finished run
                self.log(f"plots failed: {type(e).__name__}: {e}")
        if cfg.export_final and self.primary:
            save_pretrained(self.policy.module(), self.policy.tokenizer, self.run_dir / "policy")

    def _background(self) -> list[float] | None:
        if self.precompiler is None:
            return None
        d = METER.background() - self._background_base
        return [d.count, round(d.seconds, 2)]

    def _compile_top(self, n: int = 10) -> dict[str, list[float]]:
        """This run's ``n`` costliest traced functions by compile seconds: ``{name: [programs, s]}``."""
        out = {}
        for name, t in METER.by_function().items():
            d = t - self._compile_base.get(name, CompileTotals())
            if d.seconds > 0:
                out[name] = [d.count, round(d.seconds, 2)]
        return dict(sorted(out.items(), key=lambda kv: -kv[1][1])[:n])


def train(cfg: TrainConfig, *, resume: bool = False, log=None) -> Summary:
    """Run (or resume) a training job; see the module docstring."""
    log = log or (lambda msg: print(msg, flush=True))
    job = _Job(cfg, resume, log)
    job.t_start = time.perf_counter()
    if cfg.compile_cache.enabled:
        enable_persistent_cache(cfg.compile_cache.dir)
    try:
        with job.times.phase("setup"):
            job.setup()
    except BaseException as err:
        job.cleanup.close(err)
        raise
    try:
        return asyncio.run(job.run())
    except (GenerationError, RolloutError) as e:  # one line, as the trainer's other errors; cleanup notes kept
        raise train_error(str(e), e) from e
    except KeyboardInterrupt as e:
        e.run_dir = str(job.run_dir)  # where to --resume (the requested directory may have been taken)
        raise
