"""The engine's compiled programs over the paged KV pool: chunked prefill and multi-step decode.

Both programs take the pool as a donated argument and return it updated in place.

* ``prefill(tokens [R, C], positions [R, C], tables [R, nb])`` writes the keys and values of ``R``
  rows' next prompt chunks (``C`` tokens each, padding at position -1). It produces no logits: a
  sequence's last prompt token is fed by its first decode step, so every sampled token, the first
  included, comes from the decode program and the one sampling function (``sample_next``).
* ``decode(..., steps=k)`` runs ``k`` decode steps for ``B`` rows: feed each active row's current
  token at its position (writing its KV), sample the next token with the row's options, record the
  token, its raw and sampling log-probs (and top-n alternatives), and stop a row at a stop token
  or when its remaining budget is spent. Inactive rows feed position -1 (nothing is written).

Static shapes: ``B`` is a batch bucket, ``nb = W / block_size`` with ``W`` a window bucket (the
longest position in the call, rounded up), ``R`` and ``C`` prefill row / chunk buckets. One program
exists per ``(B, W, k, top-n on/off, filtering on/off)`` and per ``(R, C, W)``; ``num_compilations``
counts the traces (one per compilation).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models.paged import PagedKVCache, paged_hidden_states
from jaxprm.serve.sampler import MAX_STOP_TOKEN_IDS, sample_next

__all__ = ["ModelRunner", "DECODE_INPUTS"]

#: Per-row decode inputs (host numpy arrays, first axis ``B``).
DECODE_INPUTS = ("token", "position", "active", "num_generated", "remaining", "temperature", "top_k", "top_p",
                 "key_data", "stop_ids", "tables")


class ModelRunner:
    """Owns the device pool and the jitted programs for one model (weights passed per call).

    Args:
      graphdef / rest: the model structure and non-parameter state (``Sampler.graphdef/rest``).
      config: the model config.
      num_blocks / block_size: the pool (block 0 is the null block).
      cache_dtype: pool dtype (default: the parameter dtype).
    """

    def __init__(self, graphdef, rest, config, *, num_blocks: int, block_size: int, cache_dtype: Any = None):
        self.graphdef = graphdef
        self.rest = rest
        self.config = config
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.pool = PagedKVCache.init(config, self.num_blocks, self.block_size, dtype=cache_dtype)
        self._num_traces = 0
        self._prefill = jax.jit(self._counted(self._prefill_fn), donate_argnums=(1,))
        self._decode = jax.jit(self._counted(self._decode_fn), static_argnames=("steps", "top_n", "filtering"),
                               donate_argnums=(1,))

    @property
    def num_compilations(self) -> int:
        """Programs traced (= compiled) so far."""
        return self._num_traces

    @property
    def pool_bytes(self) -> int:
        return int(self.pool.k.nbytes + self.pool.v.nbytes)

    def _counted(self, fn):
        def traced(*args, **kwargs):
            self._num_traces += 1
            return fn(*args, **kwargs)

        return traced

    def _model(self, params):
        return nnx.merge(self.graphdef, params, self.rest)

    # traced --------------------------------------------------------------------------------
    def _prefill_fn(self, params, pool, tokens, positions, tables):
        _, pool = paged_hidden_states(self._model(params), tokens, positions, pool, tables)
        return pool

    def _decode_fn(self, params, pool, inp, *, steps: int, top_n: int, filtering: bool):
        model = self._model(params)

        def one(carry, _):
            pool, tok, pos, active, n_gen, remaining = carry
            fed = jnp.where(active, pos, -1)
            hidden, pool = paged_hidden_states(model, tok[:, None], fed[:, None], pool, inp["tables"])
            s = sample_next(model.logits(hidden[:, 0]), inp["temperature"], inp["top_k"], inp["top_p"],
                            inp["key_data"], n_gen, top_n=top_n, filtering=filtering)
            valid = active
            step = valid.astype(jnp.int32)
            is_stop = jnp.any(s["token"][:, None] == inp["stop_ids"], axis=-1)
            n_gen, remaining = n_gen + step, remaining - step
            active = active & ~is_stop & (remaining > 0)
            tok = jnp.where(valid, s["token"], tok)
            return (pool, tok, pos + step, active, n_gen, remaining), dict(s, valid=valid)

        init = (pool, inp["token"], inp["position"], inp["active"], inp["num_generated"], inp["remaining"])
        (pool, *_), outs = jax.lax.scan(one, init, None, length=steps)
        return pool, outs

    # host calls --------------------------------------------------------------------------------
    def prefill(self, params, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray) -> None:
        """Write the KV of ``tokens [R, C]`` at ``positions`` (-1: padding) through ``tables [R, nb]``."""
        self.pool = self._prefill(params, self.pool, tokens, positions, tables)

    def decode(self, params, inputs: dict[str, np.ndarray], *, steps: int, top_n: int, filtering: bool
               ) -> dict[str, np.ndarray]:
        """Run ``steps`` decode steps; returns host arrays ``[steps, B]`` (``token``, ``logprob``,
        ``sampling_logprob``, ``valid``; with ``top_n``: ``top_ids / top_raw / top_proc [steps, B, n]``)."""
        self.pool, outs = self._decode(params, self.pool, inputs, steps=steps, top_n=top_n, filtering=filtering)
        return jax.device_get(outs)

    # ahead-of-time compilation -----------------------------------------------------------------
    def compile_prefill(self, params, rows: int, chunk: int, window: int) -> None:
        """Compile the prefill program for ``[rows, chunk]`` tokens over ``window`` positions."""
        nb = window // self.block_size
        i32 = jax.ShapeDtypeStruct
        self._prefill.lower(params, self.pool, i32((rows, chunk), jnp.int32), i32((rows, chunk), jnp.int32),
                            i32((rows, nb), jnp.int32)).compile()

    def compile_decode(self, params, batch: int, window: int, *, steps: int, top_n: int, filtering: bool) -> None:
        """Compile the decode program for ``batch`` rows over ``window`` positions."""
        self._decode.lower(params, self.pool, decode_input_shapes(batch, window // self.block_size),
                           steps=steps, top_n=top_n, filtering=filtering).compile()


def decode_input_shapes(batch: int, nb: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the decode inputs for ``batch`` rows and ``nb`` table entries."""
    S = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    return dict(token=S((batch,), i32), position=S((batch,), i32), active=S((batch,), jnp.bool_),
                num_generated=S((batch,), i32), remaining=S((batch,), i32), temperature=S((batch,), f32),
                top_k=S((batch,), i32), top_p=S((batch,), f32), key_data=S((batch, 2), jnp.uint32),
                stop_ids=S((batch, MAX_STOP_TOKEN_IDS), i32), tables=S((batch, nb), i32))

