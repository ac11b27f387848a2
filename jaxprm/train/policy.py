"""The policy as the trainer holds it: an NNX model split into a static graph and a pure params dict.

``params`` (a nested dict of arrays) is what the train step updates, orbax checkpoints, and the
sampler receives; ``module(params)`` rebuilds an ``nnx.Module`` for saving or serving.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

__all__ = ["Policy"]


class Policy:
    """A split NNX model. ``apply_fn(params, tokens[B, T], positions[B, T]) -> logits[B, T, V]``
    (tree-packed rows add ``subtree_end`` or ``query_blocks``/``key_blocks``, see ``Transformer``)."""

    def __init__(self, model: nnx.Module, tokenizer: Any = None) -> None:
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self._params = params.to_pure_dict()
        self.tokenizer = tokenizer
        self.config = getattr(model, "config", None)

    @property
    def params(self) -> dict:
        return self._params

    @params.setter
    def params(self, value: dict) -> None:
        self._params = value

    def apply_fn(self, params: dict, tokens: jax.Array, positions: jax.Array, **attention: jax.Array) -> jax.Array:
        model = nnx.merge(self.graphdef, nnx.State(params), self.rest)
        out = model(tokens, positions, **attention)
        return out[0] if isinstance(out, tuple) else out

    def module(self, params: dict | None = None) -> nnx.Module:
        """An ``nnx.Module`` carrying ``params`` (default: the current ones)."""
        p = self._params if params is None else params
        return nnx.merge(self.graphdef, nnx.State(jax.tree.map(jax.numpy.asarray, p)), self.rest)
