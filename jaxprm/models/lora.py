"""LoRA adapters for the stacked decoder, built from Flax NNX ``nnx.LoRA`` layers.

A target projection ``t`` (``q_proj`` ... ``down_proj``) whose stacked weight is ``W_t [L, in..., out...]``
(``x @ W`` convention, see ``transformer``) gets one ``nnx.LoRA(in, r, out)`` per layer, made under
``nnx.vmap`` so its ``nnx.LoRAParam`` arrays are stacked like the weights: ``lora_a [L, in, r]``
(variance-scaling init) and ``lora_b [L, r, out]`` (zeros: a fresh adapter changes nothing), with
``in``/``out`` the flattened feature sizes. In the forward, the layer adds

    delta_t(x) = (alpha / r) * nnx.LoRA(x) = (alpha / r) * (x @ lora_a) @ lora_b

to the projection's output, so the frozen ``W_t`` gets no gradient and the backward costs rank ``r``
per target. :func:`merged_params` folds the adapters into the weights,
``W_t + (alpha / r) * lora_a @ lora_b`` (reshaped like ``W_t``): what a server serves and an export
writes. Adapters are float32 whatever the model's dtype; their output is cast to the projection's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprm.fields import require
from jaxprm.models.config import ModelConfig

__all__ = ["LoraConfig", "LORA_TARGETS", "add_lora", "lora_delta", "merged_params", "target_features",
           "adapter_count"]

#: The projections an adapter can target (all seven linear maps of a decoder layer).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """``model.lora``: ``rank`` 0 trains every weight (full fine-tuning); ``rank > 0`` freezes them and
    trains rank-``rank`` adapters on ``targets`` (see :data:`LORA_TARGETS`), scaled by ``alpha / rank``.
    Only the adapters are in the optimizer state and the checkpoints; servers and exports get the
    merged weights."""

    rank: int = 0
    alpha: float = 32.0
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        require(isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 0, "rank",
                f"must be an integer >= 0 (0: no adapters), got {self.rank!r}", type(self))
        require(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0, "alpha",
                f"must be > 0, got {self.alpha!r}", type(self))
        targets = list(self.targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        require(not unknown and targets and len(set(targets)) == len(targets), "targets",
                f"must be distinct names from {list(LORA_TARGETS)}, got {targets!r}", type(self))

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on every adapter's output."""
        return float(self.alpha) / self.rank


def target_features(config: ModelConfig, target: str) -> tuple[int, int]:
    """``(in, out)`` flattened feature sizes of a target projection."""
    c = config
    D, F, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D), "gate_proj": (D, F),
            "up_proj": (D, F), "down_proj": (F, D)}[target]


@functools.lru_cache(maxsize=None)
def _lora_graphdef(in_features: int, rank: int, out_features: int):
    """The static structure of one ``nnx.LoRA(in, rank, out)`` (merged with a layer's arrays in the scan)."""
    return nnx.split(nnx.eval_shape(lambda: nnx.LoRA(in_features, rank, out_features, rngs=nnx.Rngs(0))))[0]


def lora_delta(x: jax.Array, adapter: Mapping[str, jax.Array], scale: float) -> jax.Array:
    """``scale * nnx.LoRA(x)`` for one layer: ``x [..., in]``, ``adapter`` ``{"lora_a": [in, r],
    "lora_b": [r, out]}`` -> ``[..., out]`` (float32 when the adapters are; the caller casts)."""
    a, b = adapter["lora_a"], adapter["lora_b"]
    layer = nnx.merge(_lora_graphdef(a.shape[0], a.shape[1], b.shape[1]), {"lora_a": a, "lora_b": b})
    return scale * layer(x)


def _stacked_lora(num_layers: int, in_features: int, rank: int, out_features: int, key: jax.Array) -> nnx.LoRA:
    """``num_layers`` fresh ``nnx.LoRA`` layers stacked on a leading axis (``nnx.vmap``)."""
    make = nnx.vmap(lambda k: nnx.LoRA(in_features, rank, out_features, rngs=nnx.Rngs(params=k)))
    return make(jax.random.split(key, num_layers))


def add_lora(model, lora: LoraConfig, key: jax.Array):
    """Attach fresh adapters for ``lora.targets`` to a ``Transformer`` in place (``model.layers.lora``,
    ``nnx.LoRAParam`` variables, and ``model.layers.lora_scale``) and return it."""
    if not lora.enabled:
        raise ValueError("add_lora needs lora.rank > 0")
    c = model.config
    adapters = {}
    for i, target in enumerate(lora.targets):
        n_in, n_out = target_features(c, target)
        adapters[target] = _stacked_lora(c.num_layers, n_in, lora.rank, n_out, jax.random.fold_in(key, i))
    model.layers.lora = nnx.data(nnx.Dict(adapters))
    model.layers.lora_scale = lora.scale
    return model


def merged_params(base: Mapping[str, Any], adapters: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """The plain model's pure params dict with the adapters folded in.

    ``base``: the frozen params (``{"embed": ..., "layers": {"q_proj": [L, ...], ...}, ...}``);
    ``adapters``: ``{"layers": {"lora": {target: {"lora_a": [L, in, r], "lora_b": [L, r, out]}}}}``.
    Each target becomes ``W + scale * einsum("lir,lro->lio", lora_a, lora_b)`` reshaped like ``W``
    (computed in float32, cast to ``W``'s dtype); every other array is ``base``'s own."""
    layers = dict(base["layers"])
    for target, ab in adapters["layers"]["lora"].items():
        w = layers[target]
        delta = jnp.einsum("lir,lro->lio", ab["lora_a"].astype(jnp.float32), ab["lora_b"].astype(jnp.float32))
        layers[target] = (w.astype(jnp.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)
    return {**base, "layers": layers}


def adapter_count(adapters: Any) -> int:
    """Number of trainable adapter values."""
    return int(sum(x.size for x in jax.tree.leaves(adapters)))
