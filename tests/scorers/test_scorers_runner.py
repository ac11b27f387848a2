"""PRMRunner.run / score_branches: combination, validation, atomic commits, isolation, metrics."""

from __future__ import annotations

import asyncio
import copy
import math
import time

import numpy as np
import pytest

from prm_test_scorers import (
    ConstScorer,
    CtxRecordingScorer,
    DenseScorer,
    MutatingScorer,
    ObservingScorer,
    OtherConstScorer,
    PerTurnScorer,
    SlowScorer,
    TrajScorer,
    chain,
    obs,
    run,
    tree_of,
    turn,
)
from rollout.types import Interaction, InteractionTree
from scorers import (
    BaseScorer,
    LengthBudgetScorer,
    PRMConfig,
    PRMRunner,
    PRMScorerResult,
    ScoringRejected,
    SessionScores,
    score_branch,
)


def runner(*scorers, config=None):
    return PRMRunner(config or PRMConfig(), scorers=list(scorers))


# -- combination ------------------------------------------------------------------------------------


def test_scalars_broadcast_dense_keep_positions_weights_multiply_and_add():
    branch = chain([3, 4])
    r = runner(ConstScorer(0.5, weight=2.0), DenseScorer(scale=1.0, weight=-0.5))
    res = run(r.run(branch))
    assert list(res) == ["t0", "t1"]
    np.testing.assert_allclose(res["t0"], 1.0 - 0.5 * np.arange(3))
    np.testing.assert_allclose(res["t1"], 1.0 - 0.5 * np.arange(4))
    assert res["t0"].dtype == np.float32
    # committed onto the interactions too
    np.testing.assert_allclose(branch[1].token_rewards, res["t1"])
    # per-turn reward metric = mean of the weighted contribution; totals = sum over turns
    by = {(t.scorer_name, t.interaction_id): t.reward for t in res.turn_results}
    assert by[("const", "t0")] == pytest.approx(1.0)
    assert by[("dense", "t1")] == pytest.approx(-0.5 * 1.5)
    assert res.branch_totals == {"const": pytest.approx(2.0), "dense": pytest.approx(-0.5 - 0.75)}


def test_results_add_to_existing_token_rewards():
    branch = chain([2])
    branch[0].token_rewards = np.array([1.0, -1.0], dtype=np.float32)
    res = run(runner(ConstScorer(0.5)).run(branch))
    np.testing.assert_allclose(res["t0"], [1.5, -0.5])


def test_existing_token_rewards_must_match_and_be_finite():
    branch = chain([2])
    branch[0].token_rewards = np.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        run(runner(ConstScorer()).run(branch))
    branch[0].token_rewards = np.array([0.0, math.nan])
    with pytest.raises(ValueError, match="non-finite"):
        run(runner(ConstScorer()).run(branch))


def test_disabled_scorers_are_skipped_and_no_scorer_gives_zeros():
    branch = chain([2, 2])
    res = run(runner(ConstScorer(5.0, enabled=False), OtherConstScorer(1.0)).run(branch))
    np.testing.assert_allclose(res["t1"], [1.0, 1.0])
    assert set(res.branch_totals) == {"other_const"}
    empty = run(PRMRunner(PRMConfig(enabled=False)).run(chain([3])))
    np.testing.assert_array_equal(empty["t0"], np.zeros(3))


def test_order_is_parent_before_child_whatever_the_input_order():
    branch = chain([1, 1, 1])
    t = TrajScorer(result={})
    res = run(runner(t).run(list(reversed(branch))))
    assert t.seen_order == ["t0", "t1", "t2"] and list(res) == ["t0", "t1", "t2"]


def test_turns_of_one_scorer_run_concurrently():
    s = SlowScorer()
    branch = chain([1, 1, 1])

    async def go():
        s.gate = asyncio.Event()
        task = asyncio.create_task(runner(s).run(branch))
        for _ in range(50):
            await asyncio.sleep(0)
            if s.started == 3:
                break
        assert s.started == 3  # all three turns in flight before any finished
        s.gate.set()
        return await task

    res = run(go())
    assert len(res) == 3


