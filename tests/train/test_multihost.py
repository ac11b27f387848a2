"""The trainer on JAX's multi-controller runtime: ``python -m jaxprm.train distributed.enabled=true ...``
in two local processes of 4 CPU devices each (gloo collectives), each rolling out its share of the
step's tasks against its own embedded server.

- One step of two processes (started as SLURM's ``srun`` would: JAX reads the job from the
  environment) equals one process of 8 devices on the same mesh: the same rollouts,
  process rewards, held-out evaluation, loss and gradient norm, and the same weights after the
  update to float32 rounding (process rewards on, so the advantages are not zero). Slow (~110 s on
  2 cores): the default suite checks the 2 x 4 = 1 x 8 equality of the learner step itself
  (``tests/train/test_distributed.py``) and the multi-host helpers (``test_multihost_helpers.py``).
- Two processes killed after a checkpoint and resumed continue exactly: every train row's data,
  loss and gradient norm and the final weights equal those of an uninterrupted two-process run
  (tree-packed learner, process rewards on; slow)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxprm.train.rundir import Checkpointer, read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "env.train_tasks=32", "env.eval_tasks=3", "eval.num_tasks=3", "eval.samples=2", "eval.greedy=true",
    "rollout.tasks_per_step=3", "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2",
    "warm_start.num_demos=16", "warm_start.steps=4", "warm_start.batch_size=4", "progress=false", "mesh.fsdp=2",
    "compile_cache.precompile=false", "plots=false",
    "ppo.decoupled=true",  # the learner's proximal forward, on the global mesh
]
DATA = ("reward", "success", "trajectories", "sampled_actions", "generated_tokens", "kept_groups", "rows")
PRM = ("rollout/prm_metric/turn/length_budget/output_tokens/mean", "rollout/prm_turn_reward/length_budget",
       "rollout/prm_metric/turn/length_budget/within_budget/count")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, home: Path) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", HOME=str(home),
                XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")


def _slurm_port() -> int:
    """A free port where SLURM's convention puts a job's coordinator (61440 + job id mod 4096)."""
    for _ in range(100):
        port = 61440 + int.from_bytes(os.urandom(2), "little") % 4096
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 61440-65535")


def _start(args: list[str], run: Path, processes: int, home: Path, *, launcher: str = "flags"
           ) -> list[subprocess.Popen]:
    """``processes`` trainer processes of ``8 // processes`` devices each on one job (their output in
    files beside ``run``: gloo writes a lot). ``launcher``: ``flags`` (the ``distributed.*`` keys) or
    ``slurm`` (only ``distributed.enabled=true``; JAX reads what ``srun`` would set)."""
    port = _slurm_port() if launcher == "slurm" else _free_port()
    procs = []
    for i in range(processes):
        dist, env = [], _env(8 // processes, home)
        if processes > 1 and launcher == "slurm":
            dist = ["distributed.enabled=true"]
            env.update(SLURM_JOB_ID=str(port - 61440), SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS=str(processes),
                       SLURM_PROCID=str(i), SLURM_LOCALID=str(i))
        elif processes > 1:
            dist = ["distributed.enabled=true", f"distributed.coordinator_address=127.0.0.1:{port}",
                    f"distributed.num_processes={processes}", f"distributed.process_id={i}"]
        out, err = (run.with_name(f"{run.name}.{i}.{k}").open("a") for k in ("out", "err"))
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxprm.train", *args, *dist], stdout=out, stderr=err,
                                      cwd=ROOT, env=env, start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], run: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for i, p in enumerate(procs):
        err = run.with_name(f"{run.name}.{i}.err")
        assert p.returncode == 0, f"process {i}: {err.read_text()[-4000:]}"


def _train(args: list[str], run: Path, processes: int, home: Path, **kw) -> list[dict]:
    _wait(_start([*args, f"run_dir={run}"], run, processes, home, **kw), run)
    return read_metrics(run / "metrics.jsonl")


def _weights(run: Path) -> dict[str, np.ndarray]:
    return {k: v for f in sorted((run / "policy").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_one_step_of_two_processes_equals_one_process_of_eight_devices(tmp_path):
    # Adam turns a near-zero gradient into a step of +-lr whose sign is the rounding's: a large eps
    # keeps each update proportional to its gradient, so that rounding stays rounding
    args = ["--config", "configs/default_prm.yaml", *TINY, "steps=1", "checkpoint.every_steps=1",
            "optimizer.eps=0.01", "optimizer.warmup_steps=0", f"warm_start.cache_dir={tmp_path / 'cache'}"]
    two = _train(args, tmp_path / "two", 2, tmp_path / "home", launcher="slurm")  # as under srun
    one = _train(args, tmp_path / "one", 1, tmp_path / "home")
    assert [r["kind"] for r in two] == [r["kind"] for r in one] == ["warm_start", "eval", "train", "eval"]
    assert (tmp_path / "two.1.out").read_text().count("[process 1]") > 0  # process 1 ran, and wrote nothing
    # the same warm start (process 0's, broadcast) and the same held-out episodes, split over the processes
    for key in ("sft_loss_last", "demo_success"):
        assert two[0][key] == one[0][key]
    ev2, ev1 = two[1], one[1]
    for key in ("success", "pass_at_2", "turns", "response_tokens", "invalid_rate", "greedy_success", "greedy_turns"):
        assert ev2[key] == ev1[key], key
    t2, t1 = two[2], one[2]
    assert t1["kept_groups"] == 3 and t1["trajectories"] > 3 and t2["process_groups"] == [2, 1]
    for key in (*DATA, *PRM):  # the rollouts of the 3 tasks (2 on process 0, 1 on process 1), their scoring
        assert t2[key] == t1[key], key
    assert t1["grad_norm"] > 0 and t1["updates"] > 0
    for key in ("loss", "grad_norm", "approx_kl", "entropy", "adv_abs_mean", "process_reward_mean"):
        np.testing.assert_allclose(t2[key], t1[key], rtol=2e-5, atol=1e-7, err_msg=key)
    # the sampler-vs-learner log-prob gap is float rounding on both meshes (~3e-7 nats), not a number
    # two reduction orders agree on: both runs see it ~0
    assert t2["behave_gap"] < 1e-5 and t1["behave_gap"] < 1e-5
    w2, w1 = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    assert w2.keys() == w1.keys()
    for k in w1:
        np.testing.assert_allclose(w2[k], w1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # orbax wrote one checkpoint for the job, with the global train state
    assert Checkpointer(tmp_path / "two" / "checkpoints").all_steps() == [1]
    assert not list((tmp_path / "two").glob("summary.json.*"))


@pytest.mark.slow
def test_two_processes_killed_and_resumed_continue_exactly(tmp_path):
    # the KL reference's forward on the global mesh too (not in the test above: these rollouts all fail,
    # so the KL penalty's rounding, ~1e-10 a token, is all the reward spread that group normalization sees)
    args = ["--config", "configs/default_prm.yaml", *TINY, "rollout.export=tree_packed", "advantage.kl_ctl=0.001",
            "steps=4",
            "checkpoint.every_steps=1", "eval.every_steps=100", "eval.at_start=false",
            f"warm_start.cache_dir={tmp_path / 'cache'}"]
    home = tmp_path / "home"
    run = tmp_path / "run"
    procs = _start([*args, f"run_dir={run}"], run, 2, home)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
            if steps and max(steps) >= 2 and 2 in (Checkpointer(run / "checkpoints").all_steps() or []):
                break
            assert all(p.poll() is None for p in procs), "the run ended before it could be killed"
            time.sleep(0.2)
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
    _wait(_start(["--resume", str(run)], run, 2, home), run)
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    ref = _train(args, tmp_path / "ref", 2, home)
    keys = (*DATA, "loss", "grad_norm", "packed_step", "forwarded_tokens")
    resumed, uninterrupted = ([{k: r.get(k) for k in keys} for r in rr if r["kind"] == "train"] for rr in (rows, ref))
    assert resumed == uninterrupted
    assert all(r["grad_norm"] > 0 and r["packed_step"] == 1 for r in resumed)  # real updates, on packed trees
    assert re.search(r"resumed from step [23] ", run.with_name("run.0.out").read_text())  # a real restore
    w, w_ref = _weights(run), _weights(tmp_path / "ref")
    for k in w_ref:
        np.testing.assert_array_equal(w[k], w_ref[k], err_msg=k)
