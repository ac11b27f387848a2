"""Logits of our NNX transformer vs the Hugging Face PyTorch implementation (float32, eager)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tests.models._hf import hf_reference, jax_from_torch, torch_logits  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3": ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3}),
    "llama-linear-bias": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.5},
                                    "attention_bias": True}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "qwen2": ("qwen2", {}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied-yarn": ("qwen3", {"tie_word_embeddings": True, "max_position_embeddings": 128,
                                  "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32}}),
}


@nnx.jit
def _forward(model, tokens, positions):
    return model(tokens, positions)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    family, overrides = CASES[case]
    torch_model, hf_config = hf_reference(family, seed=len(case), **overrides)
    model = jax_from_torch(torch_model, hf_config)
    assert model.config.family == family
    assert model.config.tie_embeddings == bool(overrides.get("tie_word_embeddings", False))
    assert (model.lm_head is None) == model.config.tie_embeddings

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, hf_config.vocab_size, size=(2, 40))
    positions = np.broadcast_to(np.arange(40), tokens.shape)
    ref = torch_logits(torch_model, tokens)
    out = _forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32))
    assert out.dtype == jnp.float32 and out.shape == ref.shape
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=0)


def test_bfloat16_params_give_float32_logits_close_to_float32():
    torch_model, hf_config = hf_reference("qwen3", seed=3)
    model = jax_from_torch(torch_model, hf_config)
    from jaxprm.models import build_model, model_params

    bf16 = build_model(model.config.replace(param_dtype="bfloat16"),
                       {k: np.asarray(v) for k, v in model_params(model).items()})
    assert bf16.embed[...].dtype == jnp.bfloat16
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    lo = _forward(bf16, tokens, positions)
    hi = _forward(model, tokens, positions)
    assert lo.dtype == jnp.float32
    scale = float(jnp.abs(hi).max())
    assert float(jnp.abs(lo - hi).max()) < 0.05 * scale
