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

Sampling distribution and log-probabilities
-------------------------------------------
For row ``b`` with logits ``z`` (float32), temperature ``T``, top-k ``k`` and top-p ``p``:

* ``T == 0``: greedy, ``token = argmax z``.
* ``T > 0``: ``z' = z / T``; top-k keeps the ``k`` largest entries of ``z'`` (``k <= 0``: all);
  top-p then keeps the smallest prefix (by decreasing probability, renormalised after top-k) whose
  exclusive cumulative probability is below ``p`` (always at least one token). The token is drawn
  from ``softmax(z'')`` where ``z''`` is ``z'`` with discarded entries at ``-inf``.

Two per-token log-probabilities of each sampled token are returned:

* ``logprobs`` ("raw"): ``log_softmax(z)[token]``: the policy itself at temperature 1, no
  truncation. This is what a learner recomputes from the same weights, i.e. the usual PPO/GRPO
  ``old_logprobs`` (equal to the sampling distribution when ``T = 1``, ``k <= 0``, ``p = 1``).
* ``sampling_logprobs`` ("processed"): ``log_softmax(z'')[token]``: the distribution the token was
  actually drawn from (temperature, top-k and top-p applied). For greedy rows there is no sampling
  distribution (a point mass), and this field equals the raw log-prob.

Top-n alternatives (``top_logprobs``) are ranked by the raw logits (temperature and truncation do not
change the order) and reported with both log-probs.

Randomness
----------
Each row has its own PRNG key derived from its ``seed`` (and a choice index for ``n > 1``). The
``j``-th token of a row is drawn with ``fold_in(row_key, j)`` and sampling is done per row, so a
row's tokens depend only on its seed, its prompt and the weights, not on the other rows of the batch
(up to floating-point differences between compiled shapes). Rows without a seed get a fresh random
one.

