"""Process rewards wired into the trainer, with injected faults: the spec's failure rules end to end.

One short in-process run covers most rules at once: of six groups, PaTR's branch scorer rejects the
first at its checkpoint, and the process-reward scorer raises on the second, returns NaN on the
third, hangs past the timeout on the fourth and leaves [0, 1] under process_weighted on the fifth
(each after scoring another branch of the same group); only the sixth is trained. Groups are scored
two at a time. A second scorer fails in ``aclose``. Faster checks of the same wiring follow: runs that
fail at startup or mid-step (everything closed, the original error kept), load-time checks, the
server probe and the command line's one-line errors, the PaTR-Judge / PaTR-PRM configs steering a tree.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaxprm.train import adapters
from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.loop import TrainError, train
from jaxprm.train.setup import Cleanup
from jaxprm.train.rundir import read_metrics
from rollout.client import ClientConfig, GenerationClient
from rollout.testing import ScriptedServer, ServerScript, hashed_action_policy, make_test_tokenizer
from rollout.tree import run_group
from rollout.filters import FILTER_COUNTERS
from tests.scorers.scorer_http_server import ScriptedServer as ScorerServer
from tests.train import fault_scorers
from tests.train.llamacpp_like import LlamaCppLike

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


def _open_files_under(path: Path) -> list[str]:
    """Files under ``path`` this process still holds open (the metrics log, TensorBoard, the lock)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def test_faulty_groups_are_dropped_with_their_reason_and_training_goes_on(tmp_path):
    before = set(_server_threads())  # servers of other test modules may be up
    fault_scorers.SEEN.clear()
    logs: list[str] = []
    prm_scorers = (f"[{{path: {FAULTS}.GroupFault, kwargs: {{faults: {{g10001: raise, g10002: nan, g10003: hang, "
                   f"g10004: out_of_range}}}}}}, {{path: {FAULTS}.FailingClose}}]")
    # prm.timeout_s: the hanging group waits it out; the clean groups' scoring (well under a second)
    # must fit in it on a loaded machine too (3 s did not, beside two busy loops and another suite)
    cfg = load_config(None, [
        *SMALL, "steps=1", "rollout.tasks_per_step=6", "rollout.strategy=patr",
        f"rollout.branch_scorer={{path: {FAULTS}.GroupFault, kwargs: {{faults: {{g10000: raise}}}}}}",
        "prm.enabled=true", f"prm.scorers={prm_scorers}", "prm.timeout_s=10", "prm.max_concurrent_sessions=2",
        "prm.advantage_shaping.mode=process_weighted", f"run_dir={tmp_path / 'run'}",
    ])
    summary = train(cfg, log=logs.append)

    rows = read_metrics(Path(summary.run_dir) / "metrics.jsonl")
    (row,) = [r for r in rows if r["kind"] == "train"]
    # the branch scorer rejected exactly group 0 at rollout; scoring rejected exactly groups 1-4, each for its reason
    assert row["branch_rejected_groups"] == 1 and row["branch_rejected/failed"] == 1
    # ... and its counts and log line name the scorer's own error under ScoringRejected (issue 43)
    assert row["branch_rejected_cause/RuntimeError"] == 1
    assert any("rejected group g10000" in m and m.endswith("[cause: ScoringRejected <- RuntimeError]") for m in logs)
    assert row["prm_rejected_groups"] == 4
    assert {k: row[k] for k in row if k.startswith("prm_rejected/")} == {
        "prm_rejected/failed": 1, "prm_rejected/invalid": 1, "prm_rejected/timeout": 1, "prm_rejected/out_of_range": 1}
    # training went on with the one clean group: its leaves are the batch
    assert row["kept_groups"] == 1 and row["rows"] == row["trajectories"] / 5 and "loss" in row
    # metrics come from fully scored groups only (a rejected group's first branch scored 0.9), under the spec's names
    assert row["rollout/prm_turn_reward/group_fault"] == pytest.approx(0.5)
    assert row["rollout/prm_turn_reward/failing_close"] == 0.0
    assert not any(k.startswith("prm/") for k in row)
    (ev,) = [r for r in rows if r["kind"] == "eval"]
    assert ev["eval-rollout/prm_turn_reward/group_fault"] == pytest.approx(0.5) and ev["prm_rejected_groups"] == 0
    # groups were scored concurrently, never more than prm.max_concurrent_sessions at once
    assert fault_scorers.SEEN["max_groups_in_flight"] == 2
    # the scorers closed first (the server still up), the failing close only warned, everything else closed
    assert fault_scorers.SEEN["server_alive_at_scorer_close"] is True
    assert any("closing the process-reward scorers failed: RuntimeError: injected aclose failure" in m for m in logs)
    assert set(_server_threads()) <= before and not _open_files_under(Path(summary.run_dir))


