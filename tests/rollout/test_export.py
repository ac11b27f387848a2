"""Concat export: rows reproduce the sampled tokens and logprobs exactly, masks/turns/rewards, buckets."""

import asyncio
import dataclasses

import numpy as np
import pytest

from rollout.client import ClientConfig, GenerationClient, SamplingParams
from rollout.envs import FrozenLakeEnv, make_tasks
from rollout.export import export_groups, filter_groups, leaf_row
from rollout.stats import describe_groups
from rollout.testing import ServerScript, frozenlake_policy
from rollout.groups import TreeConfig
from rollout.tree import run_groups
from scorers import FrozenLakeProgressScorer


@pytest.fixture(scope="module")
def groups():
    from rollout.chat import PromptBuilder
    from rollout.testing import ScriptedServer, make_test_tokenizer

    tok = make_test_tokenizer()
    tasks, _ = make_tasks(2, 3, 0, sizes=(4,))
    cfg = TreeConfig(strategy="patr", b0=3, k=2, max_turns=6, max_branches=6, sampling=SamplingParams(max_tokens=6))
    # the last group hits the length limit on every turn (no EOS sampled: the client appends it)
    short = TreeConfig(strategy="patr", b0=3, k=2, max_turns=6, max_branches=6, sampling=SamplingParams(max_tokens=3))

    async def go(url):
        async with GenerationClient(ClientConfig(endpoints=(url,))) as c:
            kw = dict(env_factory=FrozenLakeEnv, client=c, prompts=PromptBuilder(tok), scorer=FrozenLakeProgressScorer())
            return (await run_groups(tasks[:2], config=cfg, **kw)) + \
                (await run_groups(tasks[2:], config=short, group_seed=2, **kw))

    with ScriptedServer(ServerScript(policy=frozenlake_policy(tok, p_good=0.6)), tok) as srv:
        return asyncio.run(go(srv.url))


def test_rows_reproduce_sampled_tokens_and_logprobs(groups):
    batch, meta = export_groups(groups, row_buckets=(8, 32), len_buckets=(256, 1024, 4096))
    tokens = np.asarray(batch.tokens)
    mask = np.asarray(batch.loss_mask)
    lp = np.asarray(batch.old_logprobs)
    turns = np.asarray(batch.turn_ids)
    assert len(meta) == sum(len(g.leaves) for g in groups) == 18
    for m in meta:
        g = groups[m.group]
        branch = g.tree.branch(m.leaf_id)
        L = int(batch.seq_lens[m.row])
        last = branch[-1].model_response
        assert L == last.input_len + last.output_len
        sampled_positions = []
        for j, it in enumerate(branch):
            r = it.model_response
            s = r.input_len
            assert np.array_equal(tokens[m.row, s:s + r.output_len], r.output_tokens)
            # prediction positions: entry t is about token t+1
            assert np.array_equal(lp[m.row, s - 1:s - 1 + r.output_len], r.output_logprobs)
            assert np.all(mask[m.row, s - 1:s - 1 + r.output_len] == 1)
            assert np.all(turns[m.row, s - 1:s - 1 + r.output_len] == j)
            sampled_positions += list(range(s - 1, s - 1 + r.output_len))
        off = np.ones(tokens.shape[1], bool)
        off[sampled_positions] = False
        assert np.all(mask[m.row, off] == 0) and np.all(lp[m.row, off] == 0) and np.all(turns[m.row, off] == -1)
        assert float(batch.outcome_rewards[m.row]) == next(lf.outcome_reward for lf in g.leaves if lf.leaf_id == m.leaf_id)
        assert int(batch.group_ids[m.row]) == m.group
        assert bool(batch.truncated[m.row]) == (last.stop_reason == "length") == (m.group == 2)
    # padding rows: weight 0, masks 0
    assert batch.shape[0] == 32 and batch.shape[1] in (1024, 4096)
    assert np.all(np.asarray(batch.row_weights)[len(meta):] == 0) and np.all(mask[len(meta):] == 0)
    assert np.asarray(batch.row_weights)[: len(meta)].sum() == len(meta)


