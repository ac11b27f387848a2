"""Moving parameters in and out of a ``Transformer``: HF tensor names <-> the stacked layout.

``hf_to_params`` turns per-layer Hugging Face tensors (``[out, in]`` linear weights, named
``model.layers.{i}.self_attn.q_proj.weight`` ...) into the stacked ``x @ W`` arrays the model uses;
``params_to_hf`` is its inverse. ``build_model`` creates a model without random initialization
(abstract shapes, then the given arrays) so loading a large checkpoint never pays for an init.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models.config import ModelConfig
from jaxprm.models.transformer import Transformer

__all__ = ["hf_to_params", "params_to_hf", "build_model", "model_params", "expected_param_shapes"]

# stacked name -> (HF per-layer suffix, kind)
_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "vec"),
    "q_proj": ("self_attn.q_proj.weight", "q"),
    "k_proj": ("self_attn.k_proj.weight", "kv"),
    "v_proj": ("self_attn.v_proj.weight", "kv"),
    "q_bias": ("self_attn.q_proj.bias", "qb"),
    "k_bias": ("self_attn.k_proj.bias", "kvb"),
    "v_bias": ("self_attn.v_proj.bias", "kvb"),
    "q_norm": ("self_attn.q_norm.weight", "vec"),
    "k_norm": ("self_attn.k_norm.weight", "vec"),
    "o_proj": ("self_attn.o_proj.weight", "o"),
    "o_bias": ("self_attn.o_proj.bias", "vec"),
    "mlp_norm": ("post_attention_layernorm.weight", "vec"),
    "gate_proj": ("mlp.gate_proj.weight", "in"),
    "up_proj": ("mlp.up_proj.weight", "in"),
    "down_proj": ("mlp.down_proj.weight", "in"),
}


def _present(config: ModelConfig) -> list[str]:
    names = ["attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "mlp_norm", "gate_proj", "up_proj",
             "down_proj"]
    if config.qkv_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    if config.qk_norm:
        names += ["q_norm", "k_norm"]
    if config.o_bias:
        names += ["o_bias"]
    return names


def expected_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{dotted name: shape}`` of every parameter of a ``Transformer(config)``."""
    c = config
    L, D, H, K, hd, F, V = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                            c.intermediate_size, c.vocab_size)
    per_layer = {
        "attn_norm": (D,), "q_proj": (D, H, hd), "k_proj": (D, K, hd), "v_proj": (D, K, hd),
        "q_bias": (H, hd), "k_bias": (K, hd), "v_bias": (K, hd), "q_norm": (hd,), "k_norm": (hd,),
        "o_proj": (H, hd, D), "o_bias": (D,), "mlp_norm": (D,), "gate_proj": (D, F),
        "up_proj": (D, F), "down_proj": (F, D),
    }
    shapes = {"embed": (V, D), "final_norm": (D,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (V, D)
    for name in _present(c):
        shapes[f"layers.{name}"] = (L, *per_layer[name])
    return shapes


def _from_hf_layer(config: ModelConfig, kind: str, w: np.ndarray) -> np.ndarray:
    c = config
    if kind == "vec":
        return w
    if kind == "q":  # [H*hd, D] -> [D, H, hd]
        return w.T.reshape(c.hidden_size, c.num_heads, c.head_dim)
    if kind == "kv":
        return w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim)
    if kind == "qb":
        return w.reshape(c.num_heads, c.head_dim)
    if kind == "kvb":
        return w.reshape(c.num_kv_heads, c.head_dim)
    if kind == "o":  # [D, H*hd] -> [H, hd, D]
        return w.T.reshape(c.num_heads, c.head_dim, c.hidden_size)
    if kind == "in":  # [out, in] -> [in, out]
        return w.T
    raise AssertionError(kind)


def _to_hf_layer(config: ModelConfig, kind: str, w: np.ndarray) -> np.ndarray:
    c = config
    if kind == "vec":
        return w
    if kind in ("q", "kv"):  # [D, N, hd] -> [N*hd, D]
        return w.reshape(c.hidden_size, -1).T
    if kind in ("qb", "kvb"):
        return w.reshape(-1)
    if kind == "o":  # [H, hd, D] -> [D, H*hd]
        return w.reshape(-1, c.hidden_size).T
    if kind == "in":
        return w.T
    raise AssertionError(kind)


def hf_to_params(
    config: ModelConfig, get: Callable[[str], np.ndarray], has: Callable[[str], bool], dtype=None
) -> dict[str, np.ndarray]:
    """Stacked model params from HF-named tensors (``get(name)`` returns ``[out, in]`` arrays).

    Raises KeyError naming the first missing tensor.
    """
    dtype = np.dtype(config.dtype if dtype is None else dtype)

    def fetch(name: str) -> np.ndarray:
        if not has(name):
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        return np.asarray(get(name))

    params = {
        "embed": fetch("model.embed_tokens.weight").astype(dtype),
        "final_norm": fetch("model.norm.weight").astype(dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = fetch("lm_head.weight").astype(dtype)
    for name in _present(config):
        suffix, kind = _LAYER_TENSORS[name]
        params[f"layers.{name}"] = np.stack([
            _from_hf_layer(config, kind, fetch(f"model.layers.{i}.{suffix}")).astype(dtype)
            for i in range(config.num_layers)
        ])
    return params


def model_params(model: Transformer) -> dict[str, jax.Array]:
    """``{dotted name: array}`` of a model's parameters (the names of ``expected_param_shapes``)."""
    out = {"embed": model.embed[...], "final_norm": model.final_norm[...]}
    if model.lm_head is not None:
        out["lm_head"] = model.lm_head[...]
    for name, arr in model.layers.stacked().items():
        out[f"layers.{name}"] = arr
    return out


def params_to_hf(model: Transformer) -> dict[str, np.ndarray]:
    """HF-named numpy tensors (``[out, in]`` weights, param dtype) of a model, contiguous."""
    c = model.config
    flat = {k: np.asarray(jax.device_get(v)) for k, v in model_params(model).items()}
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["final_norm"]}
    if "lm_head" in flat:
        out["lm_head.weight"] = flat["lm_head"]
    for name in _present(c):
        suffix, kind = _LAYER_TENSORS[name]
        stacked = flat[f"layers.{name}"]
        for i in range(c.num_layers):
            out[f"model.layers.{i}.{suffix}"] = _to_hf_layer(c, kind, stacked[i])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def build_model(config: ModelConfig, params: Mapping[str, np.ndarray], **kwargs) -> Transformer:
    """A ``Transformer(config)`` holding exactly ``params`` (cast to the param dtype).

    Checks that every expected parameter is given with the right shape and nothing else.
    """
    expected = expected_param_shapes(config)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"parameter names differ from the config: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"parameter {name!r} has shape {tuple(params[name].shape)}, expected {shape}")
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), **kwargs))
    for name, arr in params.items():
        *path, leaf = name.split(".")
        owner = model
        for part in path:
            owner = getattr(owner, part)
        getattr(owner, leaf).value = jnp.asarray(arr, dtype=config.dtype)
    return model
