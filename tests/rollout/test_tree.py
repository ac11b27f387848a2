"""Group rollouts against a real scripted server: PaTR routing on scripted scores, budgets, refill,
loop stops, group sizes, reproducibility, failure and cancellation."""

import asyncio
import dataclasses

import numpy as np
import pytest

from jaxprm.fields import FieldError
from rollout.client import ClientConfig, GenerationClient, SamplingParams
from rollout.envs import FrozenLakeEnv, FrozenLakeTask, StepResult, make_tasks
from rollout.testing import ServerScript, fixed_text_policy, hashed_action_policy
from rollout.groups import ARPOParams, GroupRejected, RolloutError, TreeConfig, TreeParams
from rollout.tree import run_group, run_groups
from scorers import BaseScorer

SAMPLING = SamplingParams(max_tokens=24)


class StepEnv:
    """Never fails; ends with reward 1 after ``end_at`` turns (None: never)."""

    def __init__(self, end_at=None):
        self.end_at, self.turn = end_at, 0

    def system_prompt(self, task):
        return "sys"

    async def reset(self, task):
        self.turn = 0
        return f"task {task}"

    async def step(self, text):
        self.turn += 1
        done = self.end_at is not None and self.turn >= self.end_at
        return StepResult(observation=f"obs {self.turn}", reward=1.0 if done else 0.0, done=done,
                          info={"action": f"a{self.turn}", "success": done})

    def clone(self):
        c = StepEnv(self.end_at)
        c.turn = self.turn
        return c


class TableScorer(BaseScorer):
    """Scores from a table keyed by (branch id, turns so far); records every call."""

    name = "table"

    def __init__(self, table, default=0.5):
        super().__init__()
        self.table, self.default, self.calls = table, default, []

    async def evaluate(self, interaction, ctx):
        key = (ctx["branch_id"], len(ctx["branch"]))
        self.calls.append(key)
        assert ctx["messages"][-1]["role"] == "assistant" and ctx["branch"][-1] is interaction
        return self.table.get(key, self.default)


def run(coro):
    return asyncio.run(coro)


async def _group(url, cfg, *, env_factory=StepEnv, scorer=None, task="t", tok=None, prompts=None, seed=0):
    async with GenerationClient(ClientConfig(endpoints=(url,))) as c:
        return await run_group(task, env_factory=env_factory, client=c, prompts=prompts, config=cfg, scorer=scorer,
                               group_seed=seed)


def _by_branch(g):
    return {lf.branch_id: lf for lf in g.all_leaves}


def test_patr_expands_and_prunes_as_the_algorithm_says(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=4, k=2, m=2, top_k=2, alpha=0.3, theta=None, max_turns=6,
                     max_branches=64, refill=False, sampling=SAMPLING)
    scorer = TableScorer({
        # checkpoint 0 (2 turns): median 0.55 -> prune below 0.25; top-2 = b0, b3
        ("b0", 2): 0.9, ("b1", 2): 0.1, ("b2", 2): 0.5, ("b3", 2): 0.6,
        # checkpoint 1 (4 turns): active b4 b5 (children of b0), b2, b6 b7 (of b3); median 0.7
        ("b4", 4): 0.2, ("b5", 4): 0.8, ("b2", 4): 0.7, ("b6", 4): 0.9, ("b7", 4): 0.1,
    })
    g = run(_group(srv.url, cfg, scorer=scorer, prompts=prompts))
    assert sorted(scorer.calls) == sorted(scorer.table)
    leaves = _by_branch(g)
    assert {b: (lf.status, lf.turns) for b, lf in leaves.items()} == {
        "b1": ("pruned", 2), "b4": ("pruned", 4), "b7": ("pruned", 4), "b2": ("max_turns", 6),
        "b8": ("max_turns", 6), "b9": ("max_turns", 6), "b10": ("max_turns", 6), "b11": ("max_turns", 6)}
    s = g.stats
    assert (s.expanded, s.pruned, s.branches_started, s.children, s.leaves) == (4, 3, 12, 8, 8)
    assert [(c.active, c.expanded, c.children, c.pruned, c.survived) for c in s.checkpoints] == [
        (4, 2, 4, 1, 1), (5, 2, 4, 2, 1)]
    # children share the parent's interactions: b8/b9 descend from b5, which descends from b0
    br8 = [it.id.split("/")[1] for it in g.tree.branch(leaves["b8"].leaf_id)]
    assert br8 == ["b0", "b0", "b5", "b5", "b8", "b8"]
    assert s.sampled_actions == len(g.tree) == 4 * 2 + 5 * 2 + 5 * 2
    assert s.sibling_shared_tokens > 0 and s.cache_reusable_tokens >= s.sibling_shared_tokens


def test_best_n_drops_pruned(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=4, k=2, alpha=0.3, theta=None, max_turns=4, max_branches=64,
                     refill=False, keep="best_n", sampling=SAMPLING)
    g = run(_group(srv.url, cfg, scorer=TableScorer({("b1", 2): 0.0, ("b2", 2): 0.9, ("b3", 2): 0.9}),
                   prompts=prompts))
    assert "b1" in {lf.branch_id for lf in g.all_leaves} - {lf.branch_id for lf in g.leaves}
    assert all(lf.status != "pruned" for lf in g.leaves) and g.stats.leaves == len(g.leaves) == 5


