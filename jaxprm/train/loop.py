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

Steps 1-4 are ``jaxprm.train.collect``; how steps are driven (synchronous, asynchronous, agents)
and the shared learn -> check -> sync -> log body are ``jaxprm.train.drivers``; this module owns the
run's resources, setup, evaluation, checkpoints and outputs. The translations from the config to
each package's settings are in ``jaxprm.train.adapters``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxprm.models import save_pretrained
from jaxprm.train import adapters, multihost, plots
from jaxprm.train.agent_rollouts import AgentRollouts
from jaxprm.train.collect import StepCollector
from jaxprm.train.compilation import METER, BackgroundCompiler, CompileTotals, PhaseTimes, enable_persistent_cache
from jaxprm.train.config import TrainConfig
from jaxprm.train.drivers import AgentSteps, AsyncSteps, StepDriver, SyncSteps
from jaxprm.train.generation import Generation
from jaxprm.train.learner import Learner
from jaxprm.train.resume import record_resume
from jaxprm.train.rundir import CheckpointError, Checkpointer, MetricsLog, read_metrics
from jaxprm.train.setup import (Cleanup, TaskStream, TrainError, init_distributed, load_policy, lock_run_dir,
                                prepare_run_dir, train_error)
from jaxprm.train.step import make_mesh
from jaxprm.train.warmstart import warm_start
from rollout.evaluate import EvalResult, eval_metrics, evaluate
from rollout.client import GenerationError
from rollout.groups import RolloutError
from rollout.scoring import ScoredGroups, score_groups
from scorers import PRMRunner

__all__ = ["TrainError", "Summary", "train"]


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


