"""Static batching: the reference generation path over a :class:`~jaxprm.serve.sampler.Sampler`'s
weights, a whole batch prefilled and decoded together in one jitted program.

The server does not use it (``jaxprm.serve.engine`` batches continuously); the tests compare the
engine's tokens with it, and a script that wants completions for a fixed list of prompts without a
server may call it directly: ``StaticSampler(sampler).generate(prompts, params)``.

Shapes and buckets
------------------
A call is padded to static shapes so that steady-state traffic never recompiles:

* batch rows ``B`` rounded up to one of the sampler's batch buckets (larger calls are split);
  padding rows have ``max_new_tokens = 0`` and are finished before the first step;
* prompt length ``Tp`` rounded up to a prompt bucket (16, 32, 48, 64, 96, 128, 192, ...);
* output length ``N`` (the largest ``max_new_tokens`` in the call) rounded up to a new-token bucket;
  the KV cache holds ``Tp + N`` slots.

One compiled program exists per ``(B, U, Tp, N, top-n logprobs, filtering on/off)`` key (``U``: the
prefill batch, ``B`` unless identical prompts are shared, see below);
``StaticSampler.num_compilations`` counts them (each trace is one compilation).

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
import time
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models import KVCache
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.sampling import (MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, Completion, SamplingParams, bucket_for,
                                   row_key_data, sample_next)

__all__ = ["StaticSampler"]


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



class StaticSampler:
    """Generates completions for a list of prompts in fixed-shape, jitted batches (see the module
    docstring), with the weights a :class:`Sampler` holds when each call starts.

    Args:
      sampler: the weights, their version, the shape buckets and the request limits.
      loop: ``"device"`` runs the whole decode loop in one ``lax.while_loop`` program; ``"host"``
        calls a jitted single step from Python (checking for completion every ``host_sync_every``
        steps).
      dedupe_prompts: prefill identical prompts once (``n > 1``, GRPO groups) when that at least
        halves the prefill batch; the cache rows are then copied to their decode rows.

    Thread-safety: ``generate`` may be called while another thread calls ``sampler.update_params``;
    a call uses the weights current when it starts.
    """

    def __init__(self, sampler: Sampler, *, loop: Literal["device", "host"] = "device", host_sync_every: int = 8,
                 dedupe_prompts: bool = True) -> None:
        if loop not in ("device", "host"):
            raise ValueError(f"loop must be 'device' or 'host', got {loop!r}")
        self.sampler, self.loop = sampler, loop
        self.host_sync_every = int(host_sync_every)
        self.dedupe_prompts = bool(dedupe_prompts)
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

    @property
    def num_compilations(self) -> int:
        """Number of programs traced (= compiled) so far, over all shapes."""
        return self._num_traces

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
            self.sampler.check_request(p, sp, where=f"prompt {i}")
        seeds = [sp.seed if sp.seed is not None else secrets.randbits(63) for sp in params]
        out: list[Completion] = []
        for start in range(0, len(prompts), self.sampler.max_batch):
            sl = slice(start, start + self.sampler.max_batch)
            out.extend(self._generate_chunk(prompts[sl], params[sl], seeds[sl], choice_index[sl]))
        return out

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
        for b in sorted({bucket_for(int(x), self.sampler.batch_buckets, "batch size") for x in batch_sizes}):
            distinct = [[i % self.sampler.vocab_size] + [self.sampler.pad_token_id] * (prompt_len - 1) for i in range(b)]
            prep = self._prepare(distinct, [sp] * b, [0] * b, [0] * b)
            inputs = self._device_inputs(prep)
            weights, _ = self.sampler.snapshot()
            t0 = time.perf_counter()
            if self.loop == "device":
                self._jit_generate.lower(weights, self.sampler.rest, inputs, num_new=prep.num_new, top_n=prep.top_n,
                                         filtering=prep.filtering).compile()
            else:
                lowered = self._jit_prefill.lower(weights, self.sampler.rest, inputs, num_new=prep.num_new, top_n=prep.top_n)
                lowered.compile()
                carry = lowered.out_info
                self._jit_step.lower(weights, self.sampler.rest, carry, inputs, top_n=prep.top_n,
                                     filtering=prep.filtering).compile()
            times[b] = time.perf_counter() - t0
        return times

    # host-side preparation
    def _prepare(self, prompts, params, seeds, choices) -> _Prepared:
        n = len(prompts)
        B = bucket_for(n, self.sampler.batch_buckets, "batch size")
        Tp = bucket_for(max(len(p) for p in prompts), self.sampler.prompt_buckets, "prompt length")
        N = bucket_for(max(1, max(sp.max_new_tokens for sp in params)), self.sampler.new_token_buckets, "max_new_tokens")
        # Rows with identical prompts (n > 1, GRPO groups) share one prefill when that at least
        # halves the prefill batch; U is then a batch bucket of its own (a separate program).
        index: dict[tuple[int, ...], int] = {}
        src = np.zeros((B,), np.int32)
        for i, p in enumerate(prompts):
            src[i] = index.setdefault(tuple(p), len(index))
        U = bucket_for(len(index), self.sampler.batch_buckets, "batch size")
        if self.dedupe_prompts and 2 * U <= B:
            prompt = np.full((U, Tp), self.sampler.pad_token_id, np.int32)
            for p, u in index.items():
                prompt[u, : len(p)] = p
        else:
            prompt = np.full((B, Tp), self.sampler.pad_token_id, np.int32)
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
            stops = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.sampler.eos_token_ids)))
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
        weights, version = self.sampler.snapshot()
        inputs = self._device_inputs(prep)
        if self.loop == "device":
            res = self._jit_generate(weights, self.sampler.rest, inputs, num_new=prep.num_new, top_n=prep.top_n, filtering=prep.filtering)
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
        return nnx.merge(self.sampler.graphdef, params, rest)

    def _prefill(self, params, rest, inputs, *, num_new: int, top_n: int):
        """Fill a fresh cache of ``Tp + num_new`` slots from the padded prompts; return the loop carry.

        ``inputs["prompt"]`` holds ``U`` distinct prompts; when ``U < B`` the prefilled cache rows
        are gathered (``src``) into the ``B`` decode rows.
        """
        model = self._model(params, rest)
        prompt = inputs["prompt"]
        U, Tp = prompt.shape
        B = inputs["prompt_len"].shape[0]
        cache = KVCache.init(self.sampler.config, U, Tp + num_new, dtype=self.sampler.cache_dtype)
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
        carry = self._jit_prefill(weights, self.sampler.rest, inputs, num_new=prep.num_new, top_n=prep.top_n)
        for s in range(prep.num_new):
            carry = self._jit_step(weights, self.sampler.rest, carry, inputs, top_n=prep.top_n, filtering=prep.filtering)
            if (s + 1) % self.host_sync_every == 0 and bool(np.asarray(carry["out"]["done"]).all()):
                break
        return {k: v for k, v in carry["out"].items() if k != "done"}