def test_process_rewards_score_exactly_the_exported_leaves(serve, prompts):
    from rollout.scoring import score_groups
    from scorers import PRMRunner

    class Recorder(BaseScorer):
        """0.1 per turn; fails on the branches ending at ``fail_on``."""

        name = "recorder"

        def __init__(self, fail_on):
            super().__init__()
            self.leaves, self.fail_on = set(), set(fail_on)

        async def evaluate(self, interaction, ctx):
            self.leaves.add(ctx["leaf_id"])
            if ctx["leaf_id"] in self.fail_on:
                raise RuntimeError("a dropped branch cannot be scored")
            return 0.1

    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=4, k=2, alpha=0.3, theta=None, max_turns=4, max_branches=64,
                     refill=False, keep="best_n", sampling=SAMPLING)
    g = run(_group(srv.url, cfg, scorer=TableScorer({("b1", 2): 0.0, ("b2", 2): 0.9, ("b3", 2): 0.9}),
                   prompts=prompts))
    exported = {lf.leaf_id for lf in g.leaves}
    dropped = {lf.leaf_id for lf in g.all_leaves} - exported
    assert dropped  # best_n dropped the pruned branch
    rec = Recorder(fail_on=dropped)
    scored = run(score_groups(PRMRunner(None, scorers=[rec]), [g]))
    # only the exported leaves were scored: a scorer that fails on the dropped branch does not reject the group
    assert rec.leaves == exported and not scored.rejected and set(scored.groups[0].process_rewards) == exported
    assert scored.metrics.summary()["rollout/prm_trajectory_reward/recorder"] == pytest.approx(0.1 * 4)


def test_max_branches_caps_live_plus_finished(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=4, k=1, m=3, top_k=2, alpha=0.0, theta=None, max_turns=5,
                     max_branches=7, refill=False, sampling=SAMPLING)
    g = run(_group(srv.url, cfg, scorer=TableScorer({}, default=0.5), prompts=prompts))
    assert len(g.all_leaves) == 7 and g.stats.branches_started - g.stats.expanded == 7
    # 4 live: first expansion gets 3 children (+2), the second only 2 (+1): cap reached, none later
    assert g.stats.expanded == 2
    assert [c.children for c in g.stats.checkpoints] == [5] + [0] * (len(g.stats.checkpoints) - 1)


def test_refill_from_root_when_all_die_before_a_checkpoint(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=4, k=3, max_turns=6, max_branches=8, refill=True, sampling=SAMPLING)
    g = run(_group(srv.url, cfg, env_factory=lambda: StepEnv(end_at=1), scorer=TableScorer({}), prompts=prompts))
    assert g.stats.leaves == 8 and g.stats.refills == 4 and not g.stats.checkpoints
    assert sorted(lf.origin for lf in g.leaves) == ["refill"] * 4 + ["root"] * 4
    assert all(lf.turns == 1 and lf.status == "success" for lf in g.leaves)


def test_refill_branches_again_from_best_checkpoint_state(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=4, k=2, m=2, top_k=2, alpha=0.5, theta=None, max_turns=8,
                     max_branches=8, refill=True, sampling=SAMPLING)
    scorer = TableScorer({("b0", 2): 0.2, ("b1", 2): 0.3, ("b2", 2): 0.9, ("b3", 2): 0.8})
    g = run(_group(srv.url, cfg, env_factory=lambda: StepEnv(end_at=3), scorer=scorer, prompts=prompts))
    # checkpoint: b2, b3 expand (4 children), b0, b1 survive -> 6 live; all end at turn 3 -> 2 free slots
    assert g.stats.leaves == 8 and g.stats.refills == 2 and g.stats.expanded == 2
    refills = [lf for lf in g.leaves if lf.origin == "refill"]
    assert len(refills) == 2 and all(lf.turns == 3 for lf in refills)
    parents = {g.tree.branch(lf.leaf_id)[1].id.split("/")[1] for lf in refills}
    assert parents == {"b2", "b3"}  # the two best checkpoint states


@pytest.mark.parametrize("strategy,size", [("flat", 6), ("dapo", 6), ("tree_random", 8), ("patr", 8), ("arpo", 8)])
def test_group_sizes_match_config(serve, tok, prompts, strategy, size):
    from rollout.testing import frozenlake_policy

    srv = serve(ServerScript(policy=frozenlake_policy(tok, p_good=0.5)))
    tasks, _ = make_tasks(1, 6, 0, sizes=(4, 5))
    cfg = TreeConfig(strategy=strategy, group_size=6, b0=4, k=3, max_turns=10, max_branches=8, sampling=SAMPLING)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,))) as c:
            return await run_groups(tasks, env_factory=FrozenLakeEnv, client=c, prompts=prompts, config=cfg,
                                    scorer=ProgressScorer())

    groups = run(go())
    assert [g.stats.leaves for g in groups] == [size] * len(tasks)
    for g in groups:
        assert len(g.tree.leaves()) == len(g.all_leaves)
        assert g.stats.sampled_actions == len(g.tree)
        for lf in g.leaves:
            last = g.tree.get(lf.leaf_id)
            assert set(last.env_state) >= {"position", "distance", "start_distance", "in_hole", "success", "done"}
            assert lf.outcome_reward == (1.0 if lf.status == "success" else 0.0)