class _Job:
    """One training run: its resources (closed in reverse order), setup, the loop over steps (each
    step is its driver's), evaluation, checkpoints and the finished run's outputs."""

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
                        prompts=adapters.prompt_builder(cfg, self.policy.tokenizer),
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
        if cfg.rollout.asynchronous and cfg.rollout.max_staleness > 0 and not cfg.ppo.decoupled:
            self.log(f"WARNING: rollout.asynchronous with max_staleness={cfg.rollout.max_staleness} learns from "
                     "groups sampled by older weights; ppo.decoupled=true corrects for it")
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        self.history = [r for r in rows if r.get("kind") == "eval"]
        # the train rollouts' sampled tokens so far (token_budget; a resume counts the kept rows)
        self.sampled_tokens = sum(int(r.get("generated_tokens", 0)) for r in rows if r.get("kind") == "train")
        self.last_step = self.start_step
        if restore_step is None and self.warm_report and not any(r.get("kind") == "warm_start" for r in rows):
            self.metrics.log(0, "warm_start", {k: v for k, v in self.warm_report.items()
                                                if isinstance(v, (int, float, bool))})
        if self.resume and self.primary:
            path, changes = record_resume(self.run_dir, cfg)
            what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes) or "no overrides"
            self.log(f"resume config recorded in {path.relative_to(self.run_dir)} ({what})")

    # -- pieces of a run -------------------------------------------------------------------------
    def _eval_due(self, step: int, before: int) -> bool:
        """Whether the step that took the sampled tokens from ``before`` to now is an eval step."""
        cfg = self.cfg
        if cfg.eval.token_fractions is not None:
            return any(before < f * cfg.token_budget <= self.sampled_tokens for f in cfg.eval.token_fractions)
        return step % cfg.eval.every_steps == 0

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
        res["sampled_tokens"] = self.sampled_tokens
        res["loop_s"] = self._loop_s()
        row = self.metrics.log(step, "eval", res)
        self.history.append(row)
        return res

    def checkpoint(self, step: int) -> None:
        with self.times.phase("checkpoint"):
            self.metrics.sync()  # rows of this step are durable before its checkpoint starts
            self.ckpt.save(step, self.learner.checkpoint_tree(), {"step": step, "data_pos": self.stream.consumed, "warm_start": self.warm_report})

    # -- main -----------------------------------------------------------------------------------
    def _loop_s(self) -> float:
        """Seconds since the training loop started (0 before): rows' time axis."""
        t = getattr(self, "t_loop", None)
        return 0.0 if t is None else time.perf_counter() - t

    async def run(self) -> Summary:
        try:
            first_eval, last_eval = await self._run()
        except BaseException as err:
            await self.cleanup.aclose(err)
            raise
        await self.cleanup.aclose(None)
        # after shutdown, so that the phases (with ``other`` for the unmeasured rest) cover the whole run
        wall = time.perf_counter() - self.t_start
        summary = Summary(run_dir=str(self.run_dir), steps=self.last_step, warm_start=self.warm_report,
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
                self.prm = await PRMRunner.create(cfg.prm)  # the prm section is a scorers.PRMConfig
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
        agents = None
        if cfg.rollout.source == "agent":  # the recording proxy (jaxprm.train.agent_rollouts); scores on export
            agents = AgentRollouts(cfg, self.policy.tokenizer, self.gen.client.config,
                                   max_context_tokens=self.gen.max_context, log=self.log)
            self.cleanup.push("recording proxy", agents.close)
            with self.times.phase("setup"):
                await agents.start()
        first_eval = next((r for r in self.history), None)
        last_eval = self.history[-1] if self.history else None
        if self.start_step == 0 and cfg.eval.at_start and not any(r["step"] == 0 for r in self.history):
            res = await self.run_eval(0)
            first_eval = last_eval = {"step": 0, **res}
            self.log("eval @0 (warm-started policy): " + _fmt(res))
        self.collector = StepCollector(cfg, gen=self.gen, env_factory=self.env_factory, stream=self.stream,
                                       prm=self.prm, scorer=scorer, times=self.times, log=self.log, multi=self.multi)
        driver = self._driver(agents)
        self.cleanup.push("step driver", driver.aclose)  # an asynchronous producer stops before the server
        self.t_loop = time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.start_step, disable=not (cfg.progress and self.primary),
                   dynamic_ncols=True, desc="train")
        step = self.start_step
        while step < cfg.steps:
            step += 1
            row = await driver.step(step)
            before = self.sampled_tokens
            self.sampled_tokens += int(row.get("generated_tokens", 0))
            self.last_step = step
            spent = cfg.token_budget is not None and self.sampled_tokens >= cfg.token_budget
            if self._eval_due(step, before) or step == cfg.steps or spent:
                res = await self.run_eval(step)
                last_eval = {"step": step, **res}
                first_eval = first_eval or last_eval
                (tqdm.write if cfg.progress and self.primary else self.log)(f"eval @{step}: " + _fmt(res))
            if step % cfg.checkpoint.every_steps == 0 or step == cfg.steps or spent:
                self.checkpoint(step)
            bar.set_postfix(succ=f"{row['success']:.2f}", loss=f"{row.get('loss', 0.0):.3f}",
                            ent=f"{row.get('entropy', float('nan')):.2f}",
                            ev=f"{(last_eval or {}).get('success', float('nan')):.2f}", refresh=False)
            bar.update(1)
            if spent:
                self.log(f"token budget spent at step {step}: {self.sampled_tokens} of {cfg.token_budget} sampled tokens")
                break
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

    def _driver(self, agents: AgentRollouts | None) -> StepDriver:
        """The driver of this run's steps: agents through the proxy, asynchronous or synchronous."""
        cfg = self.cfg
        shared = dict(learner=self.learner, gen=self.gen, metrics=self.metrics, times=self.times, stream=self.stream,
                      clock=self._loop_s)
        if agents is not None:
            return AgentSteps(agents, cfg.rollout.tasks_per_step, **shared)
        if cfg.rollout.asynchronous:
            return AsyncSteps(self.collector, first=self.start_step + 1, last=cfg.steps,
                              max_staleness=cfg.rollout.max_staleness, learner_version=self.start_step, **shared)
        return SyncSteps(self.collector, **shared)

    def _export_outputs(self) -> None:
        """The finished run's plots and its HuggingFace-format policy (process 0 only)."""
        cfg = self.cfg
        if cfg.plots and self.primary:
            try:
                plots.training_curves(self.run_dir / "metrics.jsonl", self.run_dir / "plots" / "training.png")
                plots.health_curves(self.run_dir / "metrics.jsonl", self.run_dir / "plots" / "health.png")
                if self.collector.example_tree is not None:
                    plots.tree_png(self.collector.example_tree, self.run_dir / "plots" / "patr_tree.png")
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