# -- rejection ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "returned None"),
        (RuntimeError("judge down"), "RuntimeError: judge down"),
        (math.nan, "non-finite"),
        (np.array([1.0, math.inf, 0.0, 0.0]), "non-finite"),
        (np.zeros(3), r"shape \(3,\), expected \(4,\)"),
        (np.zeros((4, 1)), "shape"),
        (True, "bool"),
        ("0.5", "real number"),
        ({"a": 1}, "real number"),
    ],
)
def test_any_bad_turn_rejects_the_trajectory_and_commits_nothing(value, match):
    branch = chain([4, 4])
    before = [it.token_rewards for it in branch]
    r = runner(ConstScorer(1.0), PerTurnScorer({"t1": value}))
    with pytest.raises(ScoringRejected, match=match) as info:
        run(r.run(branch))
    assert info.value.scorer == "per_turn" and info.value.interaction_ids == ("t1",)
    # the first scorer validated, but nothing reaches the interactions of a rejected run
    assert [it.token_rewards for it in branch] == before


def test_exception_is_chained_as_cause():
    err = KeyError("missing")
    with pytest.raises(ScoringRejected) as info:
        run(runner(PerTurnScorer({"t0": err})).run(chain([2])))
    assert info.value.__cause__ is err


def test_rejection_lists_every_failed_turn():
    r = runner(PerTurnScorer({"t0": None, "t2": ValueError("bad")}, default=1.0))
    with pytest.raises(ScoringRejected, match="2/3 turns") as info:
        run(r.run(chain([1, 1, 1])))
    assert info.value.interaction_ids == ("t0", "t2")


def test_weighting_overflow_is_rejected():
    with pytest.raises(ScoringRejected, match="after weighting"):
        run(runner(ConstScorer(1e300, weight=1e10)).run(chain([2])))
    with pytest.raises(ScoringRejected, match="after weighting"):
        run(runner(ConstScorer(1e30, weight=1e10)).run(chain([2])))  # finite in f64, inf in f32


def test_summed_rewards_must_stay_finite():
    with pytest.raises(ScoringRejected, match="summed token rewards"):
        run(runner(ConstScorer(3e38), OtherConstScorer(3e38)).run(chain([2])))


def test_empty_output_rejects_and_string_only_turns_are_refused():
    it = turn("e", None, 0)
    with pytest.raises(ScoringRejected, match="no output tokens"):
        run(runner(ConstScorer()).run([it]))
    bare = Interaction(id="s", parent_id=None, messages=[], output_messages=[])
    with pytest.raises(ValueError, match="token-backed"):
        run(runner(ConstScorer()).run([bare]))
    dup = chain([1, 1])
    dup[1].id = "t0"
    with pytest.raises(ValueError, match="duplicate"):
        run(runner(ConstScorer()).run(dup))


def test_cancelling_run_cancels_inflight_turns_and_propagates():
    s = SlowScorer()

    async def go():
        s.gate = asyncio.Event()
        task = asyncio.create_task(runner(s).run(chain([1, 1])))
        while s.started < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    assert s.cancelled == 2


# -- trajectory scorers ---------------------------------------------------------------------------------


def test_trajectory_scorer_missing_ids_get_zero_and_values_broadcast():
    branch = chain([2, 3, 1])
    t = TrajScorer(result={"t1": 2.0, "t2": np.array([0.5])}, weight=0.5)
    res = run(runner(t).run(branch))
    np.testing.assert_allclose(res["t0"], [0, 0])
    np.testing.assert_allclose(res["t1"], [1, 1, 1])
    np.testing.assert_allclose(res["t2"], [0.25])


