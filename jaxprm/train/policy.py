"""The policy as the trainer holds it: an NNX model split into a static graph and a pure params dict.

``params`` (a nested dict of arrays) is what the train step updates, orbax checkpoints, and the
sampler receives; ``module(params)`` rebuilds an ``nnx.Module`` for saving or serving.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Policy", "learner_apply", "REMAT_MODES"]

#: ``ppo.remat``: ``none``; ``block`` (each decoder layer recomputed in the backward pass: the
#: model's ``remat`` flag, set when the policy is built); ``full`` (the whole forward recomputed)
REMAT_MODES = ("none", "block", "full")


class Policy:
    """A split NNX model. ``apply_fn(params, tokens[B, T], positions[B, T]) -> logits[B, T, V]``
    (tree-packed rows add ``subtree_end`` or ``query_blocks``/``key_blocks``, see ``Transformer``)."""

    def __init__(self, model: nnx.Module, tokenizer: Any = None) -> None:
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self._params = params.to_pure_dict()
        self.tokenizer = tokenizer
        self.config = getattr(model, "config", None)
        self._learner_fns: dict[tuple[str, str], Any] = {}

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

    def learner_apply_fn(self, *, remat: str = "none", compute_dtype: str = "float32"):
        """:func:`learner_apply` over :meth:`apply_fn`, made once per setting (jitted programs are
        cached per apply function)."""
        key = (remat, compute_dtype)
        if key not in self._learner_fns:
            self._learner_fns[key] = learner_apply(self.apply_fn, remat=remat, compute_dtype=compute_dtype)
        return self._learner_fns[key]

    def module(self, params: dict | None = None) -> nnx.Module:
        """An ``nnx.Module`` carrying ``params`` (default: the current ones)."""
        p = self._params if params is None else params
        return nnx.merge(self.graphdef, nnx.State(jax.tree.map(jax.numpy.asarray, p)), self.rest)


def learner_apply(apply_fn, *, remat: str = "none", compute_dtype: str = "float32"):
    """The learner's forward: ``apply_fn`` with the floating params cast to ``compute_dtype`` on the
    way in (``bfloat16``: bf16 matmuls, while the master params, their gradients and the optimizer
    state stay in their own dtype; the logits stay float32, ``Transformer.logits``), and with
    ``remat="full"`` the whole forward under ``jax.checkpoint`` (recomputed in the backward pass;
    ``block`` is the model's per-layer flag, see :data:`REMAT_MODES`). Returns ``apply_fn`` itself
    when there is nothing to change."""
    if remat not in REMAT_MODES:
        raise ValueError(f"remat={remat!r}; allowed: {REMAT_MODES}")
    if compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"compute_dtype={compute_dtype!r}; allowed: ('float32', 'bfloat16')")
    if compute_dtype == "float32" and remat != "full":
        return apply_fn
    dtype = jnp.bfloat16 if compute_dtype == "bfloat16" else None

    def forward(params, tokens, positions, **attention):
        if dtype is not None:
            params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        return apply_fn(params, tokens, positions, **attention)

    return jax.checkpoint(forward) if remat == "full" else forward
