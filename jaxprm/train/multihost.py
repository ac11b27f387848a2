"""What a trainer process needs to know and exchange when the job spans several processes (JAX's
multi-controller runtime, ``jax.distributed``): its share of the work, Python objects gathered from
every process, and host copies of global arrays.

Every process of a run executes the same steps in the same order; every function here that talks to
the other processes (``allgather_objects``, ``broadcast_object``, ``host_copy`` of a global array,
``barrier``) is a collective and must be called by all of them at the same point. With one process
they are the identity and cost nothing.

Objects travel pickled, as ``uint8`` arrays through ``multihost_utils.process_allgather`` (the
runtime's own collectives: gloo on CPU, NCCL on GPU, ICI/DCN on TPU); buffers are padded to a power
of two so a run compiles a handful of gather programs, not one per step. Only the processes of one
job, admitted by its coordinator, exchange them.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["process_count", "process_index", "is_primary", "process_share", "allgather_objects",
           "broadcast_object", "broadcast_arrays", "host_copy", "local_array", "barrier"]


def process_count() -> int:
    return jax.process_count()


def process_index() -> int:
    return jax.process_index()


def is_primary() -> bool:
    """Process 0: the one that writes the run directory's files (metrics, plots, summary, exports)."""
    return jax.process_index() == 0


def process_share(items: Sequence[Any], index: int | None = None, count: int | None = None) -> tuple[int, list]:
    """Process ``index``'s contiguous share of ``items`` (of ``count`` processes; default this one's):
    ``(offset, items[offset:offset + n])`` with the shares' sizes differing by at most one (as
    ``np.array_split``). Concatenating the shares in process order gives ``items`` back."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    n, extra = divmod(len(items), count)
    offset = index * n + min(index, extra)
    size = n + (1 if index < extra else 0)
    return offset, list(items[offset:offset + size])


def _bucket(n: int) -> int:
    return 1 << max(10, (n - 1).bit_length())


def allgather_objects(obj: Any) -> list[Any]:
    """``[obj of process 0, obj of process 1, ...]`` on every process (``obj`` picklable)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int64))).reshape(-1)
    buf = np.zeros(_bucket(int(sizes.max())), np.uint8)
    buf[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(buf))
    return [pickle.loads(gathered[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def broadcast_object(obj: Any) -> Any:
    """Process 0's ``obj`` on every process (the others' arguments are ignored; pass ``None``)."""
    if jax.process_count() == 1:
        return obj
    return allgather_objects(obj if is_primary() else None)[0]


def broadcast_arrays(tree: Any) -> Any:
    """Process 0's arrays of ``tree`` on every process (a collective; local ``jax.Array`` leaves)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(jnp.asarray, multihost_utils.broadcast_one_to_all(tree))


def _whole_on_every_process(x: jax.Array) -> bool:
    """Whether each process's devices hold every part of ``x`` (e.g. params split over an ``fsdp``
    axis inside a host and replicated over ``data`` across hosts); the same answer on every process."""
    key = lambda index: tuple((s.start, s.stop, s.step) for s in index)  # noqa: E731
    parts: dict[int, set] = {}
    for device, index in x.sharding.devices_indices_map(x.shape).items():
        parts.setdefault(device.process_index, set()).add(key(index))
    whole = set().union(*parts.values())
    return all(p == whole for p in parts.values())


def _assemble(x: jax.Array) -> np.ndarray:
    out = np.empty(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def host_copy(tree: Any) -> Any:
    """Every array of ``tree`` as a whole array on this host: ``jax.device_get`` where this process
    holds every part of every array (assembled from its own shards), else an all-gather over the
    processes (a collective)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if all(x.is_fully_addressable or x.is_fully_replicated for x in leaves):
        return jax.device_get(tree)
    if all(_whole_on_every_process(x) for x in leaves):
        return jax.tree.map(lambda x: _assemble(x) if isinstance(x, jax.Array) else x, tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def local_array(x: jax.Array) -> jax.Array:
    """``x`` where this process holds all of it, else this host's whole copy (a collective)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    return jnp.asarray(host_copy(x))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name``."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
