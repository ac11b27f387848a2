"""rollout.filters, the group filters: mixed or penalized all-wrong (and the mask-no-EOS variant)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.filters import (
    FILTER_COUNTERS,
    GroupSample,
    filter_mixed_or_penalized_all_wrong,
    filter_mixed_or_penalized_all_wrong_mask_no_eos,
    new_filter_counters,
)

F = filter_mixed_or_penalized_all_wrong
FT = filter_mixed_or_penalized_all_wrong_mask_no_eos


def s(reward, tr=None, mask=None, truncated=False):
    return {"reward": reward, "token_rewards": tr, "loss_mask": mask, "truncated": truncated}


def test_mixed_groups_are_kept():
    d = F([s(1.0), s(0.0), s(0.0)])
    assert d and d.reason == "accepted_mixed"


def test_all_correct_groups_are_rejected_even_with_penalties():
    d = F([s(1.0, [-1.0, 0.0]), s(1.0)])
    assert not d and d.reason == "rejected_by_all_correct"


def test_all_wrong_groups_need_a_negative_process_reward_on_an_active_token():
    assert F([s(0.0, [0.5, 0.0]), s(0.0, [0.0, 0.1])]).reason == "rejected_by_all_wrong"
    assert F([s(0.0), s(-1.0)]).reason == "accepted_mixed"
    kept = F([s(-1.0, [0.0, -0.2]), s(-1.0)])
    assert kept and kept.reason == "accepted_penalized_all_wrong"
    # the penalty sits on a masked (prompt / tool) token: it does not count
    masked = F([s(0.0, [0.0, -0.2], [1, 0]), s(0.0, [0.1, 0.0], [1, 1])])
    assert not masked and masked.reason == "rejected_by_all_wrong"


def test_mask_no_eos_variant_ignores_only_the_penalties_of_truncated_samples():
    group = [s(0.0, [-0.5, 0.0], [1, 1], truncated=True), s(0.0, [0.0, 0.0], [1, 1])]
    assert F(group).reason == "accepted_penalized_all_wrong"
    d = FT(group)
    assert not d and d.reason == "rejected_by_all_wrong"
    # a penalty on a complete sample still keeps the group
    group.append(s(0.0, [0.0, -0.1], [1, 1]))
    assert FT(group).reason == "accepted_penalized_all_wrong"
    # the mixed test uses every sample's outcome, truncated ones included (the reference rule): the
    # previous implementation dropped the truncated sample and rejected this group
    assert F([s(1.0, truncated=True), s(0.0)]).reason == "accepted_mixed"
    assert FT([s(1.0, truncated=True), s(0.0)]).reason == "accepted_mixed"
    assert FT([s(1.0, truncated=True), s(1.0, truncated=True)]).reason == "rejected_by_all_correct"
    d = FT([s(0.0, truncated=True), s(0.0, [-1.0], truncated=True)])
    assert not d and d.reason == "rejected_by_all_wrong"


def test_batched_form_matches_per_sample_form():
    rewards = [0.0, 0.0, 0.0]
    tr = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.2, 0.0, 0.0]])
    lm = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    trunc = [True, False, False]
    batched = {"rewards": rewards, "token_rewards": tr, "loss_mask": lm, "truncated": trunc}
    samples = [GroupSample(r, tr[i], lm[i], trunc[i]) for i, r in enumerate(rewards)]
    assert F(batched) == F(samples) and F(batched).reason == "accepted_penalized_all_wrong"
    assert FT(batched) == FT(samples) and FT(batched).reason == "rejected_by_all_wrong"


def test_counters_are_the_references():
    counters = new_filter_counters()
    F([s(1.0), s(0.0)], counters=counters)
    F([s(1.0), s(1.0)], counters=counters)
    F([s(0.0), s(0.0)], counters=counters)
    FT([s(0.0, [-1.0], truncated=True), s(0.0, [-1.0])], counters=counters)
    FT([s(0.0, [-1.0], truncated=True)], counters=counters)
    assert counters == collections.Counter(
        accepted_mixed=1, rejected_by_all_correct=1, rejected_by_all_wrong=2, accepted_penalized_all_wrong=1,
        rejected_by_failed_or_perfect=3,
    )
    assert set(FILTER_COUNTERS) == set(counters)
    plain: dict = {}
    F([s(1.0), s(1.0)], counters=plain)
    assert plain == {"rejected_by_all_correct": 1, "rejected_by_failed_or_perfect": 1}


@pytest.mark.parametrize(
    ("group", "match"),
    [
        ([], "at least one sample"),
        ([s(float("nan"))], "finite"),
        ([{"token_rewards": [0.0]}], "no 'reward'"),
        ([s(0.0, [0.0, 1.0], [1])], "loss_mask shape"),
        ([s(0.0, [float("inf")])], "finite"),
        ({"token_rewards": [[0.0]]}, "rewards"),
        ({"rewards": [0.0, 0.0], "token_rewards": [[0.0]]}, r"\[G=2, T\]"),
    ],
)
def test_bad_groups_fail_clearly(group, match):
    with pytest.raises(ValueError, match=match):
        F(group)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_matches_a_direct_reading_of_the_rule(data):
    g = data.draw(st.integers(1, 5))
    t = data.draw(st.integers(1, 4))
    rewards = data.draw(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 1.0]), min_size=g, max_size=g))
    tr = np.array(data.draw(st.lists(st.lists(st.sampled_from([-0.3, 0.0, 0.4]), min_size=t, max_size=t), min_size=g, max_size=g)))
    lm = np.array(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=t, max_size=t), min_size=g, max_size=g)))
    trunc = np.array(data.draw(st.lists(st.booleans(), min_size=g, max_size=g)))
    group = {"rewards": rewards, "token_rewards": tr, "loss_mask": lm, "truncated": trunc}
    r = np.array(rewards)
    mixed = len(set(rewards)) > 1
    pen = ((tr < 0) & (lm == 1)).any()
    assert bool(F(group)) == (mixed or (bool((r <= 0).all()) and bool(pen)))
    # the _mask_no_eos variant: only the penalties of truncated samples stop counting
    pen_eos = ((tr[~trunc] < 0) & (lm[~trunc] == 1)).any()
    assert bool(FT(group)) == (mixed or (bool((r <= 0).all()) and bool(pen_eos)))