@pytest.mark.parametrize("strategy,size", [("flat", 6), ("dapo", 6), ("tree_random", 8), ("patr", 8), ("arpo", 8)])
def test_every_strategy_rolls_out_sokoban(serve, tok, prompts, strategy, size):
    """Sokoban groups of every strategy, PaTR's branches ranked by the Sokoban progress scorer."""
    from rollout.envs.sokoban import SokobanEnv, make_tasks as sokoban_tasks
    from scorers import SokobanProgressScorer

    srv = serve(ServerScript(policy=hashed_action_policy(tok)))
    tasks, _ = sokoban_tasks(2, 4, 0, size=6, boxes=2, max_turns=8)
    cfg = TreeConfig(strategy=strategy, group_size=6, b0=4, k=3, max_turns=8, max_branches=8, sampling=SAMPLING)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,))) as c:
            return await run_groups(tasks, env_factory=SokobanEnv, client=c, prompts=prompts, config=cfg,
                                    scorer=SokobanProgressScorer())

    groups = run(go())
    assert [g.stats.leaves for g in groups] == [size] * len(tasks)
    for g in groups:
        for lf in g.leaves:
            last = g.tree.get(lf.leaf_id)
            assert set(last.env_state) >= {"distance", "start_distance", "dead", "success", "boxes"}
            rewards = [it.reward for it in g.tree.branch(lf.leaf_id)]
            # a branch the rollout stopped pays the step penalty of the turns it did not play
            stopped = lf.status in ("pruned", "loop", "context")
            assert lf.outcome_reward == pytest.approx(sum(rewards) - 0.1 * (8 - lf.turns) * stopped)
            assert (lf.status == "success") == last.env_state["success"]
    if strategy == "patr":
        assert all(0 <= s <= 1 for g in groups for c in g.stats.checkpoints for s in c.scores)


def test_a_stopped_branch_pays_for_the_turns_it_did_not_play():
    """Pruned at turn 2 of 6, a Sokoban branch pays -0.1 for each of the 4 turns left (it would
    otherwise look better than a branch that played on and failed); FrozenLake has no step penalty."""
    from rollout.branches import Branch
    from rollout.envs.frozenlake import FrozenLakeEnv, FrozenLakeTask
    from rollout.envs.sokoban import SokobanEnv, SokobanTask

    env = SokobanEnv()
    run(env.reset(SokobanTask(room=("#####", "#@$_.", "#___#"), max_turns=6)))
    rewards = [run(env.step("```Left```")).reward for _ in range(2)]
    b = Branch(id="b", env=env, messages=[], prompt=[], last_id="t1", depth=2, actions=["Left"] * 2,
               reward=sum(rewards), origin="root")
    b.stop("pruned")
    assert b.status == "pruned" and b.reward == pytest.approx(-0.6)
    lake = FrozenLakeEnv()
    run(lake.reset(FrozenLakeTask(desc=("SF", "FG"), max_turns=6)))
    b = Branch(id="c", env=lake, messages=[], prompt=[], last_id=None, depth=0, actions=[], reward=0.0, origin="root")
    b.stop("loop")
    assert b.reward == 0.0


def test_tree_random_without_refill_size(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="tree_random", b0=4, k=2, m=2, top_k=2, alpha=0.0, theta=None, max_turns=6,
                     max_branches=64, refill=False, sampling=SAMPLING)
    g = run(_group(srv.url, cfg, prompts=prompts))
    assert g.stats.leaves == 4 + g.stats.expanded * (cfg.m - 1)
    assert g.stats.expanded == 4  # top-2 at each of two checkpoints


class ProgressScorer(BaseScorer):
    name = "progress"

    async def evaluate(self, interaction, ctx):
        st = interaction.env_state
        return 0.0 if st["distance"] < 0 else 1.0 / (1.0 + st["distance"])


def test_loop_stop(serve, tok, prompts):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "```Left```")))
    task = FrozenLakeTask(desc=("SFF", "FFF", "FFG"), max_turns=10)
    for strategy in ("flat", "patr"):
        cfg = TreeConfig(strategy=strategy, group_size=3, b0=3, k=5, theta=3, max_branches=3, sampling=SAMPLING)
        g = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, scorer=ProgressScorer(), task=task, prompts=prompts))
        assert [(lf.status, lf.turns) for lf in g.leaves] == [("loop", 3)] * 3 and g.stats.loop_stopped == 3
    cfg = dataclasses.replace(cfg, keep="best_n")
    g = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, scorer=ProgressScorer(), task=task, prompts=prompts))
    assert g.leaves == [] and len(g.all_leaves) == 3


