"""What one row samples: its parameters, its distribution, its draw and its log-probabilities.

Shared by the static sampler (``jaxprm.serve.sampler``) and the engine's programs
(``jaxprm.serve.programs``): ``SamplingParams`` (per-row options), ``Completion`` (one row's answer),
the shape buckets, ``apply_top_k_top_p`` / ``sample_next`` / ``draw_tokens`` (the distribution and
the draw, jittable) and ``row_key_data`` (a row's PRNG key from its seed).

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
from collections.abc import Sequence
from typing import Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "SamplingParams",
    "Completion",
    "DEFAULT_BATCH_BUCKETS",
    "DEFAULT_PROMPT_BUCKETS",
    "DEFAULT_NEW_TOKEN_BUCKETS",
    "MAX_TOP_LOGPROBS",
    "MAX_STOP_TOKEN_IDS",
    "DRAW_BLOCK",
    "apply_top_k_top_p",
    "bucket_for",
    "buckets_up_to",
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


def buckets_up_to(buckets: Sequence[int], top: int) -> tuple[int, ...]:
    """``buckets`` below ``top``, then ``top`` (ascending): a bucket ladder capped at a maximum."""
    return tuple(sorted(int(b) for b in buckets if b < top)) + (int(top),)


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
      key_data: ``uint32 [B, 2]`` row keys (``row_key_data``); token ``j`` of a row is drawn with
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
    """Key data ``uint32 [2]`` of a row with this seed and choice index (see "Randomness"): an
    arbitrary int seed and choice index mapped to threefry key data."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(choice)}".encode(), digest_size=8).digest()
    return np.frombuffer(digest, dtype=np.uint32).copy()
