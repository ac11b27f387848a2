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

Decode programs run the layers unrolled over per-layer copies of the weights when the runner has
``unroll_layers`` (the default on CPU, where a scan over the stacked weights copies each layer's
weights before every matmul: about 40% of SmolLM2-135M's decode step at batch 1; see
``jaxprm.models.paged``); the copies are made once per weight version (``layer_weights``). Prefill
programs are compute-bound and keep the scan (they compile faster).

Shared prefixes (cascade decode): when groups of decode rows start with the same cached blocks (a
GRPO group's prompt; several groups at once), the engine may pass each group's prefix once as a row
of ``shared_table [S, ns]`` (``shared_len [S]``, each row's ``shared_group``), and a grouped row's
table then holds only the blocks after its prefix (``paged_hidden_states``): the batch gathers each
prefix's keys and values once instead of once per row.

Static shapes: ``B`` is a batch bucket, ``nb = W / block_size`` with ``W`` a window bucket (the
longest position in the call, rounded up; after a shared prefix, a bucket of the rows' own
positions), ``ns`` a window bucket of the longest shared prefix (0: none), ``S`` a bucket of the
number of prefixes (1, 2, 4, ...), ``R`` and ``C`` prefill row / chunk buckets. One program exists
per ``(B, W, ns, S, k, top-n on/off, filtering on/off)`` and per
``(R, C, W)`` (and per model
structure and pool shape: the programs are shared by every engine of the process);
``num_compilations()`` counts the traces (one per compilation). The executables come from
``jaxprm.serve.executables``: with JAX's persistent cache on, a program compiled by an earlier
process is loaded from disk without being traced or lowered (and is not counted).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models.paged import PagedKVCache, paged_hidden_states, unstack_layers
from jaxprm.serve.executables import abstract_signature, load_or_compile
from jaxprm.serve.sampling import MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, sample_next

__all__ = ["ModelRunner", "DECODE_INPUTS", "prefill_arrays", "decode_arrays", "decode_input_shapes",
           "num_compilations"]

#: Per-row decode inputs (host numpy arrays, first axis ``B``).
DECODE_INPUTS = ("token", "position", "active", "num_generated", "remaining", "temperature", "top_k", "top_p",
                 "key_data", "stop_ids", "tables")


_TRACES = [0]


def num_compilations() -> int:
    """Engine programs traced (= compiled) in this process, over all engines and shapes."""
    return _TRACES[0]


def _counted(fn):
    def traced(*args, **kwargs):
        _TRACES[0] += 1
        return fn(*args, **kwargs)

    # the program's name in JAX's compile logs and the trainer's compile report
    traced.__name__ = traced.__qualname__ = getattr(fn, "__name__", "traced")
    return traced


def _prefill_impl(graphdef, params, rest, pool, tokens, positions, tables):
    _, pool = paged_hidden_states(nnx.merge(graphdef, params, rest), tokens, positions, pool, tables)
    return pool


def _decode_impl(graphdef, params, rest, layers, pool, inp, *, steps: int, top_n: int, filtering: bool):
    model = nnx.merge(graphdef, params, rest)

    def one(carry, _):
        pool, tok, pos, active, n_gen, remaining = carry
        fed = jnp.where(active, pos, -1)
        hidden, pool = paged_hidden_states(model, tok[:, None], fed[:, None], pool, inp["tables"], layers=layers,
                                           shared_table=inp.get("shared_table"), shared_len=inp.get("shared_len"),
                                           shared_rows=inp.get("shared_rows"))
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


# One jitted function per program kind for the whole process: engines over models of the same
# structure (the graphdef is a static argument) and pools of the same shape share compilations.
_prefill = jax.jit(_counted(_prefill_impl), static_argnums=(0,), donate_argnums=(3,))
_decode = jax.jit(_counted(_decode_impl), static_argnums=(0,), static_argnames=("steps", "top_n", "filtering"),
                  donate_argnums=(4,))
_unstack = jax.jit(_counted(lambda graphdef, params, rest: unstack_layers(nnx.merge(graphdef, params, rest))),
                   static_argnums=(0,))


class ModelRunner:
    """Owns one engine's device pool and calls the compiled programs (weights passed per call).

    Args:
      graphdef / rest: the model structure and non-parameter state (``Sampler.graphdef/rest``).
      config: the model config.
      num_blocks / block_size: the pool (block 0 is the null block).
      cache_dtype: pool dtype (default: the parameter dtype).
      unroll_layers: decode with the layers unrolled over per-layer weight copies (module docstring;
        they take the layers' weight memory once more); ``None``: on the CPU backend.
    """

    def __init__(self, graphdef, rest, config, *, num_blocks: int, block_size: int, cache_dtype: Any = None,
                 unroll_layers: bool | None = None):
        self.graphdef = graphdef
        self.rest = rest
        self.config = config
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.pool = PagedKVCache.init(config, self.num_blocks, self.block_size, dtype=cache_dtype)
        # the pool's abstract value: programs are lowered from it, never from ``self.pool``, which a
        # decode call in another thread may have donated meanwhile (``jaxprm.serve.warmup``)
        self._pool_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                       self.pool)
        self._layers_lock = threading.Lock()
        self.unroll_layers = jax.default_backend() == "cpu" if unroll_layers is None else bool(unroll_layers)
        self._layers_of = None  # the params whose per-layer copies ``_layers`` holds
        self._layers = None
        self._signature_of = None  # the params whose abstract signature ``_params_signature`` is
        self._params_signature = ""
        self._programs: dict[tuple, jax.stages.Compiled] = {}
        # what the programs depend on besides shapes: the model's structure and config, the layout
        self._structure = (str(graphdef), repr(config), self.block_size, self.unroll_layers)

    def layer_weights(self, params):
        """The per-layer weight copies of ``params`` for unrolled decoding (made once per params
        object, i.e. per weight version), or ``None`` when the runner does not unroll."""
        if not self.unroll_layers:
            return None
        with self._layers_lock:  # the engine and a warm-up thread may both ask
            if params is not self._layers_of:
                self._layers, self._layers_of = None, None  # drop the old copies before making new ones
                program = self._program("_unstack", (), params,
                                        lambda: _unstack.lower(self.graphdef, params, self.rest))
                self._layers = program(params, self.rest)
                self._layers_of = params
            return self._layers

    @property
    def num_compilations(self) -> int:
        """Programs traced so far in this process (compilations are shared between engines)."""
        return num_compilations()

    @property
    def pool_bytes(self) -> int:
        return int(self.pool.k.nbytes + self.pool.v.nbytes)

    def prefill(self, params, tokens: np.ndarray, positions: np.ndarray, tables: np.ndarray) -> None:
        """Write the KV of ``tokens [R, C]`` at ``positions`` (-1: padding) through ``tables [R, nb]``."""
        program = self._prefill_program(params, *tokens.shape, tables.shape[1])
        self.pool = program(params, self.rest, self.pool, tokens, positions, tables)

    def decode(self, params, inputs: dict[str, np.ndarray], *, steps: int, top_n: int, filtering: bool
               ) -> dict[str, np.ndarray]:
        """Run ``steps`` decode steps; returns host arrays ``[steps, B]`` (``token``, ``logprob``,
        ``sampling_logprob``, ``valid``; with ``top_n``: ``top_ids / top_raw / top_proc [steps, B, n]``)."""
        B, nb = inputs["tables"].shape
        groups, ns = inputs["shared_table"].shape if "shared_table" in inputs else (0, 0)
        R = inputs["shared_rows"].shape[1] if ns else 0
        program = self._decode_program(params, B, nb, ns, groups, R, steps=steps, top_n=top_n, filtering=filtering)
        self.pool, outs = program(params, self.rest, self.layer_weights(params), self.pool, inputs)
        return jax.device_get(outs)

    # compiled programs -------------------------------------------------------------------------
    # Each program comes from ``jaxprm.serve.executables`` (memory, the disk store, or a compile),
    # looked up first in this runner's own table by its shape key and the params' signature.
    def _signature(self, params) -> str:
        if params is not self._signature_of:  # the per-layer copies follow from the params
            self._params_signature = abstract_signature(params)
            self._signature_of = params
        return self._params_signature

    def _program(self, kind: str, shape_key: tuple, params, lower) -> jax.stages.Compiled:
        hot = (kind, shape_key, self._signature(params))
        program = self._programs.get(hot)
        if program is None:
            fixed = (self._structure, hot[2], abstract_signature((self.rest, self._pool_spec)))
            program = load_or_compile(kind, (shape_key, fixed), lower)
            self._programs[hot] = program
        return program

    def _prefill_program(self, params, rows: int, chunk: int, nb: int) -> jax.stages.Compiled:
        S = jax.ShapeDtypeStruct
        return self._program(
            "_prefill_impl", (rows, chunk, nb), params,
            lambda: _prefill.lower(self.graphdef, params, self.rest, self._pool_spec, S((rows, chunk), jnp.int32),
                                   S((rows, chunk), jnp.int32), S((rows, nb), jnp.int32)))

    def _decode_program(self, params, batch: int, nb: int, ns: int = 0, groups: int = 1, group_rows: int = 0, *,
                        steps: int, top_n: int, filtering: bool) -> jax.stages.Compiled:
        group_rows = int(group_rows or batch)
        key = (batch, nb, int(steps), int(top_n), bool(filtering)) + ((int(ns), int(groups), group_rows) if ns else ())
        return self._program(
            "_decode_impl", key, params,
            lambda: _decode.lower(self.graphdef, params, self.rest, self.layer_weights(params), self._pool_spec,
                                  decode_input_shapes(batch, nb, ns, groups, group_rows), steps=steps, top_n=top_n,
                                  filtering=filtering))

    # ahead-of-time compilation -----------------------------------------------------------------
    def compile_prefill(self, params, rows: int, chunk: int, window: int) -> None:
        """Compile (or load) the prefill program for ``[rows, chunk]`` tokens over ``window`` positions."""
        self._prefill_program(params, rows, chunk, window // self.block_size)

    def compile_decode(self, params, batch: int, window: int, *, steps: int, top_n: int, filtering: bool,
                       shared_window: int = 0, shared_groups: int = 1, group_rows: int = 0) -> None:
        """Compile (or load) the decode program for ``batch`` rows over ``window`` positions of their
        own (after their group's prefix of up to ``shared_window`` positions, if not 0, with
        ``shared_groups`` prefix slots of ``group_rows`` rows each, default ``batch``)."""
        self._decode_program(params, batch, window // self.block_size, shared_window // self.block_size,
                             shared_groups, group_rows, steps=steps, top_n=top_n, filtering=filtering)


def decode_input_shapes(batch: int, nb: int, ns: int = 0, groups: int = 1, group_rows: int = 0
                        ) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of the decode inputs for ``batch`` rows and ``nb`` table entries (and, if
    ``ns``, ``groups`` shared prefixes of ``ns`` entries: ``shared_table [groups, ns]``,
    ``shared_len [groups]``, ``shared_rows [groups, group_rows]`` (default ``batch``))."""
    S = jax.ShapeDtypeStruct
    i32, f32 = jnp.int32, jnp.float32
    shared = dict(shared_table=S((groups, ns), i32), shared_len=S((groups,), i32),
                  shared_rows=S((groups, group_rows or batch), i32)) if ns else {}
    return shared | dict(token=S((batch,), i32), position=S((batch,), i32), active=S((batch,), jnp.bool_),
                num_generated=S((batch,), i32), remaining=S((batch,), i32), temperature=S((batch,), f32),
                top_k=S((batch,), i32), top_p=S((batch,), f32), key_data=S((batch, 2), jnp.uint32),
                stop_ids=S((batch, MAX_STOP_TOKEN_IDS), i32), tables=S((batch, nb), i32))



def prefill_arrays(rows, R: int, C: int, nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inputs of one prefill call: ``tokens, positions [R, C]`` (padding: token 0 at position -1)
    and ``tables [R, nb]`` for ``rows`` of ``(sequence, start, count)``."""
    tokens = np.zeros((R, C), np.int32)
    positions = np.full((R, C), -1, np.int32)
    tables = np.zeros((R, nb), np.int32)
    for i, (seq, start, n) in enumerate(rows):
        tokens[i, :n] = seq.tokens(start + n)[start:]
        positions[i, :n] = np.arange(start, start + n)
        blocks = seq.blocks[:nb]
        tables[i, : len(blocks)] = blocks
    return tokens, positions, tables


def decode_arrays(rows, B: int, nb: int, *, groups: Sequence[tuple[Sequence[int], int]] = (), S: int = 0,
                  R: int = 0, ns: int = 0, block_size: int | None = None) -> tuple[dict[str, np.ndarray], int, bool]:
    """Inputs of one decode call for these sequences padded to ``B`` rows (inactive padding), and
    the program variant: ``top_n`` (``MAX_TOP_LOGPROBS`` if any row wants alternatives, else 0)
    and ``filtering`` (any sampled row with top-k or top-p). With ``S`` (and ``ns``, ``R``):
    ``groups`` of ``(row indices, shared blocks)`` (at most ``S``, of at most ``R`` rows) whose
    members start with the same ``shared blocks`` pool blocks; those go once in
    ``shared_table [S, ns]`` (``shared_len`` their positions, ``shared_rows [S, R]`` the members,
    -1 padded) and a member's ``tables`` hold the blocks after them."""
    inp = dict(
        token=np.zeros((B,), np.int32), position=np.full((B,), -1, np.int32), active=np.zeros((B,), bool),
        num_generated=np.zeros((B,), np.int32), remaining=np.zeros((B,), np.int32),
        temperature=np.zeros((B,), np.float32),  # padding rows are greedy: a greedy batch draws nothing
        top_k=np.zeros((B,), np.int32), top_p=np.ones((B,), np.float32),
        key_data=np.zeros((B, 2), np.uint32), stop_ids=np.full((B, MAX_STOP_TOKEN_IDS), -1, np.int32),
        tables=np.zeros((B, nb), np.int32))
    skip = np.zeros((B,), np.int64)  # each row's blocks held in the shared table
    if S:
        if len(groups) > S or any(len(m) > R for m, _ in groups):
            raise ValueError(f"groups of {[len(m) for m, _ in groups]} rows for {S} slots of {R} rows")
        inp["shared_table"] = np.zeros((S, ns), np.int32)
        inp["shared_len"] = np.zeros((S,), np.int32)
        inp["shared_rows"] = np.full((S, R), -1, np.int32)
        for g, (members, blocks) in enumerate(groups):
            inp["shared_table"][g, :blocks] = rows[members[0]].blocks[:blocks]
            inp["shared_len"][g] = blocks * block_size
            inp["shared_rows"][g, :len(members)] = members
            skip[list(members)] = blocks
    top_n, filtering = 0, False
    for i, s in enumerate(rows):
        sp = s.params
        inp["token"][i] = s.output[-1] if s.output else s.prompt[-1]
        inp["position"][i] = s.num_computed
        inp["active"][i] = True
        inp["num_generated"][i] = len(s.output)
        inp["remaining"][i] = s.remaining
        inp["temperature"][i] = sp.temperature
        inp["top_k"][i] = max(sp.top_k, 0)
        inp["top_p"][i] = sp.top_p
        inp["key_data"][i] = s.key_data
        inp["stop_ids"][i] = s.stop_array
        blocks = s.blocks[skip[i]: skip[i] + nb]
        inp["tables"][i, : len(blocks)] = blocks
        if sp.top_logprobs > 0:
            top_n = MAX_TOP_LOGPROBS
        filtering = filtering or (sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0))
    return inp, top_n, filtering