def test_reproducible_against_deterministic_server(serve, prompts):
    srv = serve()
    task = make_tasks(5, 1, 0, sizes=(5,))[0][0]
    cfg = TreeConfig(strategy="tree_random", b0=4, k=2, max_turns=8, max_branches=8, seed=3, sampling=SAMPLING)

    def fingerprint(g):
        return [(lf.branch_id, lf.status, tuple(g.tree.get(lf.leaf_id).model_response.output_tokens),
                 len(g.tree.get(lf.leaf_id).model_response.input_tokens)) for lf in g.all_leaves]

    a = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, prompts=prompts, seed=11))
    b = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, prompts=prompts, seed=11))
    c = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, prompts=prompts, seed=12))
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


def test_prompts_extend_and_siblings_share_prefix(serve, tok, prompts):
    script = ServerScript(policy=hashed_action_policy(tok), record_prompts=True)
    srv = serve(script)
    cfg = TreeConfig(strategy="patr", b0=2, k=1, m=2, top_k=1, alpha=1.0, theta=None, max_turns=3,
                     max_branches=64, refill=False, sampling=SAMPLING)
    g = run(_group(srv.url, cfg, scorer=TableScorer({}), prompts=prompts))
    for lf in g.leaves:
        chain = g.tree.branch(lf.leaf_id)
        for prev, nxt in zip(chain, chain[1:]):
            full = list(prev.model_response.input_tokens) + list(prev.model_response.output_tokens)
            assert list(nxt.model_response.input_tokens[: len(full)]) == full
    # the two children of the expanded branch sent identical prompts (a prefix cache serves one from the other)
    counts = {}
    for p in script.prompts:
        counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    assert max(counts.values()) >= 2


def test_failure_fails_the_group_and_cancels_siblings(serve, tok, prompts):
    script = ServerScript(policy=hashed_action_policy(tok), fail_statuses=[400])
    srv = serve(script)
    cfg = TreeConfig(strategy="flat", group_size=4, max_turns=3, sampling=SAMPLING)

    async def go():
        with pytest.raises(RolloutError, match="HTTP 400"):
            await _group(srv.url, cfg, prompts=prompts)
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert run(go()) == set()


class _BrokenEnv(StepEnv):
    """Its second step raises a ValueError (an env bug mid-rollout)."""

    async def step(self, text):
        if self.turn >= 1:
            raise ValueError("env bug")
        return await super().step(text)

    def clone(self):
        c = _BrokenEnv(self.end_at)
        c.turn = self.turn
        return c


def test_an_error_of_any_type_mid_rollout_is_a_rollout_error(serve, prompts):
    # (what the trainer turns into its one-line error; a ValueError used to escape as itself)
    srv = serve()
    cfg = TreeConfig(strategy="flat", group_size=2, max_turns=3, sampling=SAMPLING)
    with pytest.raises(RolloutError, match="group 'g0' failed: ValueError: env bug"):
        run(_group(srv.url, cfg, env_factory=_BrokenEnv, prompts=prompts))


def test_bad_scores_are_rejected(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=2, k=1, max_turns=3, sampling=SAMPLING)
    with pytest.raises(GroupRejected, match=r"outside \[0, 1\]") as info:
        run(_group(srv.url, cfg, scorer=TableScorer({}, default=1.5), prompts=prompts))
    assert info.value.kind == "out_of_range" and info.value.group_key == "g0"
    with pytest.raises(ValueError, match="needs a branch scorer"):
        run(_group(srv.url, cfg, prompts=prompts))


@pytest.mark.parametrize("judge", ["answers_500", "down"])
def test_a_rejected_group_keeps_the_scorers_error_as_its_cause(serve, prompts, judge):
    # issue 43: _gather re-raised with ``from None``, so the caller saw GroupRejected <- ExceptionGroup
    from scorers import LLMJudgeScorer, ScoringRejected
    from scorers._http import ScorerHTTPError
    from tests.scorers.scorer_http_server import ScriptedServer as JudgeServer

    srv = serve()
    judge_srv = JudgeServer().start()
    try:
        judge_srv.defaults["chat"] = {"status": 500}
        url = judge_srv.url
        if judge == "down":
            judge_srv.stop()
        scorer = LLMJudgeScorer(url, "judge", max_retries=1, backoff_s=0.0, timeout_s=5.0)
        cfg = TreeConfig(strategy="patr", b0=2, k=1, max_turns=3, sampling=SAMPLING)
        with pytest.raises(GroupRejected, match="g0") as info:
            run(_group(srv.url, cfg, scorer=scorer, prompts=prompts))
    finally:
        judge_srv.stop()
    rejected = info.value
    assert isinstance(rejected.__cause__, ScoringRejected), repr(rejected.__cause__)
    http_err = rejected.__cause__.__cause__
    assert isinstance(http_err, ScorerHTTPError) and len(http_err.attempts) == 2
    if judge == "answers_500":
        assert all("500" in a for a in http_err.attempts) and "scripted failure" in str(http_err)
    assert rejected.causes == ["ScoringRejected", "ScorerHTTPError"]
    # the trainer gathers rejections across processes pickled: the names travel with them
    import pickle
    back = pickle.loads(pickle.dumps(rejected))
    assert (back.group_key, back.kind, back.causes, str(back)) == (
        rejected.group_key, rejected.kind, rejected.causes, str(rejected))