def test_process_rewards_are_stitched(groups):
    prs = []
    for g in groups:
        per_leaf = {}
        for lf in g.leaves:
            per_leaf[lf.leaf_id] = {it.id: np.full(it.output_len, 0.1 * (k + 1), np.float32)
                                    for k, it in enumerate(g.tree.branch(lf.leaf_id))}
        prs.append(per_leaf)
    batch, meta = export_groups([g.with_process_rewards(pr) for g, pr in zip(groups, prs)])
    proc = np.asarray(batch.process_rewards)
    for m in meta:
        for k, it in enumerate(groups[m.group].tree.branch(m.leaf_id)):
            s = it.model_response.input_len
            assert np.allclose(proc[m.row, s - 1:s - 1 + it.output_len], 0.1 * (k + 1))
        assert np.isclose(proc[m.row].sum(), sum(0.1 * (k + 1) * it.output_len
                                                 for k, it in enumerate(groups[m.group].tree.branch(m.leaf_id))))
    bad = [dict(p) for p in prs]
    leaf = next(iter(bad[0]))
    iid = next(iter(bad[0][leaf]))
    bad[0][leaf] = {**bad[0][leaf], iid: np.zeros(999, np.float32)}
    with pytest.raises(ValueError, match="length 999"):
        export_groups([g.with_process_rewards(pr) for g, pr in zip(groups, bad)])
    with pytest.raises(KeyError, match="no entry for leaf"):
        export_groups([g.with_process_rewards({}) for g in groups])
    assert groups[0].process_rewards is None  # attaching rewards copies the group


def test_bucketed_shapes_are_stable(groups):
    shapes = {export_groups(groups[:n])[0].shape for n in (1, 2, 3)}
    assert shapes <= {(8, 1024), (16, 1024), (32, 1024), (8, 2048), (16, 2048), (32, 2048)}
    b, _ = export_groups(groups[:1], min_rows=32, min_len=2048)
    assert b.shape == (32, 2048) and b.num_groups == 32
    with pytest.raises(ValueError, match="max_len"):
        export_groups(groups, max_len=10)


def test_leaf_row_detects_drift(groups):
    import dataclasses

    from rollout.types import Interaction, InteractionTree, ModelResponse

    g = groups[0]
    lf = next(x for x in g.leaves if x.turns > 1)
    branch = g.tree.branch(lf.leaf_id)
    tree = InteractionTree()
    for k, it in enumerate(branch):
        r = it.model_response
        if k == len(branch) - 1:
            inp = np.array(r.input_tokens)
            inp[branch[0].model_response.input_len] += 1  # corrupt a sampled token of turn 0
            r = ModelResponse(inp, r.output_tokens, r.output_logprobs, r.stop_reason)
        tree.add(dataclasses.replace(it, model_response=r) if isinstance(it, Interaction) else it)
    with pytest.raises(ValueError, match="prefix"):
        leaf_row(tree, lf, 0)


def test_describe_groups(groups):
    d = describe_groups(groups)
    assert d["trajectories"] == 18 and 0 <= d["success_rate"] <= 1
    assert d["sampled_actions"] == sum(len(g.tree) for g in groups)
    assert sum(c["expanded"] for c in d["per_checkpoint"]) == d["expanded"]


def _relabel(group, rewards, truncated):
    """``group`` with its leaves' outcome rewards and truncation flags replaced (first leaves first)."""
    leaves = [dataclasses.replace(lf, outcome_reward=r, truncated=t)
              for lf, r, t in zip(group.leaves, rewards, truncated, strict=False)]
    return dataclasses.replace(group, leaves=leaves + group.leaves[len(leaves):])


def test_group_filters_follow_the_reference_rule_and_record_its_counters(groups):
    g = groups[0]
    n = len(g.leaves)
    assert n >= 3
    eos = [False] * n
    # mixed: a success that was truncated and failures that ended with EOS (the _mask_no_eos variant
    # used to drop the truncated success and reject the group)
    mixed = _relabel(g, [1.0] + [0.0] * (n - 1), [True] + eos[1:])
    # all wrong; the only negative process reward sits on a truncated sample
    penalized = _relabel(g, [0.0] * n, [True] + eos[1:])
    pen_rewards = {lf.leaf_id: {"t": np.array([-0.5 if i == 0 else 0.0, 0.0], np.float32)}
                   for i, lf in enumerate(penalized.leaves)}
    perfect = _relabel(g, [1.0] * n, eos)
    penalized = penalized.with_process_rewards(pen_rewards)
    todo = [mixed, penalized, perfect]
    counters: dict = {}
    kept = filter_groups(todo, "mixed_or_penalized_all_wrong", counters)
    assert kept == [mixed, penalized] and kept[1].process_rewards is pen_rewards
    assert counters == {"accepted_mixed": 1, "accepted_penalized_all_wrong": 1, "rejected_by_all_correct": 1,
                        "rejected_by_all_wrong": 0, "rejected_by_failed_or_perfect": 1}
    counters = {}
    kept = filter_groups(todo, "mixed_or_penalized_all_wrong_mask_no_eos", counters)
    assert kept == [mixed]  # the truncated sample's penalty does not count in the all-wrong test
    assert counters == {"accepted_mixed": 1, "accepted_penalized_all_wrong": 0, "rejected_by_all_correct": 1,
                        "rejected_by_all_wrong": 1, "rejected_by_failed_or_perfect": 2}
