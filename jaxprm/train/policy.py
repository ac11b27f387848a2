"""The policy as the trainer holds it: an NNX model split into a static graph and a pure params dict.

``params`` (a nested dict of arrays) is what the train step updates, orbax checkpoints, and the
sampler receives; ``module(params)`` rebuilds an ``nnx.Module`` for saving or serving.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprm.models import Transformer, merged_params

__all__ = ["Policy", "learner_apply", "REMAT_MODES"]

#: ``ppo.remat``: ``none``; ``block`` (each decoder layer recomputed in the backward pass: the
#: model's ``remat`` flag, set when the policy is built); ``full`` (the whole forward recomputed)
REMAT_MODES = ("none", "block", "full")


class Policy:
    """A split NNX model. ``apply_fn(params, tokens[B, T], positions[B, T]) -> logits[B, T, V]``
    (tree-packed rows add ``subtree_end`` or ``query_blocks``/``key_blocks``, see ``Transformer``).

    A model with LoRA adapters (``jaxprm.models.add_lora``) splits three ways: ``params`` are the
    adapters only (``nnx.LoRAParam``: what the learner trains, the optimizer holds and checkpoints
    save), ``base`` the frozen weights (never differentiated; jitted code passes them as an argument,
    :meth:`with_frozen`, e.g. ``TrainStep(frozen=policy.base)``), and
    :meth:`serving_params` / :meth:`module` give the merged plain model that servers and exports get."""

    def __init__(self, model: nnx.Module, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.config = getattr(model, "config", None)
        self._learner_fns: dict[tuple[str, str], Any] = {}
        layers = getattr(model, "layers", None)
        self.lora_scale = float(getattr(layers, "lora_scale", 0.0)) if getattr(layers, "lora", None) is not None else 0.0
        if self.lora_scale:
            self.graphdef, adapters, base, self.rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
            self._params, self.base = adapters.to_pure_dict(), base.to_pure_dict()
            plain = nnx.eval_shape(lambda: Transformer(self.config, rngs=nnx.Rngs(0), remat=model.remat))
            self._plain_graphdef, _, self._plain_rest = nnx.split(plain, nnx.Param, ...)
        else:
            self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
            self._params, self.base = params.to_pure_dict(), None
            self._plain_graphdef, self._plain_rest = self.graphdef, self.rest

    @property
    def params(self) -> dict:
        return self._params

    @params.setter
    def params(self, value: dict) -> None:
        self._params = value

    @property
    def is_lora(self) -> bool:
        return self.base is not None

    def _merge(self, params: dict, base: dict | None) -> nnx.Module:
        if base is None:
            return nnx.merge(self.graphdef, nnx.State(params), self.rest)
        return nnx.merge(self.graphdef, nnx.State(params), nnx.State(base), self.rest)

    def apply_fn(self, params: Any, tokens: jax.Array, positions: jax.Array, **attention: jax.Array) -> jax.Array:
        """Logits of the model with ``params``. With LoRA, ``params`` are the adapters (the frozen
        weights then come from :attr:`base`) or a pair ``(adapters, frozen weights)``: inside a
        jitted function, pass the pair (:meth:`with_frozen`), so that the frozen weights are an
        argument of the program, not constants compiled into it."""
        base = None
        if self.base is not None:
            params, base = params if isinstance(params, tuple) else (params, self.base)
        out = self._merge(params, base)(tokens, positions, **attention)
        return out[0] if isinstance(out, tuple) else out

    def with_frozen(self, params: Any) -> Any:
        """What :meth:`apply_fn` takes for ``params`` inside a jitted function: ``params`` itself, or with
        LoRA the pair ``(adapters, frozen weights)``."""
        return params if self.base is None else (params, self.base)

    def learner_apply_fn(self, *, remat: str = "none", compute_dtype: str = "float32"):
        """:func:`learner_apply` over :meth:`apply_fn`, made once per setting (jitted programs are
        cached per apply function)."""
        key = (remat, compute_dtype)
        if key not in self._learner_fns:
            self._learner_fns[key] = learner_apply(self.apply_fn, remat=remat, compute_dtype=compute_dtype)
        return self._learner_fns[key]

    def serving_params(self, params: dict | None = None) -> dict:
        """The plain model's params for ``params`` (default: the current ones): themselves, or with
        LoRA the frozen weights with the adapters merged in (``jaxprm.models.merged_params``)."""
        p = self._params if params is None else params
        return p if self.base is None else merged_params(self.base, p, self.lora_scale)

    def module(self, params: dict | None = None) -> nnx.Module:
        """An ``nnx.Module`` carrying ``params`` (default: the current ones); with LoRA the merged plain model."""
        merged = jax.tree.map(jnp.asarray, self.serving_params(params))
        return nnx.merge(self._plain_graphdef, nnx.State(merged), self._plain_rest)


def _cast_floating(tree: Any, dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


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
            params = _cast_floating(params, dtype)
        return apply_fn(params, tokens, positions, **attention)

    return jax.checkpoint(forward) if remat == "full" else forward
