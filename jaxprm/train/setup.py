"""What a training job sets up and tears down: the distributed runtime, the policy, the run
directory, the stream of training tasks, and the ordered cleanup of everything it opened."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxprm.models import Transformer, add_lora, load_model, tiny_config
from jaxprm.train.config import ConfigError, TrainConfig, dump_yaml
from jaxprm.train.policy import Policy
from jaxprm.train.resume import check_resume
from jaxprm.train.rundir import RunDirBusy, RunDirLock

__all__ = ["TrainError", "Cleanup", "TaskStream", "init_distributed", "load_policy", "lock_run_dir",
           "prepare_run_dir", "train_error"]


class TrainError(RuntimeError):
    """A run could not start or continue (bad model path, unreachable server, bad run dir ...)."""


def train_error(message: str, cause: BaseException) -> TrainError:
    """A one-line :class:`TrainError` for ``cause`` (whitespace runs folded), carrying its notes
    (e.g. cleanup that failed after it); raise it ``from cause``."""
    err = TrainError(" ".join(message.split()))
    for note in getattr(cause, "__notes__", ()):
        err.add_note(note)
    return err


def init_distributed(cfg: TrainConfig) -> None:
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


def load_policy(cfg: TrainConfig) -> Policy:
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
    if cfg.ppo.remat == "block":
        model.remat = True  # per-layer checkpointing, part of the split graph (inference ignores it)
    if cfg.model.lora.enabled:
        add_lora(model, cfg.model.lora, jax.random.fold_in(jax.random.key(cfg.seed), 0x10_2A))
    return Policy(model, tok)


def prepare_run_dir(cfg: TrainConfig, resume: bool) -> Path:
    run_dir = Path(cfg.run_dir)
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise TrainError(f"--resume {run_dir}: not a run directory (no config.yaml)")
        try:
            check_resume(run_dir, cfg)
        except ConfigError as e:
            raise TrainError(f"--resume {run_dir}: {e}") from None
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        base, i = run_dir, 1
        while run_dir.exists() and any(run_dir.iterdir()):
            run_dir = base.with_name(f"{base.name}-{i}")
            i += 1
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "config.yaml.tmp"  # atomically: a run killed here is a fresh directory, not a torn one
    tmp.write_text(dump_yaml(dataclasses.replace(cfg, run_dir=str(run_dir))))  # the directory actually used
    os.replace(tmp, run_dir / "config.yaml")
    return run_dir


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take the run directory's exclusive lock (one file per process of a distributed run)."""
    name = ".lock" if jax.process_count() == 1 else f".lock.{jax.process_index()}"
    try:
        return RunDirLock(run_dir, name).acquire()
    except RunDirBusy as e:
        raise TrainError(str(e)) from None


class TaskStream:
    """Training tasks in a seeded permutation per pass. ``pos`` counts the tasks taken; ``consumed``
    the tasks learned from (what a checkpoint records: asynchronous rollouts take tasks ahead)."""

    def __init__(self, tasks: list, seed: int, pos: int = 0) -> None:
        self.tasks, self.seed, self.pos = tasks, seed, pos
        self.consumed = pos

    def take(self, n: int) -> list:
        out = []
        N = len(self.tasks)
        for _ in range(n):
            epoch, i = divmod(self.pos, N)
            perm = np.random.default_rng([self.seed, epoch]).permutation(N)
            out.append(self.tasks[perm[i]])
            self.pos += 1
        return out


class Cleanup:
    """Closers of the run's resources, run in reverse order of opening; each runs even when another
    fails. With an error in flight, the cleanup failures become notes on it (the caller sees the
    original error); after a successful run they are logged."""

    def __init__(self, log) -> None:
        self.log = log
        self._stack: list[tuple[str, Any]] = []

    def push(self, name: str, close) -> None:
        self._stack.append((name, close))

    async def aclose(self, error: BaseException | None) -> None:
        failures = []
        while self._stack:
            name, close = self._stack.pop()
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception as e:
                failures.append((name, e))
        self._report(failures, error)

    def close(self, error: BaseException | None) -> None:
        """The same, outside an event loop (only synchronous closers may be registered by then)."""
        failures = []
        while self._stack:
            name, close = self._stack.pop()
            try:
                close()
            except Exception as e:
                failures.append((name, e))
        self._report(failures, error)

    def _report(self, failures: list[tuple[str, Exception]], error: BaseException | None) -> None:
        for name, e in failures:
            msg = f"closing the {name} failed: {_describe(e)}"
            if error is not None:
                error.add_note(msg)
            else:
                self.log(f"warning: {msg}")


def _describe(e: BaseException) -> str:
    """``Type: message``; an exception group (e.g. several scorers failed to close) lists its members."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    return f"{type(e).__name__}: {e}"
