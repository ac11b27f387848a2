"""Compiled programs kept by signature, in memory and on disk: a hit skips tracing and lowering.

JAX's persistent compilation cache saves the backend compile of a program, but a process that meets
the program again still traces it to a jaxpr and lowers it to StableHLO before it can look the
cache up. For the engine's programs that is two thirds of a cache hit (the tiny model's decode
program on 2 CPU cores: 0.08 s tracing, 0.13 s lowering, 0.08 s loading), and a run loads dozens of
them. :func:`load_or_compile` keys a program by a signature that its caller states (the program's
name, its static arguments and the abstract shapes, dtypes and shardings of its inputs), so a hit
deserializes the executable (``jax.experimental.serialize_executable``) without tracing anything.

Where: ``<jax_compilation_cache_dir>/jaxprm-executables/<environment>/`` when JAX's persistent
cache is on (the trainer's ``compile_cache``), else in memory only. A stored executable is only
valid for the code and the runtime that built it, so every key also holds a fingerprint of the
environment: the jax/jaxlib versions, the backend's platform and version, the devices,
``XLA_FLAGS``, and a hash of the source of every ``jaxprm`` module (any code change misses, never
loads a stale program); the folders of older environments are pruned (``KEEP_ENVIRONMENTS``). A
file that cannot be read is compiled again and overwritten. Programs for the store are compiled past
JAX's own cache (see ``_compile``), so they are kept once, here.

Metering: a disk hit reports ``LOAD_EVENT`` (its seconds, ``fun_name=`` the program's name) and
``HIT_EVENT`` through ``jax.monitoring``, a save ``SAVE_EVENT``; a miss compiles through JAX, which
reports its own tracing, lowering and compile events.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

__all__ = ["HIT_EVENT", "LOAD_EVENT", "SAVE_EVENT", "abstract_signature", "load_or_compile", "store_dir"]

LOAD_EVENT = "/jaxprm/executables/load_duration"
SAVE_EVENT = "/jaxprm/executables/save_duration"
HIT_EVENT = "/jaxprm/executables/disk_hits"
_SUBDIR = "jaxprm-executables"

_lock = threading.Lock()  # guards ``_key_locks``
_key_locks: dict[str, threading.RLock] = {}  # one per program: a lowering may need another program
_memory: dict[str, jax.stages.Compiled] = {}  # key -> executable, shared by every caller of the process


def store_dir() -> Path | None:
    """The on-disk store: ``jaxprm-executables/`` inside JAX's persistent cache directory, or
    ``None`` when that cache is off."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(cache).expanduser() / _SUBDIR if cache else None


@functools.cache
def _source_hash() -> str:
    package = Path(__file__).resolve().parents[1]  # jaxprm/
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _environment() -> str:
    import jaxlib

    backend = jax.devices()[0].client
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    # a process of a multi-process job compiles for its own devices: its programs are its own
    local = (jax.process_index(), jax.process_count(), [d.id for d in jax.local_devices()])
    return repr((jax.__version__, jaxlib.__version__, backend.platform, backend.platform_version, devices, local,
                 os.environ.get("XLA_FLAGS", ""), _source_hash()))


KEEP_ENVIRONMENTS = 4  # the store keeps the programs of this many environments (most recent)
_pruned: set[Path] = set()  # the environment folders this process has pruned around


def _environment_dir() -> Path | None:
    """This environment's folder of the store (one per fingerprint). The first time a process uses
    it, the folders of all but the ``KEEP_ENVIRONMENTS`` most recently used are deleted (programs
    of code and runtimes since replaced)."""
    root = store_dir()
    if root is None:
        return None
    here = root / hashlib.sha256(_environment().encode()).hexdigest()[:16]
    if here not in _pruned:
        _pruned.add(here)
        with contextlib.suppress(OSError):
            here.mkdir(parents=True, exist_ok=True)
            os.utime(here)
            others = sorted((d for d in root.iterdir() if d.is_dir() and d != here),
                            key=lambda d: d.stat().st_mtime, reverse=True)
            for old in others[KEEP_ENVIRONMENTS - 1:]:
                shutil.rmtree(old, ignore_errors=True)
    return here



