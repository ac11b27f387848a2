"""A process-reward scorer server that is down when a step is scored: the refused groups are scored
again once it answers (``prm.unavailable_wait_s``) instead of being dropped (the step would pass
without an update); past the wait the run stops in one line; ``null`` drops them."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks.chaos import judge_config
from jaxprm.inprocess import ThreadedServer
from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.loop import TrainError, train
from jaxprm.train.rundir import read_metrics
from tests.scorers.scorer_http_server import ScriptedServer as ScorerServer
from tests.train.test_prm_wiring import SMALL

def _judge_on(port: int) -> ScorerServer:
    """The scripted judge (``{"score": 0.5}``) on ``port``: a judge server that comes back."""
    judge = ScorerServer()
    judge.port = port
    judge._http = ThreadedServer(judge.app, port=port, name="judge-back", startup_timeout_s=20,
                                 timeout_graceful_shutdown=1)
    return judge


def _run(tmp_path: Path, url: str, *overrides: str, log=lambda m: None):
    (tmp_path / "judge.yaml").write_text(judge_config(url, max_retries=0, breaker_failures=1, breaker_probe_s=0.2))
    cfg = load_config(tmp_path / "judge.yaml", [*SMALL, "steps=1", "rollout.tasks_per_step=2", "eval.num_tasks=1",
                                                *overrides, f"run_dir={tmp_path / 'run'}"])
    logs: list[str] = []
    summary = train(cfg, log=lambda m: (logs.append(m), log(m)))
    (row,) = [r for r in read_metrics(Path(summary.run_dir) / "metrics.jsonl") if r["kind"] == "train"]
    return row, logs


def test_groups_are_scored_again_once_the_scorer_answers_and_the_step_learns(tmp_path, free_port):
    """Nothing listens on the judge's port when the step is scored; it comes up 3 s into the run's
    first scoring (a timer), and the same groups are scored then."""
    port = free_port()
    started: list[ScorerServer] = []
    timers: list[threading.Timer] = []

    def log_hook(message: str) -> None:
        if "scoring them again" in message and not timers:
            timers.append(threading.Timer(3.0, lambda: started.append(_judge_on(port))))
            timers[0].start()

    try:
        row, logs = _run(tmp_path, f"http://127.0.0.1:{port}", log=log_hook)
    finally:
        for t in timers:
            t.join()
        for judge in started:
            judge.stop()
    assert started and row["scorer_waits"] >= 1 and row["scorer_wait_s"] >= 3
    assert row["kept_groups"] == 2 and not row.get("skipped") and row["prm_rejected_groups"] == 0
    assert started[0].requests["chat"]  # the groups were scored by the judge that came back


def test_past_the_wait_the_run_stops_in_one_line(tmp_path, free_port):
    with pytest.raises(TrainError, match=r"a scorer server has been unavailable for \d+ s "
                                         r"\(prm.unavailable_wait_s=1\).*--resume"):
        _run(tmp_path, f"http://127.0.0.1:{free_port()}", "prm.unavailable_wait_s=1")


def test_null_skips_the_step_as_before(tmp_path, free_port):
    row, _ = _run(tmp_path, f"http://127.0.0.1:{free_port()}", "prm.unavailable_wait_s=null")
    assert row["skipped"] and row["kept_groups"] == 0 and "scorer_waits" not in row
    assert row["prm_rejected_groups"] == 2 and row.get("prm_rejected/scorer_unavailable", 0) + row.get(
        "prm_rejected/failed", 0) == 2


def test_the_wait_is_validated():
    with pytest.raises(ConfigError, match=r"prm.unavailable_wait_s: must be >= 0 or null"):
        load_config(None, ["prm.unavailable_wait_s=-1"])
