"""The jitted PPO step: no recompiles in steady state, padding rows are inert, and the step on an
8-device (data x fsdp) mesh matches one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxprm
from jaxprm.train.policy import Policy
from jaxprm.models import next_token_logprobs
from jaxprm.train.adapters import total_updates
from jaxprm.train.step import TrainStep, make_optimizer, make_schedule
from jaxprm.train.config import load_config
from tests.train._models import toy_transformer

ROOT = Path(__file__).resolve().parents[2]


def _data(B, T, n_real, seed=0, V=64):
    rng = np.random.default_rng(seed)
    w = np.zeros(B, np.float32)
    w[:n_real] = 1
    mask = (rng.random((B, T)) > 0.3).astype(np.float32) * w[:, None]
    mask[:, -1] = 0
    return {
        "tokens": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
        "loss_mask": jnp.asarray(mask),
        "old_logprobs": jnp.asarray(-rng.random((B, T)) * 4 * mask, jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=(B, T)) * mask, jnp.float32),
        "row_weights": jnp.asarray(w),
    }


def _step(policy, **kw):
    kw.setdefault("loss_kwargs", {"eps_clip": 0.2, "agg": "token-mean"})
    return TrainStep(policy.apply_fn, optax.adamw(1e-2), jaxprm.policy_loss, **kw)


def test_steady_state_never_recompiles():
    policy = Policy(toy_transformer())
    ts = _step(policy, epochs=2, num_minibatches=2)
    state = ts.init_state(policy.params)
    for i in range(3):
        state, m = ts(state, _data(8, 32, n_real=3 + i, seed=i), jax.random.key(i))
    assert ts.compiles == 1
    assert np.isfinite(float(m["loss"])) and float(m["updates"]) == 4
    state, _ = ts(state, _data(8, 64, n_real=8, seed=5), jax.random.key(5))  # a new length bucket
    state, _ = ts(state, _data(8, 32, n_real=1, seed=6), jax.random.key(6))  # back to the first
    assert ts.compiles == 2


def test_padding_rows_are_inert_and_empty_minibatches_skip():
    policy = Policy(toy_transformer())
    small = _data(8, 16, n_real=5, seed=1)
    big = {k: jnp.concatenate([v, jnp.zeros((8,) + v.shape[1:], v.dtype)]) for k, v in small.items()}
    outs = []
    for d in (small, big):
        ts = _step(policy)
        st, m = ts(ts.init_state(policy.params), d, jax.random.key(0))
        outs.append((st, m))
    (s1, m1), (s2, m2) = outs
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # 4 minibatches but 1 real row: 3 minibatches are empty and do not step the optimizer
    ts = _step(policy, num_minibatches=4)
    st, m = ts(ts.init_state(policy.params), _data(8, 16, n_real=1, seed=2), jax.random.key(0))
    assert float(m["updates"]) == 1
    assert int(st.opt_state[0].count) == 1


def test_update_moves_logprobs_in_the_advantage_direction():
    policy = Policy(toy_transformer())
    d = _data(8, 16, n_real=8, seed=3)
    d["advantages"] = d["loss_mask"] * 1.0  # push every active token up
    lp0 = policy.apply_fn(policy.params, d["tokens"], jnp.broadcast_to(jnp.arange(16), (8, 16)))
    from jaxprm.models import next_token_logprobs

    before = float((next_token_logprobs(lp0, d["tokens"]) * d["loss_mask"]).sum())
    ts = _step(policy, epochs=3)
    d["old_logprobs"] = next_token_logprobs(lp0, d["tokens"]) * d["loss_mask"]
    st, _ = ts(ts.init_state(policy.params), d, jax.random.key(0))
    lp1 = policy.apply_fn(st.params, d["tokens"], jnp.broadcast_to(jnp.arange(16), (8, 16)))
    after = float((next_token_logprobs(lp1, d["tokens"]) * d["loss_mask"]).sum())
    assert after > before


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_entropy_bonus_is_the_token_mean_entropy_of_the_minibatch(agg):
    """One SGD step with the bonus moves params by -lr * grad(loss - c * H) with H the token mean of
    the next-token entropy over the active tokens (microbatched: the accumulation is exact), and the
    ``entropy`` metric is H; without the bonus the metric is the same and carries no gradient."""
    from jaxprm.models.logprobs import entropy_of

    policy = Policy(toy_transformer())
    d = _data(8, 16, n_real=6, seed=9)
    c, lr = 0.3, 0.1
    pos = jnp.broadcast_to(jnp.arange(16), (8, 16))
    kw = {"eps_clip": 0.2, "agg": agg}

    def objective(params):
        logits = policy.apply_fn(params, d["tokens"], pos)
        loss, _ = jaxprm.policy_loss(next_token_logprobs(logits, d["tokens"]), d["old_logprobs"], d["advantages"],
                                     d["loss_mask"], **kw)
        m = (d["loss_mask"] > 0).astype(jnp.float32)
        return loss - c * jnp.sum(entropy_of(logits) * m) / m.sum(), jnp.sum(entropy_of(logits) * m) / m.sum()

    grads, h = jax.grad(objective, has_aux=True)(policy.params)
    for coef in (c, 0.0) if agg == "token-mean" else (c,):  # the metric without the bonus: agg plays no part
        ts = TrainStep(policy.apply_fn, optax.sgd(lr), jaxprm.policy_loss, loss_kwargs=kw, microbatch_rows=2,
                       entropy_coef=coef)
        st, m = ts(ts.init_state(policy.params), d, jax.random.key(0))
        np.testing.assert_allclose(float(m["entropy"]), float(h), rtol=1e-5)
        if coef:
            for new, old, g in zip(jax.tree.leaves(st.params), jax.tree.leaves(policy.params), jax.tree.leaves(grads)):
                np.testing.assert_allclose(np.asarray(new) - np.asarray(old), -lr * np.asarray(g), rtol=2e-4,
                                           atol=1e-7)
    with pytest.raises(ValueError, match="entropy_coef"):
        TrainStep(policy.apply_fn, optax.sgd(lr), jaxprm.policy_loss, entropy_coef=-1.0)


def test_schedule_warmup_and_cosine():
    cfg = load_config(None, ["optimizer.schedule=cosine", "optimizer.warmup_steps=4", "optimizer.lr=1e-3",
                             "steps=10", "optimizer.min_lr_ratio=0.1", "ppo.num_minibatches=1",
                             "ppo.epochs=1"])
    s = make_schedule(cfg.optimizer, total_updates(cfg))
    assert float(s(0)) == 0.0 and float(s(4)) == pytest.approx(1e-3)
    assert float(s(10)) == pytest.approx(1e-4, rel=1e-3)
    cfg = load_config(None, ["optimizer.schedule=constant", "optimizer.warmup_steps=2", "optimizer.lr=1e-3"])
    s = make_schedule(cfg.optimizer, total_updates(cfg))
    assert float(s(1)) == pytest.approx(5e-4) and float(s(100)) == pytest.approx(1e-3)
    make_optimizer(cfg.optimizer, total_updates(cfg))  # builds


_MESH_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
import jaxprm
from jaxprm.train.policy import Policy
from jaxprm.train.step import TrainStep, make_mesh
from tests.train._models import toy_transformer
from tests.train.test_step import _data
policy = Policy(toy_transformer())
data, fsdp = int(sys.argv[1]), int(sys.argv[2])
mesh = make_mesh(data, fsdp) if data * fsdp > 1 else None
# SGD keeps the update proportional to the gradient: Adam's m / sqrt(v) turns float rounding of
# near-zero gradient entries into O(lr) differences, which would test Adam, not the sharding.
ts = TrainStep(policy.apply_fn, optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5)), jaxprm.policy_loss,
               epochs=2, num_minibatches=2, loss_kwargs={"eps_clip": 0.2}, mesh=mesh, microbatch_rows=4)
init = [np.asarray(x).ravel() for x in jax.tree.leaves(policy.params)]
st = ts.init_state(policy.params)
st, m = ts(st, _data(16, 32, n_real=13, seed=4), jax.random.key(7))
leaves = [(np.asarray(x).ravel() - i0).tolist() for x, i0 in zip(jax.tree.leaves(st.params), init)]  # the update
shard = str(jax.tree.leaves(st.params)[-1].sharding)
print(json.dumps({"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "params": leaves,
                  "devices": jax.device_count(), "sharding": shard}))
"""


