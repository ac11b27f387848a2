"""Activation checkpointing (``ppo.remat``) and bf16 compute (``model.compute_dtype``) in the
learner: one update of the flat and of the tree-packed step with ``block`` / ``full`` remat equals
the update without (float32: same gradients up to float rounding), and bf16 compute with float32
master params stays within a stated tolerance of float32 (loss within 2%, update direction cosine
>= 0.98 per parameter tensor)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxprm
from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.packed import PackedTrainStep, packed_step_inputs
from jaxprm.train.policy import Policy, learner_apply
from jaxprm.train.step import TrainStep, step_inputs
from tests.train._models import toy_transformer
from tests.train.test_packed import _batches

LOSS = {"eps_clip": 0.2, "eps_clip_higher": 0.28, "agg": "token-mean"}


def _update(apply_fn, params, packed: bool):
    flat, pk, adv = _batches(4)
    step = TrainStep(apply_fn, optax.sgd(1.0), jaxprm.policy_loss, loss_kwargs=LOSS, microbatch_rows=4)
    if packed:
        step = PackedTrainStep.like(step)
        state, metrics = step(step.init_state(params), packed_step_inputs(pk, flat, adv, agg="token-mean"),
                              jax.random.key(0))
    else:
        state, metrics = step(step.init_state(params), step_inputs(flat, adv), jax.random.key(0))
    deltas = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
              for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params))]
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {x.dtype for x in jax.tree.leaves(params)}  # master
    return float(metrics["loss"]), deltas


def _policy(remat_block: bool) -> Policy:
    model = toy_transformer(seed=3)
    model.remat = remat_block
    return Policy(model)


@pytest.fixture(scope="module")
def baseline():
    """The float32 update without remat, flat and packed: ``{packed: (loss, deltas)}``."""
    base = _policy(False)
    return {packed: _update(base.apply_fn, base.params, packed) for packed in (False, True)}


@pytest.mark.parametrize("remat,packed", [("block", False), ("full", True),
                                          pytest.param("block", True, marks=pytest.mark.slow),
                                          pytest.param("full", False, marks=pytest.mark.slow)])
def test_remat_gives_the_same_update(remat, packed, baseline):
    loss0, d0 = baseline[packed]
    policy = _policy(remat == "block")
    loss1, d1 = _update(policy.learner_apply_fn(remat=remat), policy.params, packed)
    assert loss1 == pytest.approx(loss0, rel=1e-6, abs=1e-7)
    for a, b in zip(d0, d1):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * max(np.abs(a).max(), 1e-6))


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bf16_compute_stays_close_to_float32(packed, baseline):
    policy = _policy(False)
    loss32, d32 = baseline[packed]
    loss16, d16 = _update(policy.learner_apply_fn(compute_dtype="bfloat16"), policy.params, packed)
    assert loss16 == pytest.approx(loss32, rel=2e-2, abs=1e-3)
    for a, b in zip(d32, d16):
        assert b.dtype == np.float64 and np.isfinite(b).all()
        cos = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
        assert cos >= 0.98, cos


def test_bf16_logits_are_float32_and_float32_changes_nothing():
    """(The master params keep their dtype through an update: checked in every ``_update``.)"""
    policy = _policy(False)
    fwd = learner_apply(policy.apply_fn, compute_dtype="bfloat16")
    tokens = jax.numpy.arange(16, dtype=jax.numpy.int32).reshape(2, 8) % 64
    pos = jax.numpy.broadcast_to(jax.numpy.arange(8), (2, 8))
    assert fwd(policy.params, tokens, pos).dtype == jax.numpy.float32
    assert learner_apply(policy.apply_fn) == policy.apply_fn  # nothing to change: the same function


def test_config_declares_remat_and_compute_dtype():
    cfg = load_config(None, ["ppo.remat=block", "model.compute_dtype=bfloat16"])
    assert cfg.ppo.remat == "block" and cfg.model.compute_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="ppo.remat"):
        load_config(None, ["ppo.remat=layers"])
    with pytest.raises(ConfigError, match="model.compute_dtype"):
        load_config(None, ["model.compute_dtype=float16"])
