"""The learner on JAX's multi-controller runtime: two local processes x 4 CPU devices each (gloo
collectives) run one train step on a global (data x fsdp) mesh, and its loss, gradient norm and
parameter update equal the single-process 8-device step's.

This is the default suite's multi-process check (~35 s); the same equality through the whole
trainer (``tests/train/test_multihost.py``, ~110 s) is marked slow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.train.test_step import _run_mesh

ROOT = Path(__file__).resolve().parents[2]

_WORKER = r"""
import json, sys
pid, port = int(sys.argv[1]), int(sys.argv[2])
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np, optax
from jax.experimental import multihost_utils
import jaxprm
from jaxprm.train.policy import Policy
from jaxprm.train.step import TrainStep, make_mesh
from tests.train._models import toy_transformer
from tests.train.test_step import _data
policy = Policy(toy_transformer())  # the same seed on every process: the same initial weights
mesh = make_mesh(2, 4)  # 8 global devices; "data" spans the two processes
ts = TrainStep(policy.apply_fn, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5)), jaxprm.policy_loss,
               epochs=2, num_minibatches=2, loss_kwargs={"eps_clip": 0.2}, mesh=mesh, microbatch_rows=4)
init = [np.asarray(x).ravel() for x in jax.tree.leaves(policy.params)]
st = ts.init_state(policy.params)
st, m = ts(st, _data(16, 32, n_real=13, seed=4), jax.random.key(7))
full = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in jax.tree.leaves(st.params)]
m = {k: float(np.asarray(v.addressable_data(0))) for k, v in m.items()}
print(json.dumps({"loss": m["loss"], "grad_norm": m["grad_norm"], "processes": jax.process_count(),
                  "local_devices": jax.local_device_count(), "devices": jax.device_count(),
                  "sharding": str(jax.tree.leaves(st.params)[-1].sharding),
                  "params": [(x.ravel() - i0).tolist() for x, i0 in zip(full, init)]}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_four_devices_step_as_one_process_of_eight(tmp_path):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    port = _free_port()
    logs = [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(2)]  # files: gloo logs a lot
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(i), str(port)], stdout=o.open("w"),
                              stderr=e.open("w"), env=env, cwd=ROOT) for i, (o, e) in enumerate(logs)]
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = []
    for p, (o, e) in zip(procs, logs):
        assert p.returncode == 0, e.read_text()[-3000:]
        outs.append(json.loads(o.read_text().strip().splitlines()[-1]))
    one = _run_mesh(2, 4)  # one process, 8 devices, the same mesh
    for got in outs:
        assert (got["processes"], got["local_devices"], got["devices"]) == (2, 4, 8) and "fsdp" in got["sharding"]
        np.testing.assert_allclose(got["loss"], one["loss"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got["grad_norm"], one["grad_norm"], rtol=1e-5)
        for a, b in zip(one["params"], got["params"]):  # the 4 optimizer updates, every parameter
            a, b = np.asarray(a), np.asarray(b)
            assert np.abs(a).max() > 0
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())  # float32 ulps of the weights
