"""End-to-end trainer runs on tiny settings: smoke run with every output, resume after SIGKILL,
clear errors. The full default run is the opt-in slow test at the bottom."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxprm.train.config import load_config
from jaxprm.train.loop import TrainError, train
from jaxprm.train.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "env.train_tasks=32", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.greedy=true",
    "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2",
    "warm_start.num_demos=16", "warm_start.steps=4", "warm_start.batch_size=4", "progress=false",
]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")


def test_smoke_run_writes_every_output(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "rollout.strategy=patr", "steps=2", "eval.every_steps=2", "checkpoint.every_steps=1", "checkpoint.keep=1",
            f"run_dir={run}", f"warm_start.cache_dir={tmp_path / 'cache'}"]
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", *args], capture_output=True, text=True,
                         cwd=ROOT, env=_env(), timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "sampled success change" in out.stdout
    rows = read_metrics(run / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert {"loss", "reward", "success", "expanded", "pruned", "grad_norm", "rollout_s", "learn_s",
            "compile_s"} <= set(train_rows[-1])
    assert "where the time went" in out.stdout and "programs compiled" in out.stdout
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2]
    assert {"success", "pass_at_2", "greedy_success", "turns", "response_tokens"} <= set(evals[0])
    assert any(r["kind"] == "warm_start" for r in rows)
    assert (run / "config.yaml").is_file() and load_config(run / "config.yaml").steps == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]  # keep=1
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "plots" / "training.png").stat().st_size > 1000
    assert (run / "plots" / "patr_tree.png").stat().st_size > 1000
    assert (run / "plots" / "health.png").stat().st_size > 1000  # RSS, descriptors, threads, compiles per step
    assert all(r["rss_mb"] > 0 and r["threads"] >= 1 for r in train_rows)
    policy = run / "policy"
    assert (policy / "config.json").is_file() and list(policy.glob("*.safetensors"))
    from jaxprm.models import load_model

    model, tok = load_model(policy)  # the exported policy loads back (Hugging Face layout)
    assert model.config.vocab_size == tok.vocab_size
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["last_eval"]["step"] == 2
    assert len(summary["warm_start"]["params_sha256"]) == 64  # what pairs runs by warm start
    # the breakdown's structure, not its timings: every phase, none negative, summing to the wall time
    from jaxprm.train.compilation import PhaseTimes

    assert list(summary["timings"]) == list(PhaseTimes.ORDER) and "other" in PhaseTimes.ORDER
    assert all(v >= 0 for v in summary["timings"].values())
    assert sum(summary["timings"].values()) == pytest.approx(summary["wall_s"], rel=1e-6)
    assert summary["compiled_programs"] > 0


@pytest.mark.slow
def test_resume_after_sigkill_has_no_lost_or_duplicated_rows(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, "steps=5", "eval.every_steps=100", "eval.at_start=false", "checkpoint.every_steps=1",
            "warm_start.enabled=false", "rollout.strategy=flat", f"run_dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "jaxprm.train", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
            if steps and max(steps) >= 3:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: server thread, checkpoint writers
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", "--resume", str(run)], capture_output=True,
                         text=True, cwd=ROOT, env=_env(), timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run / "metrics.jsonl")
    train_steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert train_steps == [1, 2, 3, 4, 5]  # none lost, none duplicated, in order
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [5]
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
    from jaxprm.train.rundir import Checkpointer

    assert Checkpointer(run / "checkpoints").latest_step() == 5
    # what the README promises a resume reproduces: the data of every row, as an uninterrupted run has it
    ref = tmp_path / "ref"
    done = subprocess.run([sys.executable, "-m", "jaxprm.train", *args[:-1], f"run_dir={ref}"], capture_output=True,
                          text=True, cwd=ROOT, env=_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    data = ("reward", "success", "trajectories", "sampled_actions", "generated_tokens", "kept_groups", "rows")
    resumed, uninterrupted = ([{k: r[k] for k in data} for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "train"]
                              for d in (run, ref))
    assert resumed == uninterrupted


def test_missing_model_file_is_a_clear_error(tmp_path):
    cfg = load_config(None, [*TINY, "model.name=/nonexistent/policy.gguf", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(TrainError, match=r"model.name='/nonexistent/policy.gguf'.*not found"):
        train(cfg)


def test_unreachable_external_server_fails_after_bounded_retries(tmp_path, free_port):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = load_config(None, [*TINY, "server.kind=external", f"server.urls=[{url}]", "server.max_retries=2",
                             "warm_start.enabled=false", f"run_dir={tmp_path / 'r'}"])
    t0 = time.monotonic()
    with pytest.raises(TrainError, match=r"unreachable.*after 3 attempts"):
        train(cfg)
    assert time.monotonic() - t0 < 120


def test_a_scorer_module_that_is_missing_names_its_key():
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", "prm.scorers=[{path: no_such_module_q.Scorer}]",
                          "steps=1"], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "prm.scorers[0].path='no_such_module_q.Scorer'" in out.stderr and "No module named" in out.stderr


def test_resume_of_a_non_run_dir(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", "--resume", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, env=_env(), timeout=120)
    assert out.returncode == 2 and "no config.yaml" in out.stderr


@pytest.mark.slow
def test_default_run_end_to_end(tmp_path):
    """The acceptance run: `python -m jaxprm.train` with the embedded default (minutes on a CPU).
    Improvement is reported, not asserted (it depends on seeds and timing is machine dependent)."""
    run = tmp_path / "default"
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", f"run_dir={run}", "progress=false"],
                         capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=3600)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads((run / "summary.json").read_text())
    print(out.stdout[-2000:])
    assert s["first_eval"] is not None and s["last_eval"] is not None
    assert (run / "policy" / "config.json").is_file()


@pytest.mark.slow
def test_external_server_gets_weights_from_disk(tmp_path):
    """A separately started jaxprm server used as an 'external' vLLM-dialect server: the trainer
    checks it is up, rolls out against it, and pushes each step's policy via
    save_pretrained + POST /update_weights_from_disk (the weight version advances)."""
    from jaxprm.models import load_model
    from jaxprm.serve import ServerHandle

    model, tok = load_model("tiny")
    (tmp_path / "w").mkdir()
    server = ServerHandle.start(model, tok, host="127.0.0.1", port=0, weights_roots=(str(tmp_path / "w"),))
    try:
        v0 = server.weight_version
        cfg = load_config(None, [*TINY, "server.kind=external", f"server.urls=[{server.url}]",
                                 "server.model_name=jaxprm", "warm_start.enabled=false", "rollout.strategy=flat",
                                 "steps=2", "eval.every_steps=100", "eval.at_start=false", "export_final=false",
                                 "plots=false", f"server.weight_sync_dir={tmp_path / 'w'}", f"run_dir={tmp_path / 'r'}"])
        summary = train(cfg, log=lambda m: None)
        assert summary.steps == 2
        assert server.weight_version > v0
        assert (tmp_path / "w" / "step-2" / "config.json").is_file()
        assert not (tmp_path / "w" / "step-1").exists()  # older pushes are cleaned up
    finally:
        server.stop()