def test_cancelling_a_group_leaves_no_task_running(serve, tok, prompts):
    srv = serve(ServerScript(policy=hashed_action_policy(tok), delay_s=0.3))
    cfg = TreeConfig(strategy="flat", group_size=4, max_turns=5, sampling=SAMPLING)

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,))) as c:
            t = asyncio.create_task(run_group("t", env_factory=StepEnv, client=c, prompts=prompts, config=cfg))
            await asyncio.sleep(0.5)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            assert not c._sticky and all(v == 0 for v in c._outstanding.values())
            return {x for x in asyncio.all_tasks() if x is not asyncio.current_task()}

    assert run(go()) == set()


class _ValueScorer(BaseScorer):
    name = "value"

    def __init__(self, value):
        super().__init__()
        self.value = value

    async def evaluate(self, interaction, ctx):
        interaction.env_state["scribbled"] = True  # a private copy: the tree must not see this
        ctx["branch"][-1].messages.append({"role": "user", "content": "scribbled"})
        return self.value


@pytest.mark.parametrize("value,match", [(None, "returned None"), (True, "bool"), (np.full(99, 0.5), "shape"),
                                         (float("nan"), "non-finite")])
def test_checkpoint_scores_go_through_the_validated_branch_scoring_path(serve, prompts, value, match):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=2, k=1, max_turns=3, sampling=SAMPLING)
    with pytest.raises(RolloutError, match=match):
        run(_group(srv.url, cfg, scorer=_ValueScorer(value), prompts=prompts))


class _OneGroupFails(BaseScorer):
    """Fails (raises, or hangs past the timeout) on group ``bad`` only; 0.5 elsewhere."""

    name = "one_group_fails"

    def __init__(self, bad, hang=False):
        super().__init__()
        self.bad, self.hang = bad, hang

    async def evaluate(self, interaction, ctx):
        if interaction.id.startswith(f"{self.bad}/"):
            if self.hang:
                await asyncio.sleep(60)
            raise RuntimeError("scorer bug")
        return 0.5


@pytest.mark.parametrize("hang", [False, True])
def test_a_misbehaving_branch_scorer_rejects_exactly_its_group(serve, prompts, hang):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=2, k=1, max_turns=3, max_branches=4, sampling=SAMPLING, score_timeout_s=0.5)

    async def go(rejected):
        async with GenerationClient(ClientConfig(endpoints=(srv.url,))) as c:
            return await run_groups(["a", "b", "c"], env_factory=StepEnv, client=c, prompts=prompts, config=cfg,
                                    scorer=_OneGroupFails("g11", hang), group_seed=10, rejected=rejected)

    rejected = []
    groups = run(go(rejected))
    assert [g.group_key for g in groups] == ["g10", "g12"] and all(g.stats.leaves == 4 for g in groups)
    assert [(r.group_key, r.kind) for r in rejected] == [("g11", "timeout" if hang else "failed")]
    with pytest.raises(GroupRejected, match="g11"):  # without a list to collect them, it is raised
        run(go(None))


def test_checkpoint_scorers_work_on_private_copies(serve, prompts):
    srv = serve()
    cfg = TreeConfig(strategy="patr", b0=2, k=1, max_turns=3, max_branches=4, sampling=SAMPLING)
    g = run(_group(srv.url, cfg, scorer=_ValueScorer(0.5), prompts=prompts))
    assert g.stats.checkpoints
    for it in g.tree:
        assert "scribbled" not in it.env_state
        assert all(m.get("content") != "scribbled" for m in it.messages)