def abstract_signature(tree: Any) -> str:
    """A string that names ``tree``'s structure and every leaf's shape, dtype and (for a
    ``jax.Array``) sharding: two trees with one signature are interchangeable inputs of one
    compiled program. Computed from metadata only (no device transfer)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        parts.append(f"{tuple(getattr(leaf, 'shape', ()))}:{getattr(leaf, 'dtype', type(leaf).__name__)}:{sharding}")
    return "|".join(parts)


def _digest(name: str, signature: tuple) -> str:
    return hashlib.sha256(repr((name, signature, _environment())).encode()).hexdigest()


def load_or_compile(name: str, signature: tuple, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
    """The executable of program ``name`` for ``signature`` (a tuple whose ``repr`` names everything
    the program depends on besides the code: static arguments and :func:`abstract_signature` of the
    inputs): from memory, else from the disk store, else ``lower().compile()`` (then saved).
    Thread-safe; each key is compiled at most once per process, and a thread compiling one key
    does not hold up another thread's different key."""
    key = _digest(name, signature)
    hit = _memory.get(key)
    if hit is not None:
        return hit
    with _lock:
        key_lock = _key_locks.setdefault(key, threading.RLock())
    with key_lock:
        hit = _memory.get(key)
        if hit is not None:
            return hit
        directory = _environment_dir()
        path = directory / f"{name}-{key[:32]}.pkl" if directory is not None else None
        compiled = _load(path, name) if path is not None else None
        if compiled is None:
            compiled, fresh = _compile(lower(), bypass_jax_cache=path is not None)
            if path is not None and fresh:
                _save(path, compiled, name)
        _memory[key] = compiled
        return compiled


_local = threading.local()  # .jax_cache_hit: JAX's persistent cache served a compile in this thread


def _on_event(name: str, **_) -> None:
    if name == "/jax/compilation_cache/cache_hits":
        _local.jax_cache_hit = True


jax.monitoring.register_event_listener(_on_event)


def _compile(lowered: jax.stages.Lowered, *, bypass_jax_cache: bool) -> tuple[jax.stages.Compiled, bool]:
    """``lowered.compile()`` and whether the executable was compiled here (not loaded from JAX's
    persistent cache). Only such an executable can be serialized: one that JAX deserialized from
    its cache serializes without its code on XLA:CPU (running the copy fails with "Function ...
    not found"). So a program meant for the store bypasses JAX's cache (a thread-local setting)."""
    try:
        from jax._src.config import enable_compilation_cache  # thread-local; no public equivalent
    except ImportError:  # a JAX without it: compile through the cache, save only what it compiled
        enable_compilation_cache = None
    _local.jax_cache_hit = False
    if bypass_jax_cache and enable_compilation_cache is not None:
        with enable_compilation_cache(False):
            compiled = lowered.compile()
    else:
        compiled = lowered.compile()
    return compiled, not _local.jax_cache_hit


def _load(path: Path, name: str) -> jax.stages.Compiled | None:
    t0 = time.perf_counter()
    try:
        blob, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
        by_id = {d.id: d for d in jax.devices()}
        # on the devices it was compiled for: by default the loader would spread a one-device
        # program over every device of the backend (and then refuse its one-device arguments)
        compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                             execution_devices=[by_id[i] for i in device_ids])
    except Exception:  # noqa: BLE001 - absent, unreadable or from another runtime: compile (and overwrite)
        return None
    jax.monitoring.record_event_duration_secs(LOAD_EVENT, time.perf_counter() - t0, fun_name=name)
    jax.monitoring.record_event(HIT_EVENT, fun_name=name)
    return compiled


def _save(path: Path, compiled: jax.stages.Compiled, name: str) -> None:
    t0 = time.perf_counter()
    try:
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
        data = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one
    except Exception:  # noqa: BLE001 - not serializable here, or a read-only store: memory only
        return
    jax.monitoring.record_event_duration_secs(SAVE_EVENT, time.perf_counter() - t0, fun_name=name)
