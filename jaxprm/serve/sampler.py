"""The engine's weight holder: a model's parameters, their version and the request limits.

A :class:`Sampler` holds the served weights (swapped in place by ``update_params``, read together
with their version by ``snapshot``), the model's graph, the shape buckets the engine compiles for
and the checks a request must pass (``check_request``). ``jaxprm.serve.engine`` generates with it
(continuous batching); ``jaxprm.serve.static_sampler`` is the static-batching reference path over
the same weights. A trainer may hold one directly (in-process rollouts, weight swaps).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.serve.sampling import (DEFAULT_BATCH_BUCKETS, DEFAULT_NEW_TOKEN_BUCKETS, DEFAULT_PROMPT_BUCKETS,
                                   MAX_STOP_TOKEN_IDS, SamplingParams, buckets_up_to)

__all__ = ["Sampler"]


class Sampler:
    """Holds a model's weights (in place, versioned) and what a request to them may ask.

    Args:
      model: a ``jaxprm.models.Transformer`` (an ``nnx.Module`` with
        ``logits, cache = model(tokens, positions, cache)`` and a ``config``).
      eos_token_ids: ids that end a row unless ``ignore_eos`` (e.g. ``tokenizer.eos_token_ids``).
      pad_token_id: id used for prompt padding (never attended; any valid id works).
      max_batch: largest compiled batch.
      batch_buckets / prompt_buckets / new_token_buckets: the static shapes (ascending); the longest
        prompt and ``max_new_tokens`` a request may have are the largest prompt / new-token buckets.
      max_context: longest ``prompt + max_new_tokens``; default ``config.max_position_embeddings``.
      cache_dtype: KV-cache dtype; default the model's parameter dtype (via ``KVCache.init``).
      dtype: serve the weights in this dtype (e.g. ``"bfloat16"``; default: the model's). Logits,
        sampling and log-probs stay float32; the KV cache defaults to this dtype; weight updates are
        cast to it.
      weight_version: the version of ``model``'s weights (what a resumed trainer's weights are).

    Thread-safety: ``update_params`` may be called while other threads generate; ``snapshot`` gives
    a consistent ``(params, version)`` pair.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        eos_token_ids: Sequence[int] = (),
        pad_token_id: int = 0,
        max_batch: int = 64,
        batch_buckets: Sequence[int] | None = None,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        new_token_buckets: Sequence[int] = DEFAULT_NEW_TOKEN_BUCKETS,
        max_context: int | None = None,
        cache_dtype: Any = None,
        dtype: Any = None,
        weight_version: int = 0,
    ):
        self.config = model.config
        self.vocab_size = int(self.config.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        if batch_buckets is None:
            batch_buckets = buckets_up_to(DEFAULT_BATCH_BUCKETS, max_batch)
        self.batch_buckets = tuple(sorted(int(b) for b in batch_buckets))
        self.max_batch = self.batch_buckets[-1]
        self.max_context = int(max_context or self.config.max_position_embeddings)
        self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
        self.new_token_buckets = tuple(sorted(int(b) for b in new_token_buckets))
        self._graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if dtype is not None:
            dtype = jnp.dtype(dtype)
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"dtype must be a floating dtype, got {dtype}")
            params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
            cache_dtype = dtype if cache_dtype is None else cache_dtype
        self.dtype = dtype
        self.cache_dtype = cache_dtype
        self._params = params
        self._rest = rest
        self._version = int(weight_version)
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------
    # weights
    @property
    def weight_version(self) -> int:
        """Counter bumped by every ``update_params`` (0 for the initial weights)."""
        return self._version

    @property
    def params(self) -> nnx.State:
        """The current parameter state (``nnx.Param`` variables)."""
        return self._params

    def snapshot(self) -> tuple[nnx.State, int]:
        """The current ``(params, weight_version)``, read together (a consistent pair)."""
        with self._lock:
            return self._params, self._version

    @property
    def graphdef(self):
        """The model's ``nnx.GraphDef`` (``nnx.merge(graphdef, params, rest)`` rebuilds it)."""
        return self._graphdef

    @property
    def rest(self) -> nnx.State:
        """The model's non-parameter state (constant across weight updates)."""
        return self._rest

    def update_params(self, new: nnx.Module | nnx.State | dict, *, version: int | None = None) -> int:
        """Swap in new weights without recompiling; returns the new weight version.

        ``new`` is a model of the same architecture, its ``nnx.state(model, nnx.Param)``, or the
        equivalent pure dict (``nnx.to_pure_dict``). Leaves are cast to the current dtypes; a
        different tree structure or shape raises ``ValueError`` (it would need a new program).
        ``version`` sets the counter explicitly (default: current + 1).
        """
        if isinstance(new, nnx.Module):
            state = nnx.state(new, nnx.Param)
        elif isinstance(new, nnx.State):
            state = new
        elif isinstance(new, dict):
            state = jax.tree.map(lambda x: x, self._params)
            try:
                nnx.replace_by_pure_dict(state, new)
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"update_params: the dict does not match the model's parameters: {exc!r}") from exc
        else:
            raise TypeError(f"update_params expects an nnx.Module, nnx.State or dict, got {type(new).__name__}")
        old_leaves, old_def = jax.tree.flatten(self._params)
        new_leaves, new_def = jax.tree.flatten(state)
        if old_def != new_def:
            raise ValueError("update_params: parameter tree structure differs from the sampler's model")
        for i, (a, b) in enumerate(zip(old_leaves, new_leaves)):
            if tuple(a.shape) != tuple(np.shape(b)):
                raise ValueError(f"update_params: leaf {i} has shape {np.shape(b)}, expected {a.shape}")
        cast = [jnp.asarray(b, dtype=a.dtype) for a, b in zip(old_leaves, new_leaves)]
        cast = [jax.device_put(c, a.sharding) for a, c in zip(old_leaves, cast)]
        with self._lock:
            self._params = jax.tree.unflatten(old_def, cast)
            self._version = self._version + 1 if version is None else int(version)
            return self._version

    # ----------------------------------------------------------------------------------------
    # requests
    def check_request(self, prompt: Sequence[int], sp: SamplingParams, *, where: str = "prompt") -> None:
        """Raise ``ValueError`` if a row cannot be served (empty, bad ids, too long, too many stops)."""
        if len(prompt) == 0:
            raise ValueError(f"{where} is empty")
        bad = [t for t in prompt if not (0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"{where} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        total = len(prompt) + sp.max_new_tokens
        if total > self.max_context:
            raise ValueError(
                f"{where}: prompt length {len(prompt)} + max_new_tokens {sp.max_new_tokens} = {total} "
                f"exceeds the context length {self.max_context}"
            )
        if len(prompt) > self.prompt_buckets[-1]:
            raise ValueError(f"{where}: prompt length {len(prompt)} exceeds the largest bucket {self.prompt_buckets[-1]}")
        if sp.max_new_tokens > self.new_token_buckets[-1]:
            raise ValueError(f"{where}: max_new_tokens {sp.max_new_tokens} exceeds {self.new_token_buckets[-1]}")
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"{where}: at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(stops)}")

