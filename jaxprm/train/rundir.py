"""The run directory: resolved config, metrics (JSONL + TensorBoard) and orbax checkpoints.

Layout of ``RUN_DIR``::

    .lock              exclusive lock of the trainer using the directory (``RunDirLock``)
    config.yaml        the resolved config of the first start
    config.resumes/<n>.yaml   the resolved config of the n-th --resume (``jaxprm.train.resume``)
    metrics.jsonl      one JSON object per row: {"step": s, "kind": "train"|"eval"|..., ...}
    tb/                TensorBoard events (tensorboardX)
    checkpoints/<s>/   orbax checkpoints: train state (params, optimizer state, step), RNG key data,
                       data position (JSON); the last ``keep`` are kept
    checkpoints.damaged/<s>   checkpoints that failed to restore, moved aside by ``--resume``
    plots/             PNGs written by ``jaxprm.train.plots``
    policy/            the final policy in Hugging Face format

Resume contract: rows with ``step`` greater than the restored checkpoint's step are dropped from
``metrics.jsonl`` (they were produced after the last durable checkpoint and will be produced
again), so a killed-and-resumed run has neither lost nor duplicated rows. Rows are flushed and
fsynced before the checkpoint of their step is started. ``Checkpointer.restore_latest`` restores
the newest checkpoint that restores: a damaged one (truncated array file, garbage metadata, empty or
half-written directory) is moved to ``checkpoints.damaged/`` with a warning and the next older one
is tried; a checkpoint whose arrays do not fit the configured model is an error, not damage.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsLog", "Checkpointer", "CheckpointError", "CheckpointMismatch", "RunDirLock", "RunDirBusy",
           "read_metrics"]


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.generic,)):
        v = v.item()
    if hasattr(v, "shape") and getattr(v, "shape", None) == ():
        v = float(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a ``metrics.jsonl`` (a torn last line from a crash is ignored)."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    """Append-only metric rows to ``metrics.jsonl`` and TensorBoard, with resume truncation.

    With ``write=False`` (the other processes of a distributed run; process 0 writes) nothing is
    opened or written and ``log`` only returns the row."""

    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None, tensorboard: bool = True,
                 write: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._f = self._tb = None
        if not write:
            return
        if resume_step is not None:
            self.truncate_after(resume_step)
        self._f = open(self.path, "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            kw = {"purge_step": resume_step + 1} if resume_step is not None else {}
            self._tb = SummaryWriter(str(self.run_dir / "tb"), **kw)

    def truncate_after(self, step: int) -> int:
        """Drop rows with ``step > step`` (and a torn last line); returns rows kept."""
        rows = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return len(rows)

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": int(step), "kind": kind, **{k: _jsonable(v) for k, v in metrics.items()}}
        if self._f is None:
            return row
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k in ("step", "kind") or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                self._tb.add_scalar(f"{kind}/{k}", v, step)
        return row

    def sync(self) -> None:
        """Make every written row durable (called before a checkpoint is started)."""
        if self._f is None:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._f is None:
            return
        self.sync()
        self._f.close()
        if self._tb is not None:
            self._tb.close()


class CheckpointError(RuntimeError):
    """No checkpoint could be restored (every one is damaged), or a checkpoint does not fit."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint's arrays do not fit the structure being restored (the architecture changed)."""


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"train.params.embed": (shape, dtype name), ...}`` for every array leaf of ``tree`` (a
    pytree of arrays, or orbax's metadata tree of the same)."""
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if shape is None:
            continue
        out[".".join(_key_name(k) for k in path)] = (tuple(int(d) for d in shape), str(np.dtype(leaf.dtype)))
    return out


def _short(err: BaseException) -> str:
    """One line for an exception (orbax / tensorstore messages carry whole specs)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def describe_mismatch(saved: dict, wanted: dict, *, limit: int = 3) -> list[str]:
    """Differences between two :func:`_flat_shapes` maps (checkpoint vs configured model), at most
    ``limit`` lines plus a count of the rest."""
    order = lambda k: ("opt_state" in k, k)  # noqa: E731  (parameters before optimizer moments)
    lines = []
    for k in sorted(saved.keys() & wanted.keys(), key=order):
        (s_shape, s_dt), (w_shape, w_dt) = saved[k], wanted[k]
        if s_shape != w_shape:
            lines.append(f"{k} has shape {s_shape} in the checkpoint but {w_shape} in the configured model")
        elif s_dt != w_dt:
            lines.append(f"{k} has dtype {s_dt} in the checkpoint but {w_dt} in the configured model")
    only_saved = sorted(saved.keys() - wanted.keys(), key=order)
    only_wanted = sorted(wanted.keys() - saved.keys(), key=order)
    if only_wanted:
        lines.append(f"{only_wanted[0]} (shape {wanted[only_wanted[0]][0]}) of the configured model is not in the "
                     f"checkpoint" + (f" ({len(only_wanted) - 1} more such)" if len(only_wanted) > 1 else ""))
    if only_saved:
        lines.append(f"{only_saved[0]} (shape {saved[only_saved[0]][0]}) of the checkpoint is not in the configured "
                     f"model" + (f" ({len(only_saved) - 1} more such)" if len(only_saved) > 1 else ""))
    if len(lines) > limit:
        lines = lines[:limit] + [f"{len(lines) - limit} more differences"]
    return lines


@contextlib.contextmanager
def _quiet_closed_loop():
    """orbax/tensorstore report a failed restore a second time from a background callback into an
    event loop that is already closed ("Event loop is closed", a traceback per array); the restore's
    own exception carries the cause, so that echo is dropped while restores are attempted."""
    echo = lambda e: isinstance(e, RuntimeError) and str(e) == "Event loop is closed"  # noqa: E731
    prev_unraisable, prev_except = sys.unraisablehook, sys.excepthook

    def unraisable_hook(u):
        if not echo(u.exc_value):
            prev_unraisable(u)

    def except_hook(tp, value, tb):
        if not echo(value):
            prev_except(tp, value, tb)

    sys.unraisablehook, sys.excepthook = unraisable_hook, except_hook
    try:
        yield
    finally:
        sys.unraisablehook, sys.excepthook = prev_unraisable, prev_except


class Checkpointer:
    """orbax ``CheckpointManager`` for ``{"state": pytree, "meta": json}``; keeps the last ``keep``."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    @property
    def damaged_dir(self) -> Path:
        """Where damaged checkpoints are moved: ``<directory>.damaged/`` beside the checkpoints."""
        return self.directory.with_name(self.directory.name + ".damaged")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(int(s) for s in self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        ocp = self._ocp
        self.manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(_jsonable(meta))),
        )

    def saved_shapes(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """The checkpoint's array paths, shapes and dtypes, read from its metadata (no array data)."""
        md = self.manager.item_metadata(step)["state"]
        if md is None:
            raise ValueError("no array metadata")
        return _flat_shapes(getattr(md, "tree", md))

    def check_fits(self, target: Any, step: int) -> None:
        """Raise :class:`CheckpointMismatch` naming the first mismatched arrays and their shapes when
        checkpoint ``step`` does not have exactly the arrays (paths, shapes, dtypes) of ``target``."""
        diff = describe_mismatch(self.saved_shapes(step), _flat_shapes(target))
        if diff:
            raise CheckpointMismatch(f"checkpoint {step} does not fit the configured model: " + "; ".join(diff))

    def restore(self, target: Any, step: int | None = None) -> tuple[int, Any, dict[str, Any]]:
        """Restore into the structure/shardings of ``target``; returns ``(step, state, meta)``."""
        import jax

        ocp = self._ocp
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint found under {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        meta = out["meta"]
        if not isinstance(meta, dict):
            raise ValueError(f"metadata is {type(meta).__name__}, not a JSON object")
        return int(step), out["state"], dict(meta)

    def restore_latest(self, target: Any, *, log: Callable[[str], None] = print
                       ) -> tuple[int, Any, dict[str, Any]] | None:
        """Restore the newest checkpoint that restores into ``target``; ``None`` if there is none.

        Newest first: a checkpoint whose metadata cannot be read or whose arrays cannot be restored is
        damaged: it is moved to :attr:`damaged_dir` (so the step can be written again), ``log`` gets a
        warning naming it and the reason, and the next older one is tried. Raises
        :class:`CheckpointMismatch` (nothing moved) when a readable checkpoint's array paths, shapes or
        dtypes differ from ``target``'s, and :class:`CheckpointError` (one line) when checkpoints
        exist but none restores.
        """
        damaged: list[tuple[int, str]] = []
        result = None
        for step in reversed(self.all_steps()):
            try:
                saved = self.saved_shapes(step)
            except Exception as e:  # garbage / missing metadata, empty directory
                damaged.append((step, _short(e)))
                continue
            diff = describe_mismatch(saved, _flat_shapes(target))
            if diff:
                raise CheckpointMismatch(f"checkpoint {step} in {self.directory} does not fit the configured model "
                                         "(the architecture or dtype changed): " + "; ".join(diff))
            try:
                with _quiet_closed_loop():
                    result = self.restore(target, step)
                break
            except Exception as e:  # truncated array files, half-written directories, bad meta
                damaged.append((step, _short(e)))
        if damaged and result is None:
            raise CheckpointError(
                f"none of the {len(damaged)} checkpoints in {self.directory} restores ("
                + "; ".join(f"{s}: {why}" for s, why in damaged)
                + "); move the checkpoints directory away to start again from step 0")
        from jaxprm.train import multihost

        primary = multihost.is_primary()  # one process moves the damaged ones; the others wait for it
        for step, why in damaged:
            dest = self._move_aside(step) if primary else self.damaged_dir
            log(f"warning: checkpoint {step} ({self.directory / str(step)}) is damaged and was moved to {dest}: {why}")
        if damaged:
            multihost.barrier("jaxprm-checkpoints-moved-aside")
            self.manager.reload()
            log(f"warning: resuming from checkpoint {result[0]}, the newest that restores")
        return result

    def _move_aside(self, step: int) -> Path:
        src = self.directory / str(step)
        self.damaged_dir.mkdir(parents=True, exist_ok=True)
        dest, i = self.damaged_dir / str(step), 1
        while dest.exists():
            dest, i = self.damaged_dir / f"{step}.{i}", i + 1
        shutil.move(str(src), str(dest))
        return dest

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


class RunDirBusy(RuntimeError):
    """Another process holds the run directory's lock."""


class RunDirLock:
    """An exclusive ``flock`` on ``RUN_DIR/<name>``: one trainer per run directory.

    The kernel drops the lock when the holder exits or is killed (SIGKILL included), so a stale lock
    file never blocks a resume. The holder writes its pid, host and start time into the file; a
    second process gets :class:`RunDirBusy` quoting them. Distributed runs lock one file per process
    (``name`` differs by process index)."""

    def __init__(self, run_dir: str | Path, name: str = ".lock") -> None:
        self.path = Path(run_dir) / name
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise RunDirBusy(f"run directory {self.path.parent} is in use by another trainer ({holder}); "
                             f"wait for it to end or stop it (lock file {self.path})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (idempotent); the file stays (removing it would race with a waiting locker)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
