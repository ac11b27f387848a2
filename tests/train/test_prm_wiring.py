"""Process rewards wired into the trainer, with injected faults: the spec's failure rules end to end.

One short in-process run covers most rules at once: of six groups, PaTR's branch scorer rejects the
first at its checkpoint, and the process-reward scorer raises on the second, returns NaN on the
third, hangs past the timeout on the fourth and leaves [0, 1] under process_weighted on the fifth;
only the sixth is trained. A second scorer fails in ``aclose``. Faster checks of the same wiring
(load-time checks, cleanup order, the server probe) follow.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.loop import TrainError, train
from jaxprm.train.setup import Cleanup
from jaxprm.train.rundir import read_metrics
from rollout.testing import ScriptedServer, ServerScript, hashed_action_policy, make_test_tokenizer
from tests.train import fault_scorers

ROOT = Path(__file__).resolve().parents[2]
FAULTS = "tests.train.fault_scorers"
SMALL = [
    "env.train_tasks=32", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.greedy=false",
    "eval.at_start=false", "warm_start.enabled=false", "progress=false", "plots=false", "export_final=false",
    "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.k=2", "env.max_turns=4",
    "env.invalid_ends_episode=false",  # an untrained policy's invalid answers must not end branches before checkpoints
]


def _server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jaxprm-serve-") and t.is_alive()]


def test_faulty_groups_are_dropped_with_their_reason_and_training_goes_on(tmp_path):
    before = set(_server_threads())  # servers of other test modules may be up
    fault_scorers.SEEN.clear()
    logs: list[str] = []
    prm_scorers = (f"[{{path: {FAULTS}.GroupFault, kwargs: {{faults: {{g10001: raise, g10002: nan, g10003: hang, "
                   f"g10004: out_of_range}}}}}}, {{path: {FAULTS}.FailingClose}}]")
    cfg = load_config(None, [
        *SMALL, "steps=1", "rollout.tasks_per_step=6", "rollout.strategy=patr",
        f"rollout.branch_scorer={{path: {FAULTS}.GroupFault, kwargs: {{faults: {{g10000: raise}}}}}}",
        "prm.enabled=true", f"prm.scorers={prm_scorers}", "prm.timeout_s=3",
        "prm.advantage_shaping.mode=process_weighted", f"run_dir={tmp_path / 'run'}",
    ])
    summary = train(cfg, log=logs.append)

    rows = read_metrics(Path(summary.run_dir) / "metrics.jsonl")
    (row,) = [r for r in rows if r["kind"] == "train"]
    # the branch scorer rejected exactly group 0 at rollout; scoring rejected exactly groups 1-4, each for its reason
    assert row["branch_rejected_groups"] == 1 and row["branch_rejected/failed"] == 1
    assert row["prm_rejected_groups"] == 4
    assert {k: row[k] for k in row if k.startswith("prm_rejected/")} == {
        "prm_rejected/failed": 1, "prm_rejected/invalid": 1, "prm_rejected/timeout": 1, "prm_rejected/out_of_range": 1}
    # training went on with the one clean group: its leaves are the batch
    assert row["kept_groups"] == 1 and row["rows"] == row["trajectories"] / 5 and "loss" in row
    # metrics come from fully scored groups only, under the spec's names
    assert row["rollout/prm_turn_reward/group_fault"] == pytest.approx(0.5)
    assert row["rollout/prm_turn_reward/failing_close"] == 0.0
    assert not any(k.startswith("prm/") for k in row)
    (ev,) = [r for r in rows if r["kind"] == "eval"]
    assert ev["eval-rollout/prm_turn_reward/group_fault"] == pytest.approx(0.5) and ev["prm_rejected_groups"] == 0
    # the scorers closed first (the server still up), the failing close only warned, everything else closed
    assert fault_scorers.SEEN["server_alive_at_scorer_close"] is True
    assert any("closing the process-reward scorers failed" in m for m in logs)
    assert set(_server_threads()) <= before


def test_a_scorer_that_fails_at_startup_stops_the_run_and_closes_everything(tmp_path):
    before = set(_server_threads())
    cfg = load_config(None, [*SMALL, "steps=1", "rollout.tasks_per_step=1", "prm.enabled=true",
                             f"prm.scorers=[{{path: {FAULTS}.FailingStart}}]", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(TrainError, match="prm: could not build the scorers: RuntimeError: injected startup failure"):
        train(cfg)
    assert set(_server_threads()) <= before


def test_cleanup_runs_every_closer_and_keeps_the_original_error():
    order, logs = [], []
    c = Cleanup(logs.append)

    async def bad_async():
        order.append("scorers")
        raise RuntimeError("scorer close failed")

    def bad_sync():
        order.append("metrics")
        raise OSError("disk full")

    c.push("checkpointer", lambda: order.append("checkpointer"))
    c.push("metrics log", bad_sync)
    c.push("server", lambda: order.append("server"))
    c.push("process-reward scorers", bad_async)
    original = ValueError("the step failed")
    asyncio.run(c.aclose(original))
    assert order == ["scorers", "server", "metrics", "checkpointer"]  # reverse order, none skipped
    assert original.__notes__ == ["closing the process-reward scorers failed: RuntimeError: scorer close failed",
                                  "closing the metrics log failed: OSError: disk full"]
    c.push("metrics log", bad_sync)
    c.close(None)  # after a successful run: logged, not raised
    assert logs == ["warning: closing the metrics log failed: OSError: disk full"]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["prm.scorers=[{path: scorers.NoSuchScorer}]"], "prm.scorers[0].path"),
        (["prm.scorers=[{path: scorers.LengthBudgetScorer, kwargs: {max_tokens: 3}}]"],
         "prm.scorers[0].kwargs: LengthBudgetScorer has no argument(s) ['max_tokens']"),
        (["prm.scorers=[{path: scorers.LengthBudgetScorer}]"], "prm.scorers[0].kwargs: LengthBudgetScorer needs ['max_output_tokens']"),
        (["prm.scorers=[{path: scorers.LLMJudgeScorer, kwargs: {base_url: 'http://h:1', model: m, timeot_s: 3}}]"],
         "has no argument(s) ['timeot_s']"),
        (["prm.scorers=[{path: scorers.LengthBudgetScorer, kwargs: {max_output_tokens: 8}}, "
          "{path: scorers.LengthBudgetScorer, kwargs: {max_output_tokens: 9}}]"], "is already used by prm.scorers[0]"),
        (["prm.advantage_shaping.mode=process_weighted",
          "prm.scorers=[{path: scorers.FrozenLakeProgressScorer, kwargs: {mode: delta}}]"], "can reach [-1, 1]"),
        (["prm.advantage_shaping.mode=process_weighted",
          "prm.scorers=[{path: scorers.LengthBudgetScorer, weight: 0.7, kwargs: {max_output_tokens: 8}}, "
          "{path: scorers.FrozenLakeProgressScorer, weight: 0.5}]"], "can reach [0, 1.2]"),
    ],
)
def test_scorer_specs_are_resolved_and_checked_when_the_config_loads(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["prm.enabled=true", *overrides])
    assert fragment in str(info.value)


def test_branch_scorer_spec_is_checked_at_load_and_print_config_reports_it():
    with pytest.raises(ConfigError, match=r"rollout.branch_scorer.kwargs: FrozenLakeProgressScorer has no argument"):
        load_config(None, ["rollout.branch_scorer={path: scorers.FrozenLakeProgressScorer, kwargs: {mdoe: delta}}"])
    out = subprocess.run([sys.executable, "-m", "jaxprm.train", "--print-config", "prm.enabled=true",
                          "prm.scorers=[{path: scorers.NoSuchScorer}]"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 2 and "prm.scorers[0].path" in out.stderr and "Traceback" not in out.stderr


def _refusing_server(**script):
    tok = make_test_tokenizer()
    return ScriptedServer(ServerScript(policy=hashed_action_policy(tok), **script), tok)


@pytest.mark.parametrize("script", [{"fail_statuses": [500] * 20}, {"text_only": True}])
def test_a_server_without_token_in_token_out_is_refused_at_start_in_one_line(tmp_path, script):
    with _refusing_server(**script) as srv:
        cfg = load_config(None, [*SMALL, "server.kind=external", f"server.urls=[{srv.url}]", "server.max_retries=5",
                                 f"run_dir={tmp_path / 'run'}"])
        with pytest.raises(TrainError, match="does not accept token-in/token-out requests") as info:
            train(cfg)
        assert "\n" not in str(info.value)
        assert srv.script.requests == 1  # probed once, not retried as a transient error


def test_patr_judge_config_builds_its_branch_scorer():
    from jaxprm.train import adapters
    from scorers import LLMJudgeScorer

    scorer = adapters.branch_scorer(load_config(ROOT / "configs/patr_judge.yaml"))
    assert isinstance(scorer, LLMJudgeScorer) and scorer.judge_weight == 0.7
    assert scorer.http.base_url == "http://127.0.0.1:8001" and scorer.http.timeout_s == 30
