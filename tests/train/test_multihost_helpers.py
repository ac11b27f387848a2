"""``jaxprm.train.multihost`` in one process: shares of a task list, and the exchanges, which are the
identity here (the two-process trainer test runs them across processes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxprm.train import multihost
from jaxprm.train.step import make_mesh


@pytest.mark.parametrize("n,count", [(0, 2), (1, 2), (3, 2), (16, 2), (7, 3), (5, 8)])
def test_shares_are_contiguous_balanced_and_cover_the_list_in_order(n, count):
    items = list(range(n))
    shares = [multihost.process_share(items, i, count) for i in range(count)]
    assert [x for _, share in shares for x in share] == items
    assert [off for off, _ in shares] == [sum(len(s) for _, s in shares[:i]) for i in range(count)]
    sizes = [len(s) for _, s in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_one_process_has_all_of_it_and_exchanges_are_the_identity():
    assert multihost.process_share([1, 2, 3]) == (0, [1, 2, 3])
    obj = {"groups": [1, 2], "x": np.arange(3)}
    assert multihost.allgather_objects(obj) == [obj]
    assert multihost.broadcast_object(obj) is obj
    tree = {"w": jnp.arange(4.0)}
    assert multihost.broadcast_arrays(tree) is tree
    assert multihost.local_array(tree["w"]) is tree["w"]
    multihost.barrier("unused")


def test_host_copy_of_sharded_arrays_is_the_whole_array():
    n = len(jax.devices())
    mesh = make_mesh(1, n)  # split over every device of this process (one, or more under XLA_FLAGS)
    value = np.arange(4.0 * n * 6).reshape(4 * n, 6)
    x = jax.device_put(jnp.asarray(value), NamedSharding(mesh, P("fsdp")))
    out = multihost.host_copy({"x": x, "n": 3})
    np.testing.assert_array_equal(out["x"], value)
    assert out["n"] == 3
    assert multihost._whole_on_every_process(x)
    np.testing.assert_array_equal(multihost._assemble(x), value)