@pytest.mark.parametrize(
    ("result", "match"),
    [
        ({"t0": 1.0, "ghost": 1.0}, r"unknown interaction ids \['ghost'\]"),
        (None, "returned None for the whole trajectory"),
        ([1.0, 2.0], "must return a mapping"),
        ({"t1": None}, "returned None"),
    ],
)
def test_trajectory_scorer_rejections(result, match):
    with pytest.raises(ScoringRejected, match=match):
        run(runner(TrajScorer(result=result)).run(chain([1, 1])))


def test_trajectory_scorer_exception_rejects():
    def boom(interactions):
        raise RuntimeError("joint judge failed")

    with pytest.raises(ScoringRejected, match="joint judge failed"):
        run(runner(TrajScorer(fn=boom)).run(chain([1])))


def test_trajectory_scorer_may_return_structured_results():
    t = TrajScorer(fn=lambda its: {its[0].id: PRMScorerResult(1.0, (obs("good", its[0].id),))})
    res = run(runner(t).run(chain([1, 1])))
    assert res.turn_results[0].observations[0].metric_id == "good"


# -- observations ---------------------------------------------------------------------------------------


def test_turn_observation_must_target_its_interaction():
    s = ObservingScorer(make=lambda it: [obs("m", "someone-else")])
    with pytest.raises(ScoringRejected, match="targets 'someone-else'"):
        run(runner(s).run(chain([1])))


def test_trajectory_observations_may_target_anything_but_not_twice():
    ok = ObservingScorer(make=lambda it: [obs("m", "leaf", scope="trajectory")] if it.id == "t0" else [])
    run(runner(ok).run(chain([1, 1])))
    dup = ObservingScorer(make=lambda it: [obs("m", "leaf", scope="trajectory")])
    with pytest.raises(ScoringRejected, match="duplicate observation"):
        run(runner(dup).run(chain([1, 1])))


def test_schema_must_be_consistent_within_a_run():
    def make(it):
        return [obs("m", it.id)] if it.id == "t0" else [obs("m", it.id, 1.0, "float", ("mean",))]

    with pytest.raises(ScoringRejected, match="schema"):
        run(runner(ObservingScorer(make=make)).run(chain([1, 1])))


def test_schema_change_across_runs_raises_and_does_not_bind_on_failure():
    state = {"aggs": ("count",)}
    s = ObservingScorer(make=lambda it: [obs("m", it.id, aggs=state["aggs"])])
    r = runner(s)
    run(r.run(chain([1])))
    state["aggs"] = ("rate",)
    with pytest.raises(ScoringRejected, match="schema changed"):
        run(r.run(chain([1])))
    # a rejected run binds no schema: a fresh metric whose run fails stays unbound
    bad = ObservingScorer(make=lambda it: [obs("fresh", it.id)] if it.id == "t0" else [obs("x", "other")])
    r2 = runner(bad)
    with pytest.raises(ScoringRejected):
        run(r2.run(chain([1, 1])))
    bad.make = lambda it: [obs("fresh", it.id, 1.0, "float", ("sum",))]
    run(r2.run(chain([1, 1])))


# -- context and isolation --------------------------------------------------------------------------------


def test_ctx_has_branch_conversation_branch_turn_index_and_eval_flag():
    sink: list = []
    branch = chain([1, 1, 1])
    run(runner(CtxRecordingScorer(sink)).run(branch, {"extra": 1}, is_eval=True))
    full = len(branch[-1].messages) + 1
    assert sorted(sink) == [
        ("t0", full, ["t0", "t1", "t2"], 0, True),
        ("t1", full, ["t0", "t1", "t2"], 1, True),
        ("t2", full, ["t0", "t1", "t2"], 2, True),
    ]