def test_config_validation():
    with pytest.raises(FieldError, match="strategy"):
        TreeConfig(strategy="beam")
    with pytest.raises(FieldError, match="keep"):
        TreeConfig(strategy="patr", keep="best")
    with pytest.raises(FieldError, match="max_branches"):
        TreeConfig(strategy="patr", b0=4, max_branches=3)
    with pytest.raises(FieldError, match="max_branches"):
        TreeConfig(strategy="patr", b0=9)  # the default budget is group_size (8)
    with pytest.raises(FieldError, match="theta"):
        TreeConfig(theta=1)
    with pytest.raises(FieldError, match="^m: ") as info:
        TreeConfig(strategy="patr", m=1)
    assert info.value.owner is TreeConfig and info.value.field == "m"
    assert TreeConfig(strategy="flat", group_size=5).target_size == 5
    assert TreeConfig(strategy="patr", max_branches=8).target_size == 8
    assert TreeConfig(strategy="patr", group_size=6, b0=2).target_size == 6  # max_branches unset: the budget is group_size
    for bad, match in [(dict(theta_at="interval"), "theta_at"), (dict(strategy="arpo", b0=4, max_branches=3), "max_branches")]:
        with pytest.raises(FieldError, match=match):
            TreeConfig(**bad)
    for bad, field in [(dict(beam_size=1), "beam_size"), (dict(entropy_weight=-0.1), "entropy_weight"),
                       (dict(entropy_weight=float("nan")), "entropy_weight"),
                       (dict(branch_probability=1.5), "branch_probability"),
                       (dict(branch_probability=-0.1), "branch_probability"),
                       (dict(top_logprobs=0), "top_logprobs"), (dict(top_logprobs=21), "top_logprobs"),
                       (dict(entropy_tokens=0), "entropy_tokens")]:
        with pytest.raises(FieldError, match=f"^{field}: ") as info:
            ARPOParams(**bad)
        assert info.value.owner is ARPOParams
    # dapo is flat: no tree constraints, G trajectories; arpo is a tree: the budget
    assert TreeConfig(strategy="dapo", group_size=5, m=1, b0=9, max_branches=3).target_size == 5
    assert not TreeConfig(strategy="dapo").tree_mode and TreeConfig(strategy="arpo").tree_mode
    assert TreeConfig(strategy="arpo", m=1, max_branches=6).target_size == 6
    assert TreeConfig(strategy="arpo", refill=False).target_size is None
    arpo = ARPOParams(branch_probability=0.0, entropy_weight=0.0)
    assert TreeConfig(theta_at="checkpoint", arpo=arpo).arpo.branch_probability == 0.0
    # the run's fields on top of any TreeParams (the trainer's rollout section is one)
    params = TreeParams(strategy="arpo", b0=2, keep="best_n", arpo=arpo)
    cfg = TreeConfig.from_params(params, max_turns=3, seed=7)
    assert (cfg.strategy, cfg.b0, cfg.keep, cfg.arpo, cfg.max_turns, cfg.seed) == ("arpo", 2, "best_n", arpo, 3, 7)


def test_invalid_answers_are_counted_and_can_end_a_branch(serve, tok, prompts):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "no move")))
    task = FrozenLakeTask(desc=("SFF", "FFF", "FFG"), max_turns=4)
    cfg = TreeConfig(strategy="flat", group_size=2, theta=None, max_branches=None, sampling=SAMPLING)
    g = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, prompts=prompts))
    assert [(lf.status, lf.turns) for lf in g.leaves] == [("max_turns", 4)] * 2  # no-ops until out of turns
    assert g.stats.invalid_actions == g.stats.sampled_actions == 8
    ending = lambda: FrozenLakeEnv(invalid_ends_episode=True)  # noqa: E731
    g = run(_group(srv.url, cfg, env_factory=ending, task=task, prompts=prompts))
    assert [(lf.status, lf.turns, lf.outcome_reward) for lf in g.leaves] == [("invalid", 1, 0.0)] * 2
    assert g.stats.invalid_actions == 2


# ----------------------------------------------------------------------------------------- arpo

PEAKED = [0.0] + [-30.0] * 19  # entropy ~ 0
UNIFORM = [-1.0] * 20  # entropy log(20)


def _turn_entropy_script(tok, *, first, later, **kw):
    """A server whose alternatives are ``first`` on a branch's first turn (no observation in the
    prompt yet) and ``later`` afterwards; StepEnv's observations read ``obs N``."""

    def tops(prompt, out, n):
        row = later if "obs " in tok.decode(prompt) else first
        return [row[:n]] * len(out)

    return ServerScript(policy=hashed_action_policy(tok), top_logprobs=tops, **kw)


def _arpo(**kw):
    base = dict(strategy="arpo", b0=4, max_branches=8, theta=None, max_turns=4, sampling=SAMPLING)
    return TreeConfig(**{**base, **kw})


def _first_own_turn(g, lf):
    """The turn at which branch ``lf`` began generating (0 for a root; >= 1 for a child)."""
    return min(int(it.id.split("/t")[-1]) for it in g.tree.branch(lf.leaf_id) if it.id.split("/")[1] == lf.branch_id)


def test_arpo_branches_when_entropy_rises_not_when_it_falls(serve, tok, prompts):
    rising = run(_group(serve(_turn_entropy_script(tok, first=PEAKED, later=UNIFORM)).url, _arpo(), prompts=prompts))
    falling = run(_group(serve(_turn_entropy_script(tok, first=UNIFORM, later=PEAKED)).url, _arpo(), prompts=prompts))
    for g in (rising, falling):
        assert g.stats.leaves == len(g.all_leaves) == 8 and g.stats.branches_started == 8
        assert g.stats.children == sum(lf.origin == "child" for lf in g.leaves)
        assert g.stats.roots == 4 and g.stats.refills == 8 - 4 - g.stats.children
        assert g.stats.branch_decisions >= g.stats.expanded == g.stats.children  # beam_size 2: one copy each
    assert rising.stats.children > falling.stats.children
    # rising: after the first turn (dH = 0, u <= 0.5 decides) every decision forks, until the budget is spent
    assert rising.stats.refills == 0 and max(_first_own_turn(rising, lf) for lf in rising.leaves) >= 2
    # falling: dH = -log(20) afterwards, p >= 0.6 > 0.5: only first-turn decisions ever fork
    assert all(_first_own_turn(falling, lf) == 1 for lf in falling.leaves if lf.origin == "child")
    assert rising.stats.entropy_mean > falling.stats.entropy_mean > 0
    assert rising.stats.as_dict()["branch_decisions"] == rising.stats.branch_decisions


