"""DAPO's rollout-side pieces: the overlong punishment against its formula in float64, the mixed-group
test, shaping by the longest turn, and dynamic sampling in a real (tiny) training step."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxprm.train import dapo
from jaxprm.train.config import load_config
from rollout.groups import GroupResult, GroupStats, LeafRecord


def _reference_penalty(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO's R_length, written as the paper writes it (three cases)."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return factor * ((max_len - buffer) - length) / buffer
    return -factor


@pytest.mark.parametrize("max_len,buffer,factor", [(8, 2, 1.0), (64, 16, 0.5), (20, 20, 2.0), (5, 1, 1.0)])
def test_overlong_penalty_matches_the_three_case_formula(max_len, buffer, factor):
    lengths = np.arange(0, max_len + 1)
    got = dapo.overlong_penalty(lengths, max_len, buffer, factor)
    want = np.array([_reference_penalty(int(n), max_len, buffer, factor) for n in lengths], np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert got[-1] == pytest.approx(-factor)  # a response that hits the cap gets the whole punishment


def test_a_zero_buffer_punishes_nothing():
    assert not dapo.overlong_penalty(np.array([1, 8, 9]), 8, 0).any()


def _group(turn_lengths: dict[str, list[int]], rewards: dict[str, float]) -> GroupResult:
    branches = {leaf: [types.SimpleNamespace(model_response=types.SimpleNamespace(output_tokens=np.zeros(n, np.int32)))
                       for n in lens] for leaf, lens in turn_lengths.items()}
    leaves = [LeafRecord(leaf_id=k, branch_id=k, outcome_reward=rewards[k], status="done", turns=len(v),
                         truncated=False, origin="root") for k, v in turn_lengths.items()]
    return GroupResult(group_key="g", task=None, tree=types.SimpleNamespace(branch=branches.__getitem__),
                       leaves=leaves, all_leaves=list(leaves), stats=GroupStats())


def test_shaping_punishes_a_trajectory_by_its_longest_turn_and_leaves_the_input_alone():
    g = _group({"a": [3, 4, 3], "b": [3, 8], "c": [7]}, {"a": 1.0, "b": 0.0, "c": 1.0})
    (shaped,), stats = dapo.shape_overlong([g], max_len=8, buffer=2, factor=1.0)
    assert [lf.outcome_reward for lf in shaped.leaves] == [1.0, -1.0, 0.5]
    assert [lf.outcome_reward for lf in g.leaves] == [1.0, 0.0, 1.0]  # a copy
    assert stats == {"overlong_punished": pytest.approx(2 / 3), "overlong_penalty_mean": pytest.approx(-0.5)}


def test_mixed_groups_are_the_ones_with_unequal_outcome_rewards():
    assert dapo.is_mixed(_group({"a": [1], "b": [1]}, {"a": 1.0, "b": 0.0}))
    assert not dapo.is_mixed(_group({"a": [1], "b": [1]}, {"a": 1.0, "b": 1.0}))
    assert not dapo.is_mixed(_group({"a": [1], "b": [1]}, {"a": 0.0, "b": 0.0}))


def test_the_dapo_strategy_turns_both_on_and_flat_leaves_them_off():
    cfg = load_config(None, ["rollout.strategy=dapo"])
    assert dapo.dynamic_sampling(cfg) and dapo.overlong_buffer(cfg) == cfg.rollout.max_new_tokens // 4
    flat = load_config(None, ["rollout.strategy=flat"])
    assert not dapo.dynamic_sampling(flat) and dapo.overlong_buffer(flat) == 0
    both = load_config(None, ["rollout.strategy=flat", "rollout.dapo.dynamic_sampling=true",
                              "rollout.dapo.overlong_buffer=3"])
    assert dapo.dynamic_sampling(both) and dapo.overlong_buffer(both) == 3


def test_round_tasks_spend_the_rest_of_the_token_cap_at_the_steps_rate():
    # no cap, or the first round: the configured round
    assert dapo.round_tasks(9, tasks_so_far=0, tokens_so_far=0, max_tokens=100) == 9
    assert dapo.round_tasks(9, tasks_so_far=9, tokens_so_far=10_000, max_tokens=None) == 9
    # 9 tasks cost 1,170 tokens (130 a task): 2,070 - 1,170 = 900 tokens buy ceil(6.92) = 7 tasks
    assert dapo.round_tasks(9, tasks_so_far=9, tokens_so_far=1170, max_tokens=2070) == 7
    # a rest larger than a round is still one round
    assert dapo.round_tasks(9, tasks_so_far=9, tokens_so_far=100, max_tokens=10_000) == 9
    # spent: no more rounds
    assert dapo.round_tasks(9, tasks_so_far=18, tokens_so_far=2070, max_tokens=2070) == 0
    assert dapo.round_tasks(9, tasks_so_far=18, tokens_so_far=2500, max_tokens=2070) == 0


def test_a_token_cap_must_be_positive():
    from jaxprm.train.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.dapo.max_tokens_per_step"):
        load_config(None, ["rollout.strategy=dapo", "rollout.dapo.max_tokens_per_step=0"])
