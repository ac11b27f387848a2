"""Model configuration: one frozen dataclass for the Llama, Qwen2 and Qwen3 decoder families.

``ModelConfig.from_hf`` reads a Hugging Face ``config.json`` dict (both the legacy ``rope_theta`` /
``rope_scaling`` keys and the newer ``rope_parameters`` dict); ``to_hf`` writes one that
``transformers`` (and servers built on it, such as vLLM / SGLang) load as ``LlamaForCausalLM``,
``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["ModelConfig", "FAMILIES", "PARAM_DTYPES", "ROPE_TYPES"]

FAMILIES = ("llama", "qwen2", "qwen3")
PARAM_DTYPES = ("float32", "bfloat16")
# "default" means plain RoPE; the others follow transformers' modeling_rope_utils.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


def _normalize_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Copy a rope-scaling dict with ``rope_type`` set (legacy ``type`` accepted); None for plain RoPE."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling must be a dict or None, got {type(rope_scaling).__name__}")
    out = {k: copy.deepcopy(v) for k, v in rope_scaling.items() if k not in ("type", "rope_theta")}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type={rope_type!r} is not supported; allowed: {ROPE_TYPES}")
    if rope_type == "default":
        return None
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in out]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks keys {missing} (got {sorted(out)})")
    out["rope_type"] = rope_type
    return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Attributes:
      family: ``"llama"`` | ``"qwen2"`` | ``"qwen3"`` (the Hugging Face architecture written on save).
      vocab_size, hidden_size, intermediate_size, num_layers: sizes ``V, D, F, L``.
      num_heads, num_kv_heads, head_dim: query heads ``H``, key/value heads ``K`` (``H % K == 0``,
        grouped-query attention) and the per-head width ``hd`` (even, for RoPE).
      rope_theta: RoPE base. rope_scaling: None, or a dict with ``rope_type`` in
        ``("linear", "llama3", "yarn")`` and that type's keys, as in transformers.
      rms_norm_eps: RMSNorm epsilon. tie_embeddings: the LM head reuses the embedding matrix.
      qkv_bias: biases on the q/k/v projections (always on for qwen2). o_bias: bias on the output
        projection (llama/qwen3 ``attention_bias``). qk_norm: per-head RMSNorm on q and k before
        RoPE (qwen3).
      max_position_embeddings: the context length the model was trained for (metadata: the KV
        cache size is chosen by the caller).
      param_dtype: ``"float32"`` | ``"bfloat16"``; logits are always float32.
      bos_token_id, eos_token_id, pad_token_id: written to ``config.json`` (optional).
      initializer_range: standard deviation of the random initial weights (Hugging Face's name).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    param_dtype: str = "float32"
    o_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}; allowed: {FAMILIES}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}; allowed: {PARAM_DTYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range={self.initializer_range!r} must be > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.family == "qwen2" and self.o_bias:
            raise ValueError("o_bias=True is not representable for family='qwen2' (o_proj has no bias)")
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))
        if isinstance(self.eos_token_id, (list, tuple)):
            object.__setattr__(self, "eos_token_id", [int(i) for i in self.eos_token_id])

    # A dict field makes the generated hash fail; hash a canonical JSON form instead, so the config
    # can sit in static (graph) data of jitted NNX modules.
    def __hash__(self) -> int:
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def dtype(self):
        """The ``jnp`` dtype of the parameters."""
        import jax.numpy as jnp

        return jnp.bfloat16 if self.param_dtype == "bfloat16" else jnp.float32

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (``H // K``)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face config.json

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (model_type llama / qwen2 / qwen3).

        Raises ValueError naming the key for unsupported features (sliding windows, MLP bias,
        activations other than SiLU, rope types other than default / linear / llama3 / yarn).
        """
        d = dict(config)
        model_type = d.get("model_type")
        if model_type is None:
            archs = d.get("architectures") or []
            by_arch = {v: k for k, v in _HF_ARCH.items()}
            model_type = next((by_arch[a] for a in archs if a in by_arch), None)
        if model_type not in FAMILIES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported; allowed: {FAMILIES}")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={act!r} is not supported; allowed: 'silu'")
        if d.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported")
        if d.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported (full attention only)")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json partial_rotary_factor != 1 is not supported")

        rope_params = d.get("rope_parameters")
        if isinstance(rope_params, Mapping) and "rope_theta" not in rope_params and any(
            isinstance(v, Mapping) for v in rope_params.values()
        ):
            raise ValueError("config.json rope_parameters per layer type are not supported")
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(rope_params, Mapping):
            rope_theta = rope_params.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and isinstance(rope_params, Mapping):
            rope_scaling = rope_params
        if isinstance(rope_scaling, Mapping) and rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope partial_rotary_factor != 1 is not supported")
        if isinstance(rope_scaling, Mapping):
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "partial_rotary_factor"}

        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // num_heads
        attention_bias = bool(d.get("attention_bias", False))
        dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            family=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            param_dtype="bfloat16" if dtype == "bfloat16" else "float32",
            o_bias=attention_bias if model_type != "qwen2" else False,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            initializer_range=float(d.get("initializer_range", 0.02)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict for this config.

        RoPE is written with the legacy ``rope_theta`` / ``rope_scaling`` keys, which both old and
        new ``transformers`` releases read.
        """
        if self.family == "qwen3" and not self.qk_norm or self.family != "qwen3" and self.qk_norm:
            raise ValueError(f"qk_norm={self.qk_norm} does not match family={self.family!r} (qwen3 only)")
        if self.family == "qwen2" and not self.qkv_bias:
            raise ValueError("family='qwen2' always has q/k/v biases; qkv_bias=False is not representable")
        if self.family != "qwen2" and self.qkv_bias != self.o_bias:
            raise ValueError(
                f"family={self.family!r} has one attention_bias flag for q/k/v/o; "
                f"qkv_bias={self.qkv_bias} o_bias={self.o_bias} is not representable"
            )
        out: dict[str, Any] = {
            "architectures": [_HF_ARCH[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": copy.deepcopy(self.rope_scaling),
            "tie_word_embeddings": self.tie_embeddings,
            "torch_dtype": self.param_dtype,
            "use_cache": True,
            "attention_dropout": 0.0,
            "initializer_range": self.initializer_range,
        }
        if self.family != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            out["mlp_bias"] = False
        else:
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["max_window_layers"] = self.num_layers
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, key) is not None:
                out[key] = copy.deepcopy(getattr(self, key))
        return out
