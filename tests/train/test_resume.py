"""What ``--resume`` guarantees before it starts anything: the overrides of every resume are recorded
and kept by later resumes, frozen keys are refused, a changed architecture is named with its
shapes, and only one trainer at a time may use a run directory (checked with a real second process).

The run directory is made by the trainer's own setup and checkpoint code (no rollouts are needed
to write a real checkpoint of the tiny policy's train state)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxprm.train.__main__ import main
from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.loop import TrainError, _Job
from jaxprm.train.resume import check_resume, latest_config_file
from jaxprm.train.rundir import Checkpointer, RunDirBusy, RunDirLock

ROOT = Path(__file__).resolve().parents[2]
TINY = ["env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "rollout.tasks_per_step=2",
        "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.strategy=flat", "warm_start.enabled=false", "progress=false", "steps=3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with config.yaml and a real checkpoint at step 1."""
    run = tmp_path_factory.mktemp("resume") / "run"
    job = _Job(load_config(None, [*TINY, f"run_dir={run}"]), False, lambda m: None)
    job.setup()
    job.checkpoint(1)
    job.cleanup.close(None)
    assert Checkpointer(run / "checkpoints").all_steps() == [1]
    return run


def _setup(run: Path, *overrides: str, logs: list | None = None) -> None:
    """The setup of ``--resume run overrides...`` as the CLI resolves it, then its cleanup."""
    cfg = load_config(latest_config_file(run), [*overrides, f"run_dir={run}"])
    job = _Job(cfg, True, (logs if logs is not None else []).append)
    try:
        job.setup()
    finally:
        job.cleanup.close(None)


def test_resume_overrides_are_recorded_and_kept_by_a_plain_resume(run, capsys):
    logs: list[str] = []
    _setup(run, "steps=5", logs=logs)
    assert (run / "config.resumes" / "1.yaml").is_file()
    assert any("config.resumes/1.yaml" in m and "steps: 3 -> 5" in m for m in logs), logs
    assert main(["--resume", str(run), "--print-config"]) == 0  # a plain --resume keeps steps=5
    assert yaml.safe_load(capsys.readouterr().out)["steps"] == 5
    _setup(run, "optimizer.lr=0.0001", logs=logs)  # a second override adds to the first
    second = yaml.safe_load((run / "config.resumes" / "2.yaml").read_text())
    assert second["steps"] == 5 and second["optimizer"]["lr"] == 0.0001
    assert yaml.safe_load((run / "config.yaml").read_text())["steps"] == 3  # the first start stays as it was


@pytest.mark.parametrize("override,key", [("seed=9", "seed"), ("env.size=5", "env.size"),
                                          ("advantage.kl_ctl=0.1", "advantage.kl_ctl")])
def test_frozen_keys_are_refused_on_resume(run, capsys, override, key):
    assert main(["--resume", str(run), override]) == 2
    err = capsys.readouterr().err
    assert f"{key}: cannot change" in err and "\n" not in err.strip()
    with pytest.raises(ConfigError, match=key):
        check_resume(run, load_config(latest_config_file(run), [override, f"run_dir={run}"]))
    with pytest.raises(TrainError, match=key):  # train(cfg, resume=True) refuses it too
        _setup(run, override)


def test_changed_architecture_fails_before_anything_starts(run, capsys):
    history = sorted((run / "config.resumes").glob("*.yaml")) if (run / "config.resumes").exists() else []
    assert main(["--resume", str(run), "model.overrides.num_layers=3"]) == 1
    out = capsys.readouterr()
    err = out.err.strip()
    assert err.startswith("error: --resume: checkpoint 1") and "\n" not in err
    assert "train.params.layers.attn_norm has shape (2, 64) in the checkpoint but (3, 64)" in err
    assert "embedded server" not in out.out and "Event loop is closed" not in out.err
    assert Checkpointer(run / "checkpoints").all_steps() == [1]  # nothing moved or deleted
    now = sorted((run / "config.resumes").glob("*.yaml")) if (run / "config.resumes").exists() else []
    assert now == history  # a refused resume records nothing


def test_a_second_trainer_on_the_same_run_dir_fails_clearly(run, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom jaxprm.train.rundir import RunDirLock\n"
         "RunDirLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n", str(run)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=f"in use by another trainer \\(pid {holder.pid} on "):
            RunDirLock(run).acquire()
        assert main(["--resume", str(run)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: run directory") and f"pid {holder.pid}" in err
        holder.send_signal(signal.SIGKILL)  # the kernel drops a killed holder's lock
        holder.wait(30)
        lock = RunDirLock(run).acquire()
        assert lock.held and f"pid {os.getpid()}" in (run / ".lock").read_text()
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