def test_a_judge_that_answers_500_rejects_groups_and_the_counts_name_its_http_error(tmp_path):
    logs: list[str] = []
    judge = ScorerServer().start()
    judge.defaults["chat"] = {"status": 500}
    try:
        cfg = load_config(ROOT / "configs/patr_judge.yaml", [
            *SMALL, "steps=1", "rollout.tasks_per_step=2", "eval.num_tasks=1", "env.max_turns=2", "rollout.k=1",
            f"rollout.branch_scorer.kwargs.base_url={judge.url}", "rollout.branch_scorer.kwargs.max_retries=1",
            "rollout.branch_scorer.kwargs.backoff_s=0", f"run_dir={tmp_path / 'run'}"])
        summary = train(cfg, log=logs.append)
    finally:
        judge.stop()
    (row,) = [r for r in read_metrics(Path(summary.run_dir) / "metrics.jsonl") if r["kind"] == "train"]
    assert row["branch_rejected_groups"] == 2 and row["branch_rejected_cause/ScorerHTTPError"] == 2
    assert row["kept_groups"] == 0
    lines = [m for m in logs if "branch scorer rejected group" in m]
    assert len(lines) == 2 and all("HTTP 500" in m and m.endswith("[cause: ScoringRejected <- ScorerHTTPError]")
                                   for m in lines)


def test_a_scorer_that_fails_at_startup_stops_the_run_and_closes_everything(tmp_path):
    before = set(_server_threads())
    fault_scorers.SEEN.clear()
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*SMALL, "steps=1", "rollout.tasks_per_step=1", "prm.enabled=true",
                             f"prm.scorers=[{{path: {FAULTS}.FailingClose}}, {{path: {FAULTS}.FailingStart}}]",
                             f"run_dir={run_dir}"])
    with pytest.raises(TrainError, match="prm: could not build the scorers: RuntimeError: injected startup failure") \
            as info:
        train(cfg)
    # the scorer built before the failing one was closed (the server still up); its failing close is a note
    assert fault_scorers.SEEN["server_alive_at_scorer_close"] is True
    assert info.value.__notes__ == [f"while constructing prm.scorers[1] ({FAULTS}.FailingStart)",
                                    "cleanup of scorer 'failing_close' after the startup failure also failed: "
                                    "RuntimeError: injected aclose failure"]
    # the embedded server, its client, the metrics log, TensorBoard, the checkpointer and the lock are closed
    assert set(_server_threads()) <= before and not _open_files_under(run_dir)


def _stalls_after_the_probe() -> ScriptedServer:
    """A generation server that answers the trainer's start-up probe, then stops answering."""
    tok = make_test_tokenizer()
    return ScriptedServer(ServerScript(policy=hashed_action_policy(tok), delay_queue=[0.0], delay_s=5.0), tok)


def test_a_run_that_fails_mid_step_closes_everything_and_raises_the_original_error(tmp_path):
    fault_scorers.SEEN.clear()
    run_dir = tmp_path / "run"
    with _stalls_after_the_probe() as srv:
        cfg = load_config(None, [
            *SMALL, "steps=1", "rollout.tasks_per_step=1", "rollout.strategy=flat", "server.kind=external",
            f"server.urls=[{srv.url}]", "server.max_retries=0", "server.timeout_s=1", "prm.enabled=true",
            f"prm.scorers=[{{path: {FAULTS}.FailingClose}}]", f"run_dir={run_dir}"])
        with pytest.raises(TrainError) as info:
            train(cfg)
    msg = str(info.value)
    assert msg.startswith("group 'g10000' failed: GenerationError: ") and "ReadTimeout" in msg and "\n" not in msg
    # the scorers were closed although the step failed; their failing close does not hide the error
    assert info.value.__notes__ == ["closing the process-reward scorers failed: RuntimeError: injected aclose failure"]
    assert "server_alive_at_scorer_close" in fault_scorers.SEEN and not _open_files_under(run_dir)


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
        # built once at load: the constructors' own checks fail here, not after warm start and server start
        (["prm.scorers=[{path: scorers.LengthBudgetScorer, kwargs: {max_output_tokens: -3}}]"],
         "prm.scorers[0].kwargs: scorers.LengthBudgetScorer could not be built: ValueError"),
        (["prm.scorers=[{path: scorers.PRMModelScorer, kwargs: {base_url: 'http://h:1', model: m, "
          "tokenizer: /no/such/tokenizer.json, step_separator_id: 12}}]"],
         "prm.scorers[0].kwargs: scorers.PRMModelScorer could not be built: ValueError: "
         "tokenizer='/no/such/tokenizer.json' could not be loaded"),
        ([f"prm.scorers=[{{path: {FAULTS}.FailingBuild}}]"],
         f"prm.scorers[0].kwargs: {FAULTS}.FailingBuild could not be built: RuntimeError: injected build failure"),
    ],
)
def test_scorer_specs_are_resolved_and_checked_when_the_config_loads(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["prm.enabled=true", *overrides])
    assert fragment in str(info.value)


