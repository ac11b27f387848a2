"""Helpers shared by the model tests: tiny random Hugging Face reference models."""

from __future__ import annotations

import numpy as np

from jaxprm.models import ModelConfig, build_model
from jaxprm.models.params import hf_to_params

BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


def hf_reference(family: str, seed: int = 0, **overrides):
    """A randomly initialized float32 transformers model (eager attention) and its config dict.

    Every parameter (norm weights and biases included) is drawn from N(0, 0.2^2), so mistakes in
    any of them show in the logits.
    """
    import torch
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[family]
    hf_config = cls(**{**BASE, **overrides})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model, hf_config


def jax_from_torch(model, hf_config):
    """Our Transformer holding the same weights as the torch model."""
    config = ModelConfig.from_hf(hf_config.to_dict())
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return build_model(config, hf_to_params(config, state.__getitem__, state.__contains__))


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()
