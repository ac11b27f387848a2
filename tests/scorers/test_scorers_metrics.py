"""Metric names and the mergeable accumulator arithmetic."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scorers import MetricsAccumulator, PRMMetricObservation, PRMTurnResult
from scorers.metrics import metric_key, trajectory_reward_key, turn_reward_key


def test_metric_names_and_url_quoting():
    assert turn_reward_key("length_budget") == "prm_turn_reward/length_budget"
    assert trajectory_reward_key("judge v2") == "prm_trajectory_reward/judge%20v2"
    assert metric_key("turn", "my/scorer", "a/b c", "rate") == "prm_metric/turn/my%2Fscorer/a%2Fb%20c/rate"


def test_observation_aggregations():
    acc = MetricsAccumulator()
    for v in (True, False, True, True):
        acc.record_observation("s", PRMMetricObservation("ok", "turn", "t", v, "boolean", ("count", "rate")))
    for v in (1.0, 2.0, 6.0):
        acc.record_observation("s", PRMMetricObservation("len", "trajectory", "b", v, "float", ("sum", "mean")))
    m = acc.summary()
    assert m["rollout/prm_metric/turn/s/ok/count"] == 3
    assert m["rollout/prm_metric/turn/s/ok/rate"] == pytest.approx(0.75)
    assert m["rollout/prm_metric/trajectory/s/len/sum"] == pytest.approx(9.0)
    assert m["rollout/prm_metric/trajectory/s/len/mean"] == pytest.approx(3.0)


def test_turn_and_branch_rewards():
    acc = MetricsAccumulator("eval-rollout")
    acc.record_turn_results([PRMTurnResult("s", "a", 1.0), PRMTurnResult("s", "b", 0.0)])
    acc.record_branch_totals({"s": 1.0})
    assert acc.summary() == {"eval-rollout/prm_trajectory_reward/s": 1.0, "eval-rollout/prm_turn_reward/s": 0.5}


def test_merge_weights_means_by_counts_and_adds_sums_and_counts():
    w1, w2 = MetricsAccumulator(), MetricsAccumulator()
    for v in (1.0, 1.0, 1.0):  # worker 1: mean 1 over 3
        w1.add_mean("m", v)
    w2.add_mean("m", 0.0)  # worker 2: mean 0 over 1
    w1.add_mean("r", 1.0, kind="rate")
    w2.add_mean("r", 0.0, count=3, kind="rate")
    w1.add_sum("s", 2.5)
    w2.add_sum("s", 4.0)
    w1.add_count("c", 2)
    w2.add_count("c", 5)
    merged = MetricsAccumulator().merge(w1, w2)
    m = merged.summary(prefix=False)
    assert m["m"] == pytest.approx(0.75)  # (3*1 + 1*0) / 4, not (1 + 0) / 2
    assert m["r"] == pytest.approx(0.25)
    assert m["s"] == pytest.approx(6.5)
    assert m["c"] == 7
    assert merged.stat("m").count == 4


def test_merge_refuses_other_namespaces_and_kind_clashes():
    with pytest.raises(ValueError, match="namespace"):
        MetricsAccumulator().merge(MetricsAccumulator("eval-rollout"))
    with pytest.raises(ValueError, match="namespace"):
        MetricsAccumulator("train")
    a = MetricsAccumulator()
    a.add_sum("k", 1.0)
    with pytest.raises(ValueError, match="sum statistic"):
        a.add_mean("k", 1.0)
    with pytest.raises(ValueError, match="finite"):
        a.add_sum("k", math.inf)


def test_transport_round_trip_keeps_counts():
    a = MetricsAccumulator("eval-rollout")
    a.add_mean("m", 0.5, count=4)
    a.add_count("c", 3)
    b = MetricsAccumulator.from_dict(json.loads(json.dumps(a.to_dict())))
    assert b.namespace == "eval-rollout" and b.summary() == a.summary()
    assert b.stat("m").count == 4
    c = b.copy().merge(b)
    assert c.stat("m").count == 8 and c.summary(prefix=False)["m"] == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.floats(-1e3, 1e3, allow_nan=False), st.integers(1, 5)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 4),
)
def test_merging_any_split_equals_accumulating_everything(records, parts):
    whole = MetricsAccumulator()
    shards = [MetricsAccumulator() for _ in range(parts)]
    for i, (key, value, count) in enumerate(records):
        whole.add_mean(key, value, count)
        whole.add_sum(key + "_sum", value)
        shards[i % parts].add_mean(key, value, count)
        shards[i % parts].add_sum(key + "_sum", value)
    merged = MetricsAccumulator().merge(*shards)
    got, want = merged.summary(), whole.summary()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-6)
