"""LoRA adapters (``jaxprm.models.lora``, ``nnx.LoRA`` layers on the stacked projections): a fresh
adapter changes nothing; the in-layer forward ``x @ W + s (x @ a) @ b`` equals the merged model's
``x @ (W + s a @ b)`` within float32 rounding (the model computes its norms and logits in float32,
so a float64 reference is not available); the adapters' gradient through the
in-layer forward equals the gradient through the merge; the policy trains only adapters and serves
the merged plain model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprm.models import LORA_TARGETS, LoraConfig, Transformer, add_lora, merged_params
from jaxprm.models.config import ModelConfig
from jaxprm.models.lora import adapter_count, target_features
from jaxprm.train.policy import Policy

CONFIG = ModelConfig(family="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True)
TOKENS = (jnp.arange(2 * 9, dtype=jnp.int32).reshape(2, 9) * 7) % 64
POSITIONS = jnp.broadcast_to(jnp.arange(9), (2, 9))


def _lora_model(config=CONFIG, rank=4, targets=LORA_TARGETS, seed=0, nonzero=True) -> Transformer:
    model = add_lora(Transformer(config, rngs=nnx.Rngs(seed)), LoraConfig(rank=rank, alpha=8.0, targets=list(targets)),
                     jax.random.key(seed + 1))
    if nonzero:  # a trained adapter: b != 0
        for i, m in enumerate(model.layers.lora.values()):
            m.lora_b.value = 0.3 * jax.random.normal(jax.random.key(100 + i), m.lora_b.value.shape, m.lora_b.value.dtype)
    return model


def test_config_is_validated():
    assert not LoraConfig().enabled and LoraConfig(rank=8, alpha=16).scale == 2.0
    for bad in ({"rank": -1}, {"rank": 2.5}, {"rank": 4, "alpha": 0}, {"rank": 4, "targets": ["qkv"]},
                {"rank": 4, "targets": []}, {"rank": 4, "targets": ["q_proj", "q_proj"]}):
        with pytest.raises(ValueError):
            LoraConfig(**bad)


def test_adapters_are_stacked_nnx_lora_params_and_start_at_zero():
    model = _lora_model(rank=3, nonzero=False)
    state = nnx.state(model, nnx.LoRAParam).to_pure_dict()["layers"]["lora"]
    assert sorted(state) == sorted(LORA_TARGETS)
    for t, ab in state.items():
        n_in, n_out = target_features(CONFIG, t)
        assert ab["lora_a"].shape == (2, n_in, 3) and ab["lora_b"].shape == (2, 3, n_out)
        assert float(jnp.abs(ab["lora_b"]).max()) == 0.0 and float(jnp.std(ab["lora_a"])) > 0
    plain = Transformer(CONFIG, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(TOKENS, POSITIONS)[0], plain(TOKENS, POSITIONS)[0])


@pytest.mark.parametrize("targets", [LORA_TARGETS, pytest.param(("q_proj", "v_proj"), marks=pytest.mark.slow),
                                     pytest.param(("o_proj", "down_proj"), marks=pytest.mark.slow)])
def test_in_layer_forward_equals_the_merged_model(targets):
    policy = Policy(_lora_model(targets=targets))
    lora_logits = policy.apply_fn(policy.params, TOKENS, POSITIONS)
    merged_logits = policy.module()(TOKENS, POSITIONS)[0]
    plain_logits = Transformer(CONFIG, rngs=nnx.Rngs(0))(TOKENS, POSITIONS)[0]
    assert float(jnp.abs(lora_logits - plain_logits).max()) > 1e-2  # the adapters act
    np.testing.assert_allclose(lora_logits, merged_logits, rtol=1e-5, atol=1e-5)


def test_adapter_gradients_equal_the_gradients_through_the_merge():
    policy = Policy(_lora_model())
    plain = Policy(Transformer(CONFIG, rngs=nnx.Rngs(0)))
    target = jax.random.normal(jax.random.key(5), (2, 9, 64))

    def via_layers(adapters):
        return jnp.sum(policy.apply_fn(adapters, TOKENS, POSITIONS) * target)

    def via_merge(adapters):
        return jnp.sum(plain.apply_fn(merged_params(policy.base, adapters, policy.lora_scale), TOKENS, POSITIONS) * target)

    g1, g2 = jax.grad(via_layers)(policy.params), jax.grad(via_merge)(policy.params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert float(jnp.abs(a).max()) > 0
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * float(jnp.abs(b).max()))


def test_policy_trains_adapters_only_and_serves_the_plain_model():
    model = _lora_model(rank=2, targets=("q_proj", "up_proj"))
    policy = Policy(model)
    assert policy.is_lora and policy.lora_scale == 4.0
    assert list(policy.params) == ["layers"] and sorted(policy.params["layers"]["lora"]) == ["q_proj", "up_proj"]
    L, D, F = 2, 32, 48
    assert adapter_count(policy.params) == L * (D * 2 + 2 * 32) + L * (D * 2 + 2 * F)
    served = policy.serving_params()
    plain = nnx.state(Transformer(CONFIG, rngs=nnx.Rngs(0)), nnx.Param).to_pure_dict()
    assert jax.tree.structure(served) == jax.tree.structure(plain)
    assert served["embed"] is policy.base["embed"]  # untouched weights are shared, not copied
    assert not np.allclose(served["layers"]["q_proj"], plain["layers"]["q_proj"])
    np.testing.assert_array_equal(served["layers"]["k_proj"], plain["layers"]["k_proj"])
    module = policy.module()
    assert isinstance(module, Transformer) and module.layers.lora is None


@pytest.mark.slow
def test_lora_with_remat_and_bf16_compute():
    """``ppo.remat`` gives the adapters the same gradient; bf16 compute (adapters and frozen weights
    cast on the way in, given as the pair the trainer's jitted code passes) stays within bf16
    rounding of float32 and keeps float32 logits."""
    target = jax.random.normal(jax.random.key(7), (2, 9, 64))

    def grads(policy, fwd):
        return jax.grad(lambda a: jnp.sum(fwd(policy.with_frozen(a), TOKENS, POSITIONS) * target))(policy.params)

    policy = Policy(_lora_model())
    g0 = grads(policy, policy.apply_fn)
    g_full = grads(policy, policy.learner_apply_fn(remat="full"))
    block_model = _lora_model()
    block_model.remat = True
    block = Policy(block_model)
    g_block = grads(block, block.learner_apply_fn(remat="block"))
    for a, b, c in zip(jax.tree.leaves(g0), jax.tree.leaves(g_full), jax.tree.leaves(g_block)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6 * float(jnp.abs(a).max()))
        np.testing.assert_allclose(c, a, rtol=1e-4, atol=1e-6 * float(jnp.abs(a).max()))
    bf16 = policy.learner_apply_fn(compute_dtype="bfloat16")
    l32 = policy.apply_fn(policy.params, TOKENS, POSITIONS)
    l16 = bf16(policy.with_frozen(policy.params), TOKENS, POSITIONS)
    assert l16.dtype == jnp.float32
    err = float(jnp.abs(l16 - l32).max())
    assert 0 < err < 0.1 * float(jnp.abs(l32).max())  # bf16 matmuls did run (err > 0), within bf16 rounding
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(grads(policy, bf16))):
        cos = float(jnp.sum(a * b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
        assert cos >= 0.98, cos
