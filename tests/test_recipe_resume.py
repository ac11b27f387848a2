"""``benchmarks.recipe`` across interruptions: a finished run is reused, one cut off after a checkpoint
is ``--resume``d, one cut off before any checkpoint is started again."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import recipe
from benchmarks._harness import has_checkpoint
from benchmarks.keep_runs import keep_runs
from jaxprm.train.rundir import read_metrics


def test_only_a_run_with_a_config_and_a_numbered_checkpoint_is_resumable(tmp_path):
    run = tmp_path / "run"
    assert not has_checkpoint(run)
    (run / "checkpoints" / "tmp").mkdir(parents=True)
    assert not has_checkpoint(run)  # no config recorded yet
    (run / "config.yaml").write_text("seed: 0\n")
    assert not has_checkpoint(run)  # an orbax temporary, not a finished step
    (run / "checkpoints" / "5").mkdir()
    assert has_checkpoint(run)


@pytest.mark.slow
def test_a_run_cut_off_after_a_checkpoint_is_resumed_not_restarted(tmp_path, capsys):
    """A real 2-step run; its last checkpoint and summary removed (as a run killed during step 2
    leaves it); ``_run`` again resumes from step 1 and the rows are steps exactly 1..2."""
    run = tmp_path / "run"
    extra = ["env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.at_start=false",
             "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.strategy=flat", "warm_start.enabled=false",
             "checkpoint.every_steps=1", "checkpoint.async_save=false", "steps=2"]
    recipe._run(run, 0, extra)
    (run / "summary.json").unlink()
    shutil.rmtree(run / "checkpoints" / "2")
    recipe._run(run, 0, extra)
    assert f"resuming {run}" in capsys.readouterr().out
    assert (run / "summary.json").is_file() and (run / "config.resumes" / "1.yaml").is_file()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2]
    assert recipe.summarize(run)["eval_steps"][-1] == 2
    # kept without its checkpoints (benchmarks.keep_runs), the finished run is reused, not rerun
    kept = tmp_path / "kept"
    assert keep_runs(tmp_path, kept) == [Path("run")]
    assert not (kept / "run" / "checkpoints").exists()
    assert recipe._run(kept / "run", 0, extra) == 0.0
    assert recipe.summarize(kept / "run") == recipe.summarize(run)


def test_a_failed_run_is_reported_with_its_log_and_fails_the_command(tmp_path, capsys):
    """A run the trainer rejects (a bad config value) does not stop the others silently: the
    failure is printed with the run's log path and the command exits non-zero naming the run."""
    with pytest.raises(SystemExit, match=r"1 run\(s\) failed: bad seed 0"):
        recipe.main(["--seeds", "0", "--variant", "bad=env.size=-1", "--out", str(tmp_path)])
    log = tmp_path / "bad" / "s0.log"
    assert "env.size" in log.read_text()
    assert str(log) in capsys.readouterr().err


def test_keep_runs_copies_finished_runs_small_files_only(tmp_path):
    out, kept = tmp_path / "out", tmp_path / "kept"
    done, cut = out / "default" / "s0", out / "default" / "s1"
    for run in (done, cut):
        (run / "checkpoints" / "5").mkdir(parents=True)
        (run / "checkpoints" / "5" / "state").write_text("x")
        (run / "metrics.jsonl").write_text("{}\n")
        (run / "config.yaml").write_text("seed: 0\n")
    (done / "summary.json").write_text("{}")
    (done / "config.resumes").mkdir()
    (done / "config.resumes" / "5.yaml").write_text("seed: 0\n")
    (out / "summary.json").write_text("{}")  # a benchmark's own summary, not a run
    assert keep_runs(out, kept) == [Path("default/s0")]
    got = sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file())
    assert got == ["default/s0/config.resumes/5.yaml", "default/s0/config.yaml", "default/s0/metrics.jsonl",
                   "default/s0/summary.json"]