A token is drawn by inversion in two stages (``draw_tokens``): with ``q = softmax(z'')`` cut into
blocks of ``DRAW_BLOCK`` tokens, a first uniform picks a block with probability its mass, a second
uniform a token within it with probability its share of the block, so ``P(token) = q[token]`` up
to float rounding, from two uniforms per row instead of one Gumbel draw per vocabulary entry (on a
CPU the latter costs more than the model's decode step at batch 32). A batch of greedy rows draws
nothing, and the greedy token is the first maximal logit (``lax.top_k``, as ``argmax``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprm.models import KVCache

__all__ = [
    "SamplingParams",
    "Completion",
    "Sampler",
    "DEFAULT_BATCH_BUCKETS",
    "DEFAULT_PROMPT_BUCKETS",
    "DEFAULT_NEW_TOKEN_BUCKETS",
    "MAX_TOP_LOGPROBS",
    "apply_top_k_top_p",
    "bucket_for",
    "sample_next",
    "draw_tokens",
    "row_key_data",
]

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: 16, 32, 48, 64, 96, 128, 192, ... 32768: steps of 1.5x / 1.33x keep prompt padding under ~33%.
DEFAULT_PROMPT_BUCKETS = tuple(sorted({2**i for i in range(4, 16)} | {3 * 2**i for i in range(4, 14)}))
DEFAULT_NEW_TOKEN_BUCKETS = tuple(2**i for i in range(4, 16))  # 16 .. 32768
#: Largest number of top-n alternatives per position (the OpenAI limit for chat).
MAX_TOP_LOGPROBS = 20
#: Number of stop-token slots per row in the compiled program (more stop ids raise an error).
MAX_STOP_TOKEN_IDS = 32
#: Tokens per block of the two-stage draw (``draw_tokens``).
DRAW_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling options.

    Attributes:
      max_new_tokens: generate at most this many tokens (>= 0).
      temperature: 0 for greedy, > 0 scales the logits by ``1 / temperature``.
      top_p: nucleus mass in ``(0, 1]``; 1 disables.
      top_k: keep the ``top_k`` most likely tokens; ``<= 0`` disables.
      seed: row seed (any int); ``None`` draws a fresh one.
      stop_token_ids: extra token ids that end the row (the stop token is included in the output).
      ignore_eos: if False (default) the sampler's EOS ids also stop the row.
      top_logprobs: number of top alternatives to report per position (0 .. ``MAX_TOP_LOGPROBS``).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        if int(self.max_new_tokens) < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not (-(2**31) <= int(self.top_k) < 2**31):  # it goes into int32 arrays; >= vocab keeps all anyway
            raise ValueError(f"top_k must fit in int32 (any value >= the vocabulary size keeps all), got {self.top_k}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class Completion:
    """One generated continuation.

    Attributes:
      prompt_ids: the prompt token ids.
      token_ids: generated token ids (a stop token, when hit, is the last one).
      logprobs: raw log-prob of each generated token (policy at temperature 1, see module doc).
      sampling_logprobs: log-prob under the distribution actually sampled from.
      top_logprobs: per position, a list of ``(token_id, raw_logprob, sampling_logprob)`` for the top
        ``top_logprobs`` tokens by raw probability; ``None`` when not requested.
      finish_reason: ``"stop"`` (a stop/EOS token was generated), ``"length"`` (max tokens) or
        ``"abort"`` (cancelled or aborted by the engine; the tokens generated until then).
      stop_token_id: the token that stopped the row, or ``None``.
      weight_version: the weight version of the oldest output token (the current one if none).
      output_token_versions: per output token, the weight version that produced it (a serving
        engine may swap weights between steps of a running request).
      cached_tokens: prompt tokens whose KV came from a prefix cache (0 for the static sampler).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float, float]]] | None
    finish_reason: Literal["stop", "length", "abort"]
    stop_token_id: int | None
    weight_version: int
    output_token_versions: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0


def bucket_for(n: int, buckets: Sequence[int], what: str) -> int:
    """Smallest bucket ``>= n``; ``ValueError`` naming ``what`` when ``n`` exceeds the largest."""
    for b in buckets:
        if n <= b:
            return int(b)
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask logits outside the per-row top-k, then outside the top-p nucleus, with ``-inf``.

    Args:
      logits: ``float32 [B, V]`` (already temperature-scaled).
      top_k: ``int32 [B]``; ``<= 0`` keeps all ``V``.
      top_p: ``float32 [B]`` in ``(0, 1]``; 1 keeps all.

    Returns ``float32 [B, V]``: entries ranked ``r`` (0 = largest) are kept iff ``r < k`` and the
    exclusive cumulative probability ``sum_{r' < r} q_{r'} < p``, where ``q`` is the softmax of the
    top-k-truncated logits (rank 0 is always kept). Ties at the threshold value are kept.
    """
    chex.assert_rank([logits, top_k, top_p], [2, 1, 1])
    V = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]
    in_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
    exclusive_cum = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (exclusive_cum < top_p[:, None])
    keep = keep.at[:, 0].set(True)
    n_keep = jnp.sum(keep, axis=-1)
    threshold = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_next(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                key_data: jax.Array, num_generated: jax.Array, *, top_n: int, filtering: bool) -> dict[str, jax.Array]:
    """Draw each row's next token and its two log-probs (the definitions in the module docstring).

    Args:
      logits: ``[B, V]`` next-token logits (upcast to float32).
      temperature / top_k / top_p: per-row ``[B]`` options (temperature 0 is greedy).
      key_data: ``uint32 [B, 2]`` row keys (``_row_key_data``); token ``j`` of a row is drawn with
        ``fold_in(row_key, j)``, ``j = num_generated [B]``, so a row's draws do not depend on the
        rest of the batch.
      top_n: static number of top alternatives (0: none); filtering: static, apply top-k / top-p.

    Returns ``token int32 [B]``, ``logprob`` (raw, ``log_softmax(z)[token]``) and
    ``sampling_logprob`` (under the distribution sampled from; the raw one for greedy rows), float32
    ``[B]``; with ``top_n``: ``top_ids int32 [B, top_n]`` ranked by raw logit, ``top_raw`` and
    ``top_proc`` float32 ``[B, top_n]``.
    """
    chex.assert_rank([logits, temperature, top_k, top_p, key_data, num_generated], [2, 1, 1, 1, 2, 1])
    logits = logits.astype(jnp.float32)
    raw_lp = jax.nn.log_softmax(logits, axis=-1)
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    if filtering:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    proc_lp = jax.nn.log_softmax(scaled, axis=-1)
    keys = jax.random.wrap_key_data(key_data, impl="threefry2x32")
    step_keys = jax.vmap(jax.random.fold_in)(keys, num_generated)
    # A batch of greedy rows draws nothing (each row's token is still decided by that row alone).
    sampled = jax.lax.cond(jnp.any(~greedy), draw_tokens, lambda k, z: jnp.zeros(z.shape[:1], jnp.int32),
                           step_keys, scaled)
    first_max = jax.lax.top_k(logits, 1)[1][:, 0]  # argmax (the first maximal entry), much faster on CPU
    tok = jnp.where(greedy, first_max, sampled).astype(jnp.int32)
    lp_raw = jnp.take_along_axis(raw_lp, tok[:, None], axis=-1)[:, 0]
    lp_proc = jnp.where(greedy, lp_raw, jnp.take_along_axis(proc_lp, tok[:, None], axis=-1)[:, 0])
    out = dict(token=tok, logprob=lp_raw, sampling_logprob=lp_proc)
    if top_n:
        top_raw, top_ids = jax.lax.top_k(raw_lp, top_n)
        top_proc = jnp.take_along_axis(proc_lp, top_ids, axis=-1)
        out.update(top_ids=top_ids, top_raw=top_raw, top_proc=jnp.where(greedy[:, None], top_raw, top_proc))
    return out


def draw_tokens(keys: jax.Array, logits: jax.Array, *, block: int = DRAW_BLOCK) -> jax.Array:
    """One token per row from ``softmax(logits)``, by inversion in two stages.

    ``keys``: typed PRNG keys ``[B]``; ``logits``: ``float32 [B, V]``, ``-inf`` for excluded tokens
    (at least one finite entry per row). With ``p = exp(z - max z)`` cut into ``n = ceil(V / block)``
    blocks (zero-padded), ``c`` the cumulative block masses and ``u1, u2`` uniform in ``(0, 1]``
    (``jax.random.uniform(key, (2,))``): the block is the first ``i`` with ``c_i >= u1 c_n``, the
    token the first ``j`` of that block whose cumulative mass within the block reaches ``u2`` times
    the block's mass. So ``P(token) = P(block) P(token | block) = softmax(z)[token]`` up to float
    rounding, and a token of probability 0 is never drawn (a rounding tie falls back to the block's
    most probable token). Returns ``int32 [B]``.
    """
    chex.assert_rank([keys, logits], [1, 2])
    B, V = logits.shape
    n = -(-V // block)
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)  # (0, 1]
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.pad(p, ((0, 0), (0, n * block - V))).reshape(B, n, block)
    c = jnp.cumsum(jnp.sum(p, axis=-1), axis=-1)  # [B, n]
    i = jnp.argmax(c >= u[:, :1] * c[:, -1:], axis=-1)  # first block reaching the threshold
    inner = jnp.take_along_axis(p, i[:, None, None], axis=1)[:, 0]  # [B, block]
    ci = jnp.cumsum(inner, axis=-1)
    j = jnp.argmax(ci >= u[:, 1:] * ci[:, -1:], axis=-1)
    j = jnp.where(jnp.take_along_axis(inner, j[:, None], axis=-1)[:, 0] > 0, j, jnp.argmax(inner, axis=-1))
    return (i * block + j).astype(jnp.int32)


def row_key_data(seed: int, choice: int) -> np.ndarray:
    """Key data ``uint32 [2]`` of a row with this seed and choice index (see "Randomness")."""
    return _row_key_data(seed, choice)


def _row_key_data(seed: int, choice: int) -> np.ndarray:
    """Map an arbitrary int seed and choice index to threefry key data ``uint32 [2]``."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(choice)}".encode(), digest_size=8).digest()
    return np.frombuffer(digest, dtype=np.uint32).copy()


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
            batch_buckets = tuple(b for b in DEFAULT_BATCH_BUCKETS if b < max_batch) + (max_batch,)
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
        self._version = 0
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
            key_data[i] = _row_key_data(seeds[i], choices[i])
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