def test_a_mutating_scorer_changes_nothing_else():
    tree = InteractionTree()
    a = chain([2, 2, 2], "a")
    for it in a:
        tree.add(it)
    tree.add(turn("b2", "a1", 3, messages=copy.deepcopy(a[2].messages)))
    snapshot = [(it.id, copy.deepcopy(it.messages), copy.deepcopy(it.output_messages), it.reward, dict(it.env_state)) for it in tree]
    sink: list = []
    r = runner(MutatingScorer(), CtxRecordingScorer(sink), LengthBudgetScorer(max_output_tokens=10))
    sess = run(r.score_branches(tree))
    # the tree is untouched
    assert [(it.id, it.messages, it.output_messages, it.reward, it.env_state) for it in tree] == snapshot
    assert all(it.token_rewards is None for it in tree)
    # the scorer after the vandal saw intact inputs
    for iid, n_msgs, branch_ids, _, _ in sink:
        assert branch_ids in (["a0", "a1", "a2"], ["a0", "a1", "b2"])
        assert n_msgs == len(a[2].messages) + 1
    assert set(sess.token_rewards) == {"a2", "b2"}
    np.testing.assert_allclose(sess.token_rewards["b2"]["b2"], [2.0, 2.0, 2.0])


def test_read_only_views_of_other_turns_refuse_mutation():
    class PeekScorer(ConstScorer):
        name = "peek"

        async def evaluate(self, interaction, ctx):
            other = next(b for b in ctx["branch"] if b.id != interaction.id)
            other.messages[0]["content"] = "x"  # read-only view -> TypeError
            return 1.0

    with pytest.raises(ScoringRejected, match="read-only"):
        run(runner(PeekScorer()).run(chain([1, 1])))


# -- score_branches -----------------------------------------------------------------------------------------


def _tree():
    tree = InteractionTree()
    base = chain([2, 3], "r")
    for it in base:
        tree.add(it)
    tree.add(turn("x", "r1", 4, messages=[*base[1].messages]))
    tree.add(turn("y", "r1", 5, messages=[*base[1].messages]))
    return tree


def test_score_branches_returns_branch_local_rewards_per_leaf_and_metrics():
    tree = _tree()
    r = runner(LengthBudgetScorer(max_output_tokens=4, weight=0.5), ConstScorer(1.0))
    sess = run(r.score_branches(tree))
    assert set(sess.token_rewards) == {"x", "y"}
    assert set(sess.token_rewards["x"]) == {"r0", "r1", "x"}
    np.testing.assert_allclose(sess.token_rewards["y"]["y"], [1.0] * 5)  # over budget: 0 * .5 + 1
    np.testing.assert_allclose(sess.token_rewards["x"]["x"], [1.5] * 4)
    m = sess.metrics.summary()
    # turns: x-branch 3 turns, y-branch 3 turns (shared ancestors counted per branch)
    assert m["rollout/prm_turn_reward/const"] == pytest.approx(1.0)
    assert m["rollout/prm_turn_reward/length_budget"] == pytest.approx(0.5 * 5 / 6)
    assert m["rollout/prm_trajectory_reward/length_budget"] == pytest.approx((1.5 + 1.0) / 2)
    assert m["rollout/prm_metric/turn/length_budget/within_budget/count"] == 5
    assert m["rollout/prm_metric/turn/length_budget/within_budget/rate"] == pytest.approx(5 / 6)
    assert sess.branch_totals["x"]["const"] == pytest.approx(3.0)
    assert all(it.token_rewards is None for it in tree)


def test_eval_sessions_use_the_eval_namespace():
    sess = run(runner(ConstScorer()).score_branches(_tree(), is_eval=True))
    assert sess.metrics.namespace == "eval-rollout"
    assert all(k.startswith("eval-rollout/") for k in sess.metrics.summary())


def test_one_failing_branch_rejects_the_whole_session():
    r = runner(ConstScorer(), PerTurnScorer({"y": None}))
    with pytest.raises(ScoringRejected, match="branch ending at 'y'") as info:
        run(r.score_branches(_tree()))
    assert info.value.leaf_id == "y" and info.value.scorer == "per_turn"