def test_branch_scorer_spec_is_checked_at_load_and_print_config_reports_it():
    with pytest.raises(ConfigError, match=r"rollout.branch_scorer.kwargs: FrozenLakeProgressScorer has no argument"):
        load_config(None, ["rollout.strategy=patr",
                           "rollout.branch_scorer={path: scorers.FrozenLakeProgressScorer, kwargs: {mdoe: delta}}"])
    with pytest.raises(ConfigError, match=r"rollout.branch_scorer.kwargs: scorers.FrozenLakeProgressScorer could not "
                                          r"be built: ValueError"):
        load_config(None, ["rollout.strategy=patr",
                           "rollout.branch_scorer={path: scorers.FrozenLakeProgressScorer, kwargs: {mode: sideways}}"])
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


def _cli(capsys, *overrides: str) -> tuple[int, list[str]]:
    """``python -m jaxprm.train *SMALL *overrides`` in this process (an uncaught error would fail the
    test as its traceback would fail the user): the exit status and the lines printed to stderr."""
    from jaxprm.train.__main__ import main

    capsys.readouterr()
    rc = main([*SMALL, *overrides])
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_the_command_line_refuses_a_llama_cpp_like_server_in_one_line(tmp_path, capsys):
    with LlamaCppLike() as srv:
        rc, lines = _cli(capsys, "server.kind=external", f"server.urls=[{srv.url}]", f"run_dir={tmp_path / 'run'}")
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith(f"error: the generation server {srv.url} does not accept token-in/token-out requests")
    assert "HTTP 500: " in lines[0] and "type must be string, but is array" in lines[0] and "use vLLM" in lines[0]
    assert srv.token_prompts == 1  # probed once: a refusal dressed as a 5xx is not retried


def test_the_command_line_reports_a_rollout_failure_in_one_line(tmp_path, capsys):
    with _stalls_after_the_probe() as srv:
        rc, lines = _cli(capsys, "server.kind=external", f"server.urls=[{srv.url}]", "server.max_retries=1",
                         "server.timeout_s=1", "rollout.strategy=flat", "rollout.tasks_per_step=1",
                         f"run_dir={tmp_path / 'run'}")
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith("error: group 'g10000' failed: GenerationError: ") and "after 2 attempts" in lines[0]