def test_arpo_never_branches_at_probability_0_always_at_1(serve, tok, prompts):
    srv = serve()
    never = run(_group(srv.url, _arpo(arpo=ARPOParams(entropy_weight=0.0, branch_probability=0.0)), prompts=prompts))
    assert never.stats.children == never.stats.expanded == 0 and never.stats.refills == 4
    assert sorted(lf.origin for lf in never.leaves) == ["refill"] * 4 + ["root"] * 4
    assert all(lf.status == "max_turns" and lf.turns == 4 for lf in never.leaves)
    # probability 1: every live branch forks every round until the budget is spent (1 -> 2 -> 4 -> 8)
    always = run(_group(srv.url, _arpo(b0=1, arpo=ARPOParams(branch_probability=1.0)), prompts=prompts))
    assert (always.stats.children, always.stats.expanded, always.stats.refills, always.stats.leaves) == (7, 7, 0, 8)
    assert sorted(_first_own_turn(always, lf) for lf in always.leaves) == [0, 1, 2, 2, 3, 3, 3, 3]
    assert always.stats.branch_decisions == 1 + 2 + 4  # none once the budget is spent
    # beam_size 3: each branching adds two copies (within the budget)
    beam = run(_group(srv.url, _arpo(b0=1, arpo=ARPOParams(beam_size=3, branch_probability=1.0)), prompts=prompts))
    assert (beam.stats.expanded, beam.stats.children, beam.stats.leaves) == (4, 7, 8)  # 1 -> 3 -> 8 (2, then 2 + 2 + 1)


def test_arpo_restarts_from_the_root_when_every_branch_dies(serve, tok, prompts):
    srv = serve(_turn_entropy_script(tok, first=PEAKED, later=UNIFORM))
    g = run(_group(srv.url, _arpo(arpo=ARPOParams(branch_probability=1.0)), env_factory=lambda: StepEnv(end_at=1),
                   prompts=prompts))
    assert g.stats.leaves == 8 and g.stats.refills == 4 and g.stats.children == 0
    assert sorted(lf.origin for lf in g.leaves) == ["refill"] * 4 + ["root"] * 4
    assert all(lf.turns == 1 and lf.status == "success" for lf in g.leaves)
    # a restarted root starts from the initial prompt (one new root per round)
    firsts = [g.tree.branch(lf.leaf_id)[0] for lf in g.leaves]
    assert len({tuple(it.model_response.input_tokens) for it in firsts}) == 1
    # without refill no restart
    g = run(_group(srv.url, _arpo(refill=False), env_factory=lambda: StepEnv(end_at=1), prompts=prompts))
    assert g.stats.leaves == 4 and g.stats.refills == 0


def test_arpo_children_extend_the_parent_prefix(serve, tok, prompts):
    script = _turn_entropy_script(tok, first=PEAKED, later=UNIFORM, record_prompts=True)
    srv = serve(script)
    g = run(_group(srv.url, _arpo(b0=2, max_turns=5), prompts=prompts))
    assert g.stats.children > 0
    for lf in g.leaves:
        chain = g.tree.branch(lf.leaf_id)
        for prev, nxt in zip(chain, chain[1:]):
            full = list(prev.model_response.input_tokens) + list(prev.model_response.output_tokens)
            assert list(nxt.model_response.input_tokens[: len(full)]) == full
    leaves = _by_branch(g)
    for lf in g.leaves:
        if lf.origin == "child":  # the child's first own request continues the parent's state after its turn
            chain = g.tree.branch(lf.leaf_id)
            j = _first_own_turn(g, lf)
            assert chain[j - 1].id.split("/")[1] != lf.branch_id and chain[j].id.split("/")[1] == lf.branch_id
            assert chain[j].parent_id == chain[j - 1].id
    assert len(leaves) == 8
    counts = {}
    for p in script.prompts:  # a child and its parent send the same prompt right after the fork
        counts[tuple(p)] = counts.get(tuple(p), 0) + 1
    assert max(counts.values()) >= 2


def test_arpo_reproducible_against_deterministic_server(serve, prompts):
    srv = serve()  # hashed alternatives: entropies vary with the prompt
    cfg = _arpo(seed=3, max_turns=6)

    def fingerprint(g):
        return [(lf.branch_id, lf.origin, lf.status, tuple(g.tree.get(lf.leaf_id).model_response.output_tokens),
                 len(g.tree.get(lf.leaf_id).model_response.input_tokens)) for lf in g.all_leaves]

    a = run(_group(srv.url, cfg, prompts=prompts, seed=11))
    b = run(_group(srv.url, cfg, prompts=prompts, seed=11))
    c = run(_group(srv.url, cfg, prompts=prompts, seed=12))
    assert fingerprint(a) == fingerprint(b) and a.stats.entropy_mean == b.stats.entropy_mean
    assert (a.stats.children, a.stats.branch_decisions) == (b.stats.children, b.stats.branch_decisions)
    assert fingerprint(a) != fingerprint(c)
    assert a.stats.leaves == c.stats.leaves == 8


