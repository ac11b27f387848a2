"""Batched autoregressive sampling with a KV cache: jitted prefill + decode over fixed-shape buckets.

The sampler turns token-id prompts into completions with per-row sampling options. It is the engine
under ``jaxprm.serve`` and can be held directly by a trainer (in-process rollouts, weight swaps).

Shapes and buckets
------------------
A call is padded to static shapes so that steady-state traffic never recompiles:

* batch rows ``B`` rounded up to a batch bucket (default 1, 2, 4, ..., ``max_batch``); padding rows
  have ``max_new_tokens = 0`` and are finished before the first step;
* prompt length ``Tp`` rounded up to a prompt bucket (16, 32, 48, 64, 96, 128, 192, ...);
* output length ``N`` (the largest ``max_new_tokens`` in the call) rounded up to a power of two
  (from 16); the KV cache holds ``Tp + N`` slots.

One compiled program exists per ``(B, U, Tp, N, top-n logprobs, filtering on/off)`` key (``U``: the
prefill batch, ``B`` unless identical prompts are shared, see below);
``Sampler.num_compilations`` counts them (each trace is one compilation).

Algorithm (cache slot == absolute position, see ``jaxprm.models.KVCache``)
---------------------------------------------------------------------------
1. Prefill: one forward pass over the right-padded prompts ``[B, Tp]`` at positions ``0..Tp-1``
   fills the cache; its logits are unused (XLA removes the LM head from this pass). Identical
   prompts are prefilled once (``[U, Tp]``, ``U`` a batch bucket with ``2 U <= B``) and their cache
   rows copied to the ``B`` decode rows.
2. Decode step ``j`` feeds each row's current token at its own position (the last prompt token at
   ``L_b - 1`` for ``j = 0``), so rows of different prompt lengths decode together. Padding slots past
   a row's length hold garbage but are never attended (a query at ``p`` attends to slots ``<= p``,
   and slot ``p`` is written before it is read).
3. Finished rows keep their position (re-writing one slot) and their outputs are masked; the loop
   ends when every row is finished or ``N`` steps ran.

Sampling distribution, log-probabilities and randomness: ``jaxprm.serve.sampling`` (shared with the
engine).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models import KVCache
from jaxprm.serve.sampling import (DEFAULT_BATCH_BUCKETS, DEFAULT_NEW_TOKEN_BUCKETS, DEFAULT_PROMPT_BUCKETS, MAX_STOP_TOKEN_IDS,
                                  MAX_TOP_LOGPROBS, Completion, SamplingParams, bucket_for, buckets_up_to, row_key_data, sample_next)

__all__ = ["Sampler"]

@dataclasses.dataclass
class _Prepared:
    """Host-side padded inputs for one compiled call."""

    prompt: np.ndarray  # int32 [U, Tp]: the distinct prompts (U == B when not deduplicated)
    src: np.ndarray  # int32 [B]: row -> its prompt in ``prompt``
    prompt_len: np.ndarray  # int32 [B]
    max_new: np.ndarray  # int32 [B]
    temperature: np.ndarray  # float32 [B]
    top_p: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B]
    key_data: np.ndarray  # uint32 [B, 2]
    stop_ids: np.ndarray  # int32 [B, S]
    num_new: int
    top_n: int
    filtering: bool


class Sampler:
    """Holds a model's weights and generates completions in fixed-shape, jitted batches.

    Args:
      model: a ``jaxprm.models.Transformer`` (an ``nnx.Module`` with
        ``logits, cache = model(tokens, positions, cache)`` and a ``config``).
      eos_token_ids: ids that end a row unless ``ignore_eos`` (e.g. ``tokenizer.eos_token_ids``).
      pad_token_id: id used for prompt padding (never attended; any valid id works).
      max_batch: largest compiled batch; larger calls are split.
      batch_buckets / prompt_buckets / new_token_buckets: the static shapes (ascending).
      max_context: longest ``prompt + max_new_tokens``; default ``config.max_position_embeddings``.
      cache_dtype: KV-cache dtype; default the model's parameter dtype (via ``KVCache.init``).
      loop: ``"device"`` runs the whole decode loop in one ``lax.while_loop`` program; ``"host"``
        calls a jitted single step from Python (checking for completion every ``host_sync_every``
        steps).
      dedupe_prompts: prefill identical prompts once (``n > 1``, GRPO groups) when that at least
        halves the prefill batch; the cache rows are then copied to their decode rows.
      dtype: serve the weights in this dtype (e.g. ``"bfloat16"``; default: the model's). Logits,
        sampling and log-probs stay float32; the KV cache defaults to this dtype; weight updates are
        cast to it.
      weight_version: the version of ``model``'s weights (what a resumed trainer's weights are).

    Thread-safety: ``generate`` and ``update_params`` may be called from different threads; a call
    uses the weights current when it starts.
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
        loop: Literal["device", "host"] = "device",
        host_sync_every: int = 8,
        dedupe_prompts: bool = True,
        dtype: Any = None,
        weight_version: int = 0,
    ):
        self._kv_cls = KVCache
        self.config = model.config
        self.vocab_size = int(self.config.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        if loop not in ("device", "host"):
            raise ValueError(f"loop must be 'device' or 'host', got {loop!r}")
        self.loop = loop
        self.dedupe_prompts = bool(dedupe_prompts)
        self.host_sync_every = int(host_sync_every)
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
        self._num_traces = 0

        self._jit_generate = jax.jit(
            self._counted(self._generate_device), static_argnames=("num_new", "top_n", "filtering")
        )
        self._jit_prefill = jax.jit(self._counted(self._prefill), static_argnames=("num_new", "top_n"))
        self._jit_step = jax.jit(
            self._counted(self._step), static_argnames=("top_n", "filtering"), donate_argnums=(2,)
        )

    def _counted(self, fn):
        """Wrap a function so that each trace (one per compilation) bumps ``num_compilations``."""

        def traced(*args, **kwargs):
            self._num_traces += 1
            return fn(*args, **kwargs)

        traced.__name__ = traced.__qualname__ = getattr(fn, "__name__", "traced")  # named in compile logs
        return traced

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

    @property
    def num_compilations(self) -> int:
        """Number of programs traced (= compiled) so far, over all shapes."""
        return self._num_traces

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
    # public generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        *,
        choice_index: Sequence[int] | None = None,
    ) -> list[Completion]:
        """Generate one completion per prompt.

        Args:
          prompts: token-id lists (each non-empty, ids in ``[0, vocab_size)``).
          params: one ``SamplingParams`` for all rows or one per row.
          choice_index: per-row index mixed into the seed (so ``n`` copies of a prompt with one seed
            differ); default 0 for every row.

        Returns completions in the order of ``prompts``. Raises ``ValueError`` for empty prompts,
        out-of-vocabulary ids or a prompt + ``max_new_tokens`` longer than ``max_context``.
        """
        prompts = [list(map(int, p)) for p in prompts]
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        choice_index = [0] * len(prompts) if choice_index is None else list(choice_index)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.check_request(p, sp, where=f"prompt {i}")
        seeds = [sp.seed if sp.seed is not None else secrets.randbits(63) for sp in params]
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            sl = slice(start, start + self.max_batch)
            out.extend(self._generate_chunk(prompts[sl], params[sl], seeds[sl], choice_index[sl]))
        return out

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

    def precompile(
        self,
        batch_sizes: Sequence[int] = (1,),
        prompt_len: int = 16,
        max_new_tokens: int = 16,
        *,
        top_logprobs: int = 0,
        filtering: bool = False,
    ) -> dict[int, float]:
        """Compile (ahead of time, without running) the programs for these batch sizes.

        Shapes are those of a call with prompts of ``prompt_len`` tokens and ``max_new_tokens``
        (rounded up to their buckets); ``top_logprobs > 0`` / ``filtering`` select the program
        variants used by requests with top-n logprobs / top-k or top-p. Returns seconds per batch
        bucket. Later ``generate`` calls with these shapes do not compile (batches of distinct
        prompts; a batch sharing prompts enough to be deduplicated uses its own program).
        """
        times: dict[int, float] = {}
        sp = SamplingParams(max_new_tokens=max_new_tokens, top_logprobs=top_logprobs,
                            top_k=2 if filtering else 0)
        for b in sorted({bucket_for(int(x), self.batch_buckets, "batch size") for x in batch_sizes}):
            distinct = [[i % self.vocab_size] + [self.pad_token_id] * (prompt_len - 1) for i in range(b)]
            prep = self._prepare(distinct, [sp] * b, [0] * b, [0] * b)
            inputs = self._device_inputs(prep)
            with self._lock:
                weights = self._params
            t0 = time.perf_counter()
            if self.loop == "device":
                self._jit_generate.lower(weights, self._rest, inputs, num_new=prep.num_new, top_n=prep.top_n,
                                         filtering=prep.filtering).compile()
            else:
                lowered = self._jit_prefill.lower(weights, self._rest, inputs, num_new=prep.num_new, top_n=prep.top_n)
                lowered.compile()
                carry = lowered.out_info
                self._jit_step.lower(weights, self._rest, carry, inputs, top_n=prep.top_n,
                                     filtering=prep.filtering).compile()
            times[b] = time.perf_counter() - t0
        return times

    # ----------------------------------------------------------------------------------------
    # host-side preparation
    def _prepare(self, prompts, params, seeds, choices) -> _Prepared:
        n = len(prompts)
        B = bucket_for(n, self.batch_buckets, "batch size")
        Tp = bucket_for(max(len(p) for p in prompts), self.prompt_buckets, "prompt length")
        N = bucket_for(max(1, max(sp.max_new_tokens for sp in params)), self.new_token_buckets, "max_new_tokens")
        # Rows with identical prompts (n > 1, GRPO groups) share one prefill when that at least
        # halves the prefill batch; U is then a batch bucket of its own (a separate program).
        index: dict[tuple[int, ...], int] = {}
        src = np.zeros((B,), np.int32)
        for i, p in enumerate(prompts):
            src[i] = index.setdefault(tuple(p), len(index))
        U = bucket_for(len(index), self.batch_buckets, "batch size")
        if self.dedupe_prompts and 2 * U <= B:
            prompt = np.full((U, Tp), self.pad_token_id, np.int32)
            for p, u in index.items():
                prompt[u, : len(p)] = p
        else:
            prompt = np.full((B, Tp), self.pad_token_id, np.int32)
            for i, p in enumerate(prompts):
                prompt[i, : len(p)] = p
            src = np.arange(B, dtype=np.int32)
        prompt_len = np.ones((B,), np.int32)
        max_new = np.zeros((B,), np.int32)
        temperature = np.zeros((B,), np.float32)  # padding rows are greedy: a greedy batch draws nothing
        top_p = np.ones((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        key_data = np.zeros((B, 2), np.uint32)
        stop_ids = np.full((B, MAX_STOP_TOKEN_IDS), -1, np.int32)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            prompt_len[i] = len(p)
            max_new[i] = sp.max_new_tokens
            temperature[i] = sp.temperature
            top_p[i] = sp.top_p
            top_k[i] = sp.top_k if sp.top_k > 0 else 0
            key_data[i] = row_key_data(seeds[i], choices[i])
            stops = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids)))
            stop_ids[i, : len(stops)] = stops
        filtering = any(sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0) for sp in params)
        top_n = MAX_TOP_LOGPROBS if any(sp.top_logprobs > 0 for sp in params) else 0
        return _Prepared(prompt, src, prompt_len, max_new, temperature, top_p, top_k, key_data, stop_ids, N, top_n,
                         filtering)

    @staticmethod
    def _device_inputs(prep: _Prepared) -> dict[str, jax.Array]:
        return jax.device_put(dict(
            prompt=prep.prompt, src=prep.src, prompt_len=prep.prompt_len, max_new=prep.max_new,
            temperature=prep.temperature, top_p=prep.top_p, top_k=prep.top_k,
            key_data=prep.key_data, stop_ids=prep.stop_ids,
        ))

    def _generate_chunk(self, prompts, params, seeds, choices) -> list[Completion]:
        prep = self._prepare(prompts, params, seeds, choices)
        with self._lock:
            weights, version = self._params, self._version
        inputs = self._device_inputs(prep)
        if self.loop == "device":
            res = self._jit_generate(weights, self._rest, inputs, num_new=prep.num_new, top_n=prep.top_n, filtering=prep.filtering)
        else:
            res = self._run_host_loop(weights, inputs, prep)
        res = jax.device_get(res)
        out = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            n = int(res["num_generated"][i])
            toks = [int(t) for t in res["tokens"][i, :n]]
            stopped = bool(res["stopped"][i])
            top = None
            if sp.top_logprobs > 0:
                k = sp.top_logprobs
                top = [
                    [(int(res["top_ids"][i, j, r]), float(res["top_raw"][i, j, r]), float(res["top_proc"][i, j, r])) for r in range(k)]
                    for j in range(n)
                ]
            out.append(
                Completion(
                    prompt_ids=list(p),
                    token_ids=toks,
                    logprobs=[float(x) for x in res["logprobs"][i, :n]],
                    sampling_logprobs=[float(x) for x in res["sampling_logprobs"][i, :n]],
                    top_logprobs=top,
                    finish_reason="stop" if stopped else "length",
                    stop_token_id=toks[-1] if stopped else None,
                    weight_version=version,
                    output_token_versions=[version] * n,
                )
            )
        return out

    # ----------------------------------------------------------------------------------------
    # traced programs
    def _model(self, params, rest):
        return nnx.merge(self._graphdef, params, rest)

    def _prefill(self, params, rest, inputs, *, num_new: int, top_n: int):
        """Fill a fresh cache of ``Tp + num_new`` slots from the padded prompts; return the loop carry.

        ``inputs["prompt"]`` holds ``U`` distinct prompts; when ``U < B`` the prefilled cache rows
        are gathered (``src``) into the ``B`` decode rows.
        """
        model = self._model(params, rest)
        prompt = inputs["prompt"]
        U, Tp = prompt.shape
        B = inputs["prompt_len"].shape[0]
        cache = self._kv_cls.init(self.config, U, Tp + num_new, dtype=self.cache_dtype)
        positions = jnp.broadcast_to(jnp.arange(Tp, dtype=jnp.int32)[None], (U, Tp))
        _, cache = model(prompt, positions, cache=cache)  # logits unused: XLA drops the LM head
        src = inputs["src"]
        if U != B:
            cache = jax.tree.map(lambda x: jnp.take(x, src, axis=1), cache)
        rows = prompt[src]
        last = inputs["prompt_len"] - 1
        cur_tok = jnp.take_along_axis(rows, last[:, None], axis=1)[:, 0]
        return dict(cache=cache, cur_tok=cur_tok, cur_pos=last,
                    out=self._init_outputs(B, num_new, top_n, inputs["max_new"]), step=jnp.int32(0))

    def _init_outputs(self, B: int, N: int, top_n: int, max_new):
        k = max(top_n, 1)
        return dict(
            tokens=jnp.zeros((B, N), jnp.int32),
            logprobs=jnp.zeros((B, N), jnp.float32),
            sampling_logprobs=jnp.zeros((B, N), jnp.float32),
            top_ids=jnp.zeros((B, N if top_n else 1, k), jnp.int32),
            top_raw=jnp.zeros((B, N if top_n else 1, k), jnp.float32),
            top_proc=jnp.zeros((B, N if top_n else 1, k), jnp.float32),
            num_generated=jnp.zeros((B,), jnp.int32),
            stopped=jnp.zeros((B,), bool),
            done=max_new <= 0,
        )

    def _step(self, params, rest, carry, inputs, *, top_n: int, filtering: bool):
        """One decode step for every row: forward the current token, sample, record, advance."""
        if not isinstance(carry, dict):
            raise TypeError("carry must be a dict")
        model = self._model(params, rest)
        cache, cur_tok, cur_pos, out = carry["cache"], carry["cur_tok"], carry["cur_pos"], carry["out"]
        B = cur_tok.shape[0]
        logits, cache = model(cur_tok[:, None], cur_pos[:, None], cache=cache)
        n_gen = out["num_generated"]
        s = sample_next(logits[:, 0, :], inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["key_data"],
                        n_gen, top_n=top_n, filtering=filtering)
        tok, lp_raw, lp_proc = s["token"], s["logprob"], s["sampling_logprob"]

        done = out["done"]
        active = ~done
        rows = jnp.arange(B)
        idx = jnp.where(active, n_gen, 0)

        def put(buf, val):
            return buf.at[rows, idx].set(jnp.where(active.reshape((-1,) + (1,) * (val.ndim - 1)), val, buf[rows, idx]))

        new_out = dict(out)
        new_out["tokens"] = put(out["tokens"], tok)
        new_out["logprobs"] = put(out["logprobs"], lp_raw)
        new_out["sampling_logprobs"] = put(out["sampling_logprobs"], lp_proc)
        if top_n:
            new_out["top_ids"] = put(out["top_ids"], s["top_ids"])
            new_out["top_raw"] = put(out["top_raw"], s["top_raw"])
            new_out["top_proc"] = put(out["top_proc"], s["top_proc"])
        is_stop = jnp.any(tok[:, None] == inputs["stop_ids"], axis=-1) & active
        n_gen = n_gen + active.astype(jnp.int32)
        new_out["num_generated"] = n_gen
        new_out["stopped"] = out["stopped"] | is_stop
        new_out["done"] = done | is_stop | (n_gen >= inputs["max_new"])
        cur_tok = jnp.where(active, tok, cur_tok)
        cur_pos = cur_pos + active.astype(jnp.int32)
        return dict(cache=cache, cur_tok=cur_tok, cur_pos=cur_pos, out=new_out, step=carry["step"] + 1)

    def _generate_device(self, params, rest, inputs, *, num_new: int, top_n: int, filtering: bool):
        """Prefill + the whole decode loop in one program (``lax.while_loop``)."""
        carry = self._prefill(params, rest, inputs, num_new=num_new, top_n=top_n)

        def cond(c):
            return (c["step"] < num_new) & ~jnp.all(c["out"]["done"])

        def body(c):
            return self._step(params, rest, c, inputs, top_n=top_n, filtering=filtering)

        carry = jax.lax.while_loop(cond, body, carry)
        return {k: v for k, v in carry["out"].items() if k != "done"}

    def _run_host_loop(self, weights, inputs, prep: _Prepared):
        """Prefill program, then one jitted step per token called from Python."""
        carry = self._jit_prefill(weights, self._rest, inputs, num_new=prep.num_new, top_n=prep.top_n)
        for s in range(prep.num_new):
            carry = self._jit_step(weights, self._rest, carry, inputs, top_n=prep.top_n, filtering=prep.filtering)
            if (s + 1) % self.host_sync_every == 0 and bool(np.asarray(carry["out"]["done"]).all()):
                break
        return {k: v for k, v in carry["out"].items() if k != "done"}
