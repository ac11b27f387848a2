"""The run directory: resolved config, metrics (JSONL + TensorBoard) and orbax checkpoints.

Layout of ``RUN_DIR``::

    config.yaml        the resolved config (written at start; read by --resume)
    metrics.jsonl      one JSON object per row: {"step": s, "kind": "train"|"eval"|..., ...}
    tb/                TensorBoard events (tensorboardX)
    checkpoints/<s>/   orbax checkpoints: train state (params, optimizer state, step), RNG key data,
                       data position (JSON); the last ``keep`` are kept
    plots/             PNGs written by ``jaxprm.train.plots``
    policy/            the final policy in Hugging Face format

Resume contract: rows with ``step`` greater than the restored checkpoint's step are dropped from
``metrics.jsonl`` (they were produced after the last durable checkpoint and will be produced
again), so a killed-and-resumed run has neither lost nor duplicated rows. Rows are flushed and
fsynced before the checkpoint of their step is started.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsLog", "Checkpointer", "read_metrics"]


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
    """Append-only metric rows to ``metrics.jsonl`` and TensorBoard, with resume truncation."""

    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
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
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self.sync()
        self._f.close()
        if self._tb is not None:
            self._tb.close()


class Checkpointer:
    """orbax ``CheckpointManager`` for ``{"state": pytree, "meta": json}``; keeps the last ``keep``."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True) -> None:
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        ocp = self._ocp
        self.manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(_jsonable(meta))),
        )

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
        return int(step), out["state"], dict(out["meta"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