def test_dapo_groups_equal_flat_groups(serve, tok, prompts):
    from rollout.testing import frozenlake_policy

    srv = serve(ServerScript(policy=frozenlake_policy(tok, p_good=0.5)))
    task = make_tasks(4, 1, 0, sizes=(4,))[0][0]

    def fingerprint(g):
        return [(lf.branch_id, lf.status, lf.turns, lf.outcome_reward,
                 [(it.id, tuple(it.model_response.input_tokens), tuple(it.model_response.output_tokens))
                  for it in g.tree.branch(lf.leaf_id)]) for lf in g.all_leaves]

    def counts(g):
        d = g.stats.as_dict()
        return {k: v for k, v in d.items() if k not in ("strategy", "wall_s", "http_s", "overhead_s")}

    cfg = TreeConfig(strategy="flat", group_size=5, max_turns=6, theta=3, seed=2, sampling=SAMPLING)
    flat = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, prompts=prompts, seed=5))
    dapo = run(_group(srv.url, dataclasses.replace(cfg, strategy="dapo"), env_factory=FrozenLakeEnv, task=task,
                      prompts=prompts, seed=5))
    assert fingerprint(flat) == fingerprint(dapo) and counts(flat) == counts(dapo)
    assert dapo.stats.strategy == "dapo" and dapo.stats.leaves == 5 and not dapo.stats.checkpoints


def test_theta_at_checkpoint(serve, tok, prompts):
    srv = serve(ServerScript(policy=fixed_text_policy(tok, "```Left```")))
    task = FrozenLakeTask(desc=("SFF", "FFF", "FFG"), max_turns=10)
    base = dict(group_size=3, b0=3, k=5, theta=3, max_turns=10, max_branches=3, theta_at="checkpoint",
                sampling=SAMPLING)
    for strategy in ("flat", "dapo", "arpo"):  # no checkpoint: never loop-stopped
        cfg = TreeConfig(strategy=strategy, **base)
        g = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, prompts=prompts))
        assert [(lf.status, lf.turns) for lf in g.all_leaves] == [("max_turns", 10)] * 3, strategy
        assert g.stats.loop_stopped == 0
    cfg = TreeConfig(strategy="patr", **base)
    scorer = TableScorer({})
    g = run(_group(srv.url, cfg, env_factory=FrozenLakeEnv, task=task, scorer=scorer, prompts=prompts))
    # stopped at the first checkpoint (turn 5, not turn 3), before scoring
    assert [(lf.status, lf.turns, lf.score) for lf in g.all_leaves] == [("loop", 5, None)] * 3
    assert g.stats.loop_stopped == 3 and scorer.calls == [] and g.stats.expanded == 0
    assert [(c.active, c.loop_stopped, c.scores) for c in g.stats.checkpoints] == [(3, 3, [])]
    # the default checks every turn: stopped at turn 3
    g = run(_group(srv.url, dataclasses.replace(cfg, theta_at="turn"), env_factory=FrozenLakeEnv, task=task,
                   scorer=TableScorer({}), prompts=prompts))
    assert [(lf.status, lf.turns) for lf in g.all_leaves] == [("loop", 3)] * 3


def test_theta_at_checkpoint_spares_the_branches_that_do_not_loop(serve, prompts):
    srv = serve()  # hashed actions: some branches loop, others not
    cfg = TreeConfig(strategy="patr", b0=4, k=3, m=2, top_k=1, alpha=1.0, theta=2, max_turns=6, max_branches=64,
                     refill=False, theta_at="checkpoint", sampling=SAMPLING)

    class _Env(StepEnv):
        """Action = the answer, so a branch loops when the policy repeats itself."""

        async def step(self, text):
            r = await super().step(text)
            r.info["action"] = text.strip()
            return r

        def clone(self):
            c = _Env(self.end_at)
            c.turn = self.turn
            return c

    scorer = TableScorer({})
    g = run(_group(srv.url, cfg, env_factory=_Env, scorer=scorer, prompts=prompts, seed=1))
    first = g.stats.checkpoints[0]
    looped = [lf for lf in g.all_leaves if lf.status == "loop"]
    assert 0 < first.loop_stopped < 4  # (seed 1: mixed)
    assert first.loop_stopped == sum(lf.turns == 3 for lf in looped) and first.active == 4
    assert len(first.scores) == 4 - first.loop_stopped
    assert {k[0] for k in scorer.calls if k[1] == 3}.isdisjoint({lf.branch_id for lf in looped if lf.turns == 3})
    assert all(lf.turns % 3 == 0 for lf in looped)  # only ever stopped at a checkpoint