def test_score_branches_on_an_empty_tree():
    sess = run(runner(ConstScorer()).score_branches(InteractionTree()))
    assert sess.token_rewards == {} and len(sess.metrics) == 0


def test_score_branches_scores_exactly_the_given_leaves():
    sink: list = []
    sess = run(runner(CtxRecordingScorer(sink)).score_branches(_tree(), leaf_ids=["y"]))
    assert set(sess.token_rewards) == {"y"} and [c[2][-1] for c in sink] == ["y"] * 3  # only y's branch


def test_process_weighted_rewards_outside_unit_range_reject_the_session():
    cfg = PRMConfig(advantage_shaping={"mode": "process_weighted"})
    run(runner(ConstScorer(1.0), config=cfg).score_branches(_tree()))  # in range
    with pytest.raises(ScoringRejected, match=r"outside \[0, 1\]") as info:
        run(runner(ConstScorer(0.6), OtherConstScorer(0.6), config=cfg).score_branches(_tree()))
    assert info.value.kind == "out_of_range"
    run(runner(ConstScorer(-3.0)).score_branches(_tree()))  # other modes take any finite reward


class _SpanScorer(BaseScorer):
    """Records, per session (``ctx["task"]``), when its calls ran and the order of its branches;
    hangs on session ``"hang"``."""

    name = "span"

    def __init__(self):
        super().__init__()
        self.spans, self.turns = {}, {}

    async def evaluate(self, interaction, ctx):
        session = ctx["task"]
        start = time.monotonic()
        self.turns.setdefault(session, []).append(ctx["leaf_id"])
        try:
            await asyncio.sleep(3600 if session == "hang" else 0.05)
        finally:
            lo, hi = self.spans.get(session, (start, start))
            self.spans[session] = (min(lo, start), max(hi, time.monotonic()))
        return 0.5


def _max_overlap(spans):
    events = sorted([(lo, 1) for lo, _ in spans] + [(hi, -1) for _, hi in spans], key=lambda e: (e[0], e[1]))
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def test_sessions_are_scored_concurrently_bounded_in_order_with_a_timeout():
    scorer = _SpanScorer()
    r = runner(scorer, config=PRMConfig(max_concurrent_sessions=2, timeout_s=1.0))
    names = ["a", "hang", "b", "c"]
    results = run(r.score_sessions([(_tree(), {"task": n}, None) for n in names]))
    assert isinstance(results[1], ScoringRejected) and results[1].kind == "timeout"
    assert [isinstance(results[i], SessionScores) for i in (0, 2, 3)] == [True] * 3  # in session order
    assert _max_overlap(scorer.spans.values()) == 2  # concurrent, and never more than the bound
    assert scorer.turns["a"] == ["x", "x", "x", "y", "y", "y"]  # the branches of a session in order


# -- score_branch (PaTR helper) ------------------------------------------------------------------------------


def test_score_branch_gives_one_scalar_on_private_copies():
    branch = chain([2, 3])
    assert run(score_branch(DenseScorer(), branch)) == pytest.approx(1.0)  # mean of [0, 1, 2]
    assert run(score_branch(MutatingScorer(), branch)) == 1.0
    assert branch[1].output_messages[0]["content"] == "act 1"
    with pytest.raises(ScoringRejected, match="returned None"):
        run(score_branch(ConstScorer(None), branch))
    with pytest.raises(ScoringRejected, match="non-finite"):
        run(score_branch(ConstScorer(math.nan), branch))
    with pytest.raises(ScoringRejected, match="boom"):
        run(score_branch(PerTurnScorer({"t1": RuntimeError("boom")}), branch))


def test_tree_helper_builds_shared_prefix_trees():
    t = tree_of(chain([1, 1], "p"))
    assert [lf.id for lf in t.leaves()] == ["p1"]