def _run_mesh(data, fsdp):
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(data), str(fsdp)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_eight_device_mesh_matches_one_device():
    one = _run_mesh(1, 1)
    eight = _run_mesh(2, 4)
    assert eight["devices"] == 8 and "fsdp" in eight["sharding"]
    np.testing.assert_allclose(eight["loss"], one["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(eight["grad_norm"], one["grad_norm"], rtol=1e-4)
    for a, b in zip(one["params"], eight["params"]):  # parameter updates of the 4 optimizer steps
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * np.abs(a).max())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_microbatch_accumulation_equals_whole_minibatch(agg):
    policy = Policy(toy_transformer())
    d = _data(16, 16, n_real=11, seed=8)
    outs = []
    for micro in (None, 4):
        # SGD: the update is proportional to the gradient, so this compares the accumulation (Adam's
        # m / sqrt(v) would turn rounding of near-zero gradient entries into O(lr) differences)
        ts = TrainStep(policy.apply_fn, optax.sgd(0.5), jaxprm.policy_loss, num_minibatches=2, microbatch_rows=micro,
                       loss_kwargs={"eps_clip": 0.2, "agg": agg})
        outs.append(ts(ts.init_state(policy.params), d, jax.random.key(3)))
    (s1, m1), (s2, m2) = outs
    for k in ("loss", "grad_norm", "clip_fraction", "approx_kl"):
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-4, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_behavior_kl_measures_the_sampler_mismatch_before_any_update():
    policy = Policy(toy_transformer())
    d = _data(8, 16, n_real=8, seed=5)
    T = d["tokens"].shape[1]
    own = next_token_logprobs(policy.apply_fn(policy.params, d["tokens"], jnp.broadcast_to(jnp.arange(T), (8, T))),
                          d["tokens"]) * d["loss_mask"]
    ts = _step(policy, epochs=2, num_minibatches=2)
    _, m = ts(ts.init_state(policy.params), {**d, "old_logprobs": own}, jax.random.key(0))
    assert abs(float(m["behavior_kl"])) < 1e-5 < float(m["approx_kl"])  # later updates moved the policy
    _, m = ts(ts.init_state(policy.params), {**d, "old_logprobs": own - 0.3 * d["loss_mask"]}, jax.random.key(0))
    assert float(m["behavior_kl"]) > 1e-3


def test_target_kl_stops_the_step_once_the_policy_has_moved_too_far():
    policy = Policy(toy_transformer())
    d = _data(16, 32, n_real=16, seed=2)
    pos = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), d["tokens"].shape)
    # behaviour = the policy itself: the first minibatch is on-policy (KL ~0) and always applied
    d["old_logprobs"] = next_token_logprobs(policy.apply_fn(policy.params, d["tokens"], pos), d["tokens"]) * d["loss_mask"]
    outs = {}
    for target in (None, 1e9, 1e-4):
        ts = TrainStep(policy.apply_fn, optax.sgd(20.0), jaxprm.policy_loss, epochs=2, num_minibatches=2,
                       loss_kwargs={"eps_clip": 0.2}, target_kl=target)
        outs[target] = ts(ts.init_state(policy.params), d, jax.random.key(0))
    (s_none, m_none), (s_big, m_big), (s_small, m_small) = outs[None], outs[1e9], outs[1e-4]
    for a, b in zip(jax.tree.leaves(s_none.params), jax.tree.leaves(s_big.params)):  # never triggered: the same step
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(m_none["updates"]) == float(m_big["updates"]) == 4 and float(m_big["kl_stopped"]) == 0
    assert float(m_small["updates"]) == 1 and float(m_small["kl_stopped"]) == 3  # stopped after the first update
    assert float(m_small["approx_kl"]) > 1.5e-4  # the metrics still see the skipped minibatches
    with pytest.raises(ValueError, match="target_kl"):
        TrainStep(policy.apply_fn, optax.sgd(1.0), jaxprm.policy_loss, target_kl=0.0)