def test_a_branch_scorer_that_cannot_be_built_stops_the_run_in_one_line(tmp_path):
    # the shipped config's placeholder tokenizer path is refused when the config loads ...
    with pytest.raises(ConfigError, match=r"rollout.branch_scorer.kwargs: scorers.PRMModelScorer could not be built"):
        load_config(ROOT / "configs/patr_prm.yaml", [*SMALL, f"run_dir={tmp_path / 'run'}"])
    # ... and a scorer that built at load but fails when the trainer builds it stops the run in one line
    fault_scorers.SEEN.clear()
    cfg = load_config(None, [*SMALL, "rollout.strategy=patr", f"rollout.branch_scorer={{path: {FAULTS}.FailingStart}}",
                             f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(TrainError, match=rf"^rollout.branch_scorer: could not build {FAULTS}.FailingStart: ") as info:
        train(cfg)
    assert "injected startup failure" in str(info.value) and "\n" not in str(info.value)


def _first_checkpoint_scores(cfg, tokenizer) -> list[float]:
    """One PaTR group for the config's first task against a scripted generation server; the scores of
    its first checkpoint."""
    with ScriptedServer(ServerScript(policy=hashed_action_policy(tokenizer)), tokenizer) as gen:
        async def go():
            scorer = adapters.branch_scorer(cfg)
            try:
                async with GenerationClient(ClientConfig(endpoints=(gen.url,))) as client:
                    return await run_group(adapters.tasks(cfg)[0][0], env_factory=adapters.env_factory(cfg),
                                           client=client, prompts=tokenizer, config=adapters.tree_config(cfg, max_context=None),
                                           scorer=scorer)
            finally:
                await scorer.aclose()

        group = asyncio.run(go())
    return group.stats.checkpoints[0].scores


@pytest.mark.parametrize("variant", ["patr_judge", "patr_prm"])
def test_the_patr_judge_and_patr_prm_configs_steer_the_tree(tmp_path, variant):
    tok = make_test_tokenizer()
    small = ["env.train_tasks=2", "env.eval_tasks=1", "eval.num_tasks=1", "env.max_turns=2",
             "rollout.k=1", "rollout.b0=2", "rollout.top_k=1", "rollout.group_size=4", "env.invalid_ends_episode=false"]
    judge = ScorerServer().start()  # an OpenAI-compatible chat route and a vLLM-style /pooling route
    try:
        kw = [f"rollout.branch_scorer.kwargs.base_url={judge.url}"]
        if variant == "patr_prm":  # the PRM's tokenizer file; its separator id (12) is a token of it
            tok.tokenizer.save(str(tmp_path / "tokenizer.json"))
            kw.append(f"rollout.branch_scorer.kwargs.tokenizer={tmp_path / 'tokenizer.json'}")
        cfg = load_config(ROOT / f"configs/{variant}.yaml", [*small, *kw])
        runs = {}
        for answer in (0.0, 1.0):  # the judge's rating / the PRM's logit at every step separator
            judge.reset()
            if variant == "patr_judge":
                judge.defaults["chat"] = {"content": f'Rating: {{"score": {answer}, "reason": "the {{x}} branch"}}'}
            else:
                judge.pooling_fn = lambda ids, v=answer: [v] * len(ids)
            runs[answer] = _first_checkpoint_scores(cfg, tok)
            endpoint = "chat" if variant == "patr_judge" else "pooling"
            assert len(judge.requests[endpoint]) >= len(runs[answer]) == 2  # every checkpoint branch was scored there
            assert all(r["model"] == cfg.rollout.branch_scorer.kwargs["model"] for r in judge.requests[endpoint])
    finally:
        judge.stop()
    if variant == "patr_judge":  # judge_weight 0.7 of the score is the judge's, the rest a heuristic
        assert [b - a for a, b in zip(runs[0.0], runs[1.0])] == pytest.approx([0.7, 0.7])
    else:  # the PRM's step scores are sigmoid(logit), aggregated over the last step
        assert runs[0.0] == pytest.approx([0.5, 0.5]) and runs[1.0] == pytest.approx([1 / (1 + math.exp(-1))] * 2)


def test_the_group_filter_runs_in_the_trainer_and_records_the_references_counters(tmp_path):
    cfg = load_config(None, [
        *SMALL, "steps=1", "rollout.tasks_per_step=4", "rollout.strategy=flat",
        "rollout.filter=mixed_or_penalized_all_wrong_mask_no_eos", "prm.enabled=true",
        "prm.scorers=[{path: scorers.FrozenLakeProgressScorer, kwargs: {mode: delta}}]", f"run_dir={tmp_path / 'run'}",
    ])
    summary = train(cfg)
    (row,) = [r for r in read_metrics(Path(summary.run_dir) / "metrics.jsonl") if r["kind"] == "train"]
    counters = {k.removeprefix("filter/"): v for k, v in row.items() if k.startswith("filter/")}
    assert set(counters) == set(FILTER_COUNTERS)  # every counter of the reference, zero when unused
    accepted = counters["accepted_mixed"] + counters["accepted_penalized_all_wrong"]
    rejected = counters["rejected_by_all_correct"] + counters["rejected_by_all_wrong"]
    assert accepted + rejected == 4 and counters["rejected_by_failed_or_perfect"] == rejected
    assert row["kept_groups"] == accepted
