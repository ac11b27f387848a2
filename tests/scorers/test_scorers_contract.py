"""The scorer contract: observations, results, the base classes and the length-budget example."""

from __future__ import annotations

import math

import numpy as np
import pytest

from prm_test_scorers import ConstScorer, run, turn
from scorers import (
    BaseScorer,
    BaseTrajectoryScorer,
    LengthBudgetScorer,
    PRMMetricObservation,
    PRMScorerResult,
)


# -- PRMMetricObservation -------------------------------------------------------------------------


def test_boolean_observation_allows_count_and_rate():
    o = PRMMetricObservation("ok", "turn", "t0", True, "boolean", ["count", "rate"])
    assert o.aggregations == ("count", "rate")
    assert o.schema == ("boolean", ("count", "rate"))


def test_numeric_observation_allows_sum_and_mean_and_coerces_to_float():
    o = PRMMetricObservation("len", "trajectory", "leaf", np.int64(3), "float", ("sum", "mean"))
    assert o.value == 3.0 and isinstance(o.value, float)


@pytest.mark.parametrize(
    ("vtype", "aggs"),
    [("boolean", ("sum",)), ("boolean", ("mean",)), ("float", ("rate",)), ("float", ("count",)), ("float", ("median",))],
)
def test_aggregations_must_fit_the_value_type(vtype, aggs):
    value = True if vtype == "boolean" else 1.0
    with pytest.raises(ValueError, match="not allowed"):
        PRMMetricObservation("m", "turn", "t", value, vtype, aggs)


def test_aggregations_must_be_unique_and_non_empty():
    with pytest.raises(ValueError, match="unique"):
        PRMMetricObservation("m", "turn", "t", 1.0, "float", ("sum", "sum"))
    with pytest.raises(ValueError, match="non-empty"):
        PRMMetricObservation("m", "turn", "t", 1.0, "float", ())
    with pytest.raises(TypeError, match="not a string"):
        PRMMetricObservation("m", "turn", "t", 1.0, "float", "sum")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_numeric_values_must_be_finite(value):
    with pytest.raises(ValueError, match="finite"):
        PRMMetricObservation("m", "turn", "t", value, "float", ("mean",))


def test_value_types_are_strict():
    with pytest.raises(TypeError, match="bool"):
        PRMMetricObservation("m", "turn", "t", 1, "boolean", ("rate",))
    with pytest.raises(TypeError, match="real number"):
        PRMMetricObservation("m", "turn", "t", True, "float", ("mean",))
    with pytest.raises(TypeError, match="real number"):
        PRMMetricObservation("m", "turn", "t", "1.0", "float", ("mean",))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scope": "session"}, "scope"),
        ({"value_type": "int"}, "value_type"),
        ({"metric_id": ""}, "metric_id"),
        ({"target_id": "  "}, "target_id"),
    ],
)
def test_scope_type_and_ids_are_checked(kwargs, match):
    base = dict(metric_id="m", scope="turn", target_id="t", value=1.0, value_type="float", aggregations=("mean",))
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        PRMMetricObservation(**base)


def test_scorer_result_requires_observation_instances():
    with pytest.raises(TypeError, match="PRMMetricObservation"):
        PRMScorerResult(1.0, ({"metric": "x"},))
    with pytest.raises(TypeError, match="sequence"):
        PRMScorerResult(1.0, "abc")
    assert PRMScorerResult(1.0, []).observations == ()


# -- BaseScorer ------------------------------------------------------------------------------------


def test_scorer_needs_a_class_level_name():
    class Nameless(BaseScorer):
        async def evaluate(self, interaction, ctx):
            return 0.0

    with pytest.raises(ValueError, match="name"):
        Nameless()


def test_scorer_constructor_checks_weight_enabled_and_unknown_kwargs():
    s = ConstScorer(weight=2, enabled=False)
    assert s.weight == 2.0 and s.enabled is False
    with pytest.raises(ValueError, match="finite"):
        ConstScorer(weight=math.inf)
    with pytest.raises(TypeError, match="weight"):
        ConstScorer(weight="1")
    with pytest.raises(TypeError, match="enabled"):
        ConstScorer(enabled="yes")
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['colour'\]"):
        ConstScorer(colour="red")


def test_default_hooks():
    s = ConstScorer(0.25)
    it = turn("a", None, 3)
    result = run(s.evaluate_result(it, {}))
    assert result == PRMScorerResult(0.25)
    none = ConstScorer(None)
    assert run(none.evaluate_result(it, {})) is None
    assert run(s.aclose()) is None  # optional no-op hook

    class Bare(BaseScorer):
        name = "bare"

    with pytest.raises(NotImplementedError):
        run(Bare().evaluate(it, {}))


def test_trajectory_scorer_is_not_evaluated_per_turn():
    class T(BaseTrajectoryScorer):
        name = "t"

    with pytest.raises(RuntimeError, match="trajectory scorer"):
        run(T().evaluate(turn("a", None), {}))


# -- LengthBudgetScorer ----------------------------------------------------------------------------


@pytest.mark.parametrize(("output_len", "expected"), [(1, 1.0), (3, 1.0), (4, 0.0)])
def test_length_budget_scores_and_observes(output_len, expected):
    scorer = LengthBudgetScorer(max_output_tokens=3)
    assert scorer.name == "length_budget"
    it = turn("x", None, output_len)
    assert run(scorer.evaluate(it, {})) == expected
    res = run(scorer.evaluate_result(it, {}))
    assert res.reward == expected
    within = {o.metric_id: o for o in res.observations}["within_budget"]
    assert within.value is (expected == 1.0)
    assert within.value_type == "boolean" and within.aggregations == ("count", "rate")
    assert within.scope == "turn" and within.target_id == "x"


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_length_budget_validates_its_budget(bad):
    with pytest.raises(ValueError, match="max_output_tokens"):
        LengthBudgetScorer(max_output_tokens=bad)
