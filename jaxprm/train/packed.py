"""The tree-packed PPO step (``rollout.export: tree_packed``): each shared prefix forwarded once.

``PackedTrainStep`` is ``TrainStep`` over a ``jaxprm.PackedBatch``: the model sees packed rows with
their depth positions and block-sparse ancestor attention (``query_blocks`` / ``key_blocks``), log-probs are read at each token's
parent position (``jaxprm.learner.packed_logprobs``) and the loss is ``jaxprm.packed_policy_loss``
over the per-token advantage sums (``jaxprm.pack_advantages``), which equals the flat rows' loss,
gradient and metrics (see ``jaxprm.learner.packing``). Advantages are computed on the flat batch,
so every advantage option works unchanged.

Minibatches split packed rows (whole trees) instead of leaves; with one minibatch and one epoch
the update equals the flat one. Denominators: the minibatch's (token, leaf) pairs for
``token-mean``, its leaves with an active token for the seq-mean modes.

The trainer's ``Learner`` (``jaxprm.train.learner``) steps with it for this export unless the
flat rows are clearly cheaper for the step's shapes (``layout_costs``, ``prefer_packed``): packing
forwards fewer tokens, but every
attention block reads the keys of a whole root path (``R N Q S`` score entries against the flat
rows' causal ``B T^2 / 2``-ish), through gathers and scatters. Flat groups whose leaves share only a
short prompt (Sokoban: 1.4x fewer tokens packed, 1.3x more score entries) train on the flat rows;
a small policy, whose step is mostly attention, packs only where trees share much.

Each new packed shape (rows ``R``, attention blocks ``N``, key length ``S``) a step meets is a
learner program (~4 s to compile on 2 CPU cores), and which shapes a run meets depends on its
rollouts. ``neighbour_shapes`` gives the buckets one step away (one length, block-count or row
bucket either side, one axis at a time); with a ``BackgroundCompiler`` the trainer compiles them
in the background, so a later step, or the next run on the machine, loads them from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxprm.learner.loss import behaviour_weights
from jaxprm.learner.packed_loss import PackedAdvantages, pack_advantages, packed_logprobs, packed_policy_loss
from jaxprm.learner.packing import DEFAULT_BLOCK_BUCKETS, PackedBatch
from jaxprm.models.transformer import CAUSAL_CHUNK
from jaxprm.train.step import TrainStep, jitted_for, minibatch_rows

__all__ = ["PackedTrainStep", "packed_step_inputs", "packed_reference_logprobs", "packed_row_buckets",
           "neighbour_shapes", "precompile_neighbours", "layout_costs", "prefer_packed", "flat_score_entries",
           "PACKED_OVERHEAD", "SCORE_ENTRY_EXTRA", "PACK_MARGIN"]

#: the packed step's time per unit of work over the flat step's (block gathers and scatters, the
#: transposed score layouts of the backward pass): 1.34x per score entry, 1.41x per token, fitted on the
#: tiny policy's Sokoban- and FrozenLake-shaped steps on 2 CPU cores (2026-12-07)
PACKED_OVERHEAD = 1.35
#: flop-equivalents of one attention score entry (per head and layer, one forward) beyond the
#: ``4 * head_dim`` of its two products: the masked softmax's passes over memory (same fit)
SCORE_ENTRY_EXTRA = 64
#: a step packs unless its flat rows are estimated this much cheaper: switching layouts compiles a
#: new learner program (seconds on a CPU), and the packed shapes are precompiled in the background;
#: FrozenLake's default meets estimated ratios of ~1.03 in a few early steps
PACK_MARGIN = 1.1


def prefer_packed(flat_cost: float, packed_cost: float) -> bool:
    """Whether a step trains on its packed rows: ``packed_cost < PACK_MARGIN * flat_cost``."""
    return packed_cost < PACK_MARGIN * flat_cost


def flat_score_entries(rows: int, length: int) -> int:
    """Score entries per head and layer of the flat forward of ``[rows, length]``: ``T^2`` per row,
    or with causal query chunks (``T >= 2 * CAUSAL_CHUNK``, ``Transformer``) ``sum_a (e - a) e``
    over the chunks ``[a, e)``."""
    T = int(length)
    if T < 2 * CAUSAL_CHUNK:
        return rows * T * T
    return rows * sum((min(a + CAUSAL_CHUNK, T) - a) * min(a + CAUSAL_CHUNK, T) for a in range(0, T, CAUSAL_CHUNK))


def layout_costs(config, flat_shape: tuple[int, int], packed_shape: tuple[int, int],
                 block_shape: tuple[int, int, int]) -> tuple[float, float]:
    """``(flat, packed)`` estimated cost of one learner step on each layout, in flop-equivalents of
    one forward (the backward and the epochs scale both alike):

        cost = F_tok * tokens + F_entry * score_entries        (packed: times PACKED_OVERHEAD)
        F_tok   = 2 (L * matmul params of a layer + V * D)
        F_entry = L * H * (4 * head_dim + SCORE_ENTRY_EXTRA)

    with ``tokens = B T`` (flat) or ``R L_packed`` (padding included: it is computed), and score
    entries ``flat_score_entries(B, T)`` or ``R N Q S`` (``block_shape = (N, Q, S)``).
    ``config`` is the policy's ``ModelConfig``."""
    c = config
    layer = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
    f_tok = 2.0 * (c.num_layers * layer + c.vocab_size * c.hidden_size)
    f_entry = float(c.num_layers * c.num_heads * (4 * c.head_dim + SCORE_ENTRY_EXTRA))
    (B, T), (R, L), (N, Q, S) = flat_shape, packed_shape, block_shape
    flat = f_tok * B * T + f_entry * flat_score_entries(B, T)
    packed = PACKED_OVERHEAD * (f_tok * R * L + f_entry * R * N * Q * S)
    return flat, packed
_ADV_KEYS = ("pos", "neg", "count", "n_pos", "n_neg")


def packed_step_inputs(packed: PackedBatch, batch, advantages: jax.Array, *, agg: str,
                       loss_weights: jax.Array | None = None) -> dict[str, jax.Array]:
    """The arrays ``PackedTrainStep`` reads: the packed layout plus ``pack_advantages`` of the flat
    ``advantages [B, T]`` (masked by the flat batch's ``loss_mask * row_weights``, or by
    ``loss_weights * row_weights`` when given: ``Advantages.loss_weights``)."""
    mask = (batch.loss_mask if loss_weights is None else loss_weights) * batch.row_weights[:, None]
    pa = pack_advantages(advantages, mask, packed, agg=agg)
    pa = jax.tree.map(lambda x: x * packed.row_weights.reshape((-1,) + (1,) * (x.ndim - 1)), pa)
    return {
        "tokens": packed.tokens, "positions": packed.positions, "parents": packed.parents,
        "query_blocks": packed.query_blocks, "key_blocks": packed.key_blocks, "old_logprobs": packed.old_logprobs,
        "row_weights": packed.row_weights, **pa._asdict(),
    }


def packed_row_buckets(multiple: int, largest: int = 1 << 12) -> tuple[int, ...]:
    """Packed row counts: ``multiple`` times powers of two (few shapes, divisible by the minibatch
    count and the device count)."""
    out, k = [], 1
    while k * multiple <= largest:
        out.append(k * multiple)
        k *= 2
    return tuple(out)


def neighbour_shapes(shape: dict[str, int], buckets: dict[str, Sequence[int]]) -> list[dict[str, int]]:
    """The shapes one bucket away from ``shape`` along one axis at a time: for each axis of
    ``buckets`` in order, ``shape`` with that axis moved to the bucket below, then the one above
    (an axis whose value is not one of its buckets has no neighbours)."""
    out = []
    for axis, b in buckets.items():
        b = sorted(b)
        x = shape[axis]
        if x not in b:
            continue
        i = b.index(x)
        out += [{**shape, axis: b[j]} for j in (i - 1, i + 1) if 0 <= j < len(b)]
    return out


def _respec(inputs: dict, rows: int, blocks: int, key_len: int) -> dict:
    """``jax.ShapeDtypeStruct`` specs of ``packed_step_inputs``' arrays for ``rows`` packed rows,
    ``blocks`` attention blocks and key slots of ``key_len`` (every array's leading axis is the rows;
    ``query_blocks [R, N, Q]``, ``key_blocks [R, N, S]``)."""
    out = {}
    for k, v in inputs.items():
        shape = (rows,) + tuple(v.shape[1:])
        if k in ("query_blocks", "key_blocks"):
            shape = (rows, blocks) + shape[2:]
        if k == "key_blocks":
            shape = shape[:2] + (key_len,)
        out[k] = jax.ShapeDtypeStruct(shape, v.dtype)
    return out


def precompile_neighbours(compiler, step: PackedTrainStep, state, inputs: dict, rng, row_buckets,
                          len_buckets, block_buckets=DEFAULT_BLOCK_BUCKETS) -> int:
    """Submit to ``compiler`` (a ``BackgroundCompiler``) the step's programs for the shapes next to
    that of ``inputs`` (``neighbour_shapes`` over key length ``S`` in ``len_buckets``, block count
    ``N`` in ``block_buckets`` and rows ``R`` in ``row_buckets``); the key names the shape, so each
    is compiled once a run. Returns how many were new."""
    R, N, S = inputs["key_blocks"].shape
    L = inputs["tokens"].shape[1]
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    state_spec, rng_spec = jax.tree.map(spec, state), spec(rng)
    n = 0
    for sh in neighbour_shapes({"R": R, "N": N, "S": S}, {"S": len_buckets, "N": block_buckets, "R": row_buckets}):
        specs = _respec(inputs, sh["R"], sh["N"], sh["S"])
        n += compiler.submit(("packed_step", sh["R"], L, sh["N"], sh["S"]),
                             lambda specs=specs: step.lower(state_spec, specs, rng_spec))
    return n


class PackedTrainStep(TrainStep):
    """``TrainStep`` over tree-packed rows (see the module docstring).

    ``apply_fn(params, tokens, positions, query_blocks=, key_blocks=) -> logits`` (``Policy.apply_fn``;
    block-sparse tree attention, see ``Transformer``);
    ``loss_kwargs`` as ``TrainStep`` (eps_clip, eps_clip_higher, c_clip, agg); ``microbatch_tokens``
    bounds the packed tokens per gradient-accumulation chunk (a divisor of the minibatch rows).
    """

    def __init__(self, apply_fn, optimizer, *, epochs: int = 1, num_minibatches: int = 1,
                 loss_kwargs: dict | None = None, mesh=None, microbatch_tokens: int | None = None,
                 entropy_coef: float = 0.0, behaviour: dict | None = None, target_kl: float | None = None,
                 frozen=None) -> None:
        super().__init__(apply_fn, optimizer, packed_policy_loss, epochs=epochs, num_minibatches=num_minibatches,
                         loss_kwargs=loss_kwargs, mesh=mesh, entropy_coef=entropy_coef, behaviour=behaviour,
                         target_kl=target_kl, frozen=frozen)
        if self.behaviour is not None and self.behaviour["mode"] == "mask_sequence":
            raise ValueError("behaviour mode 'mask_sequence' needs the flat rows: a packed token is shared by "
                             "several sequences (use 'truncate' or 'mask', or the flat export)")
        self.microbatch_tokens = microbatch_tokens

    @classmethod
    def like(cls, step: TrainStep, *, microbatch_tokens: int | None = None) -> PackedTrainStep:
        """A packed step with the optimizer, loss options, epochs, minibatches, mesh and frozen weights of ``step``."""
        return cls(step.apply_fn, step.optimizer, epochs=step.epochs, num_minibatches=step.num_minibatches,
                   loss_kwargs=step.loss_kwargs, mesh=step.mesh, microbatch_tokens=microbatch_tokens,
                   entropy_coef=step.entropy_coef, behaviour=step.behaviour, target_kl=step.target_kl,
                   frozen=step.frozen)

    def _micro_rows(self, mb_rows: int, L: int) -> int:
        if not self.microbatch_tokens:
            return mb_rows
        cap = max(1, self.microbatch_tokens // L)
        return max(d for d in range(1, mb_rows + 1) if mb_rows % d == 0 and d <= cap)

    def _minibatch(self, data: dict, order: jax.Array, n_real: jax.Array, k: jax.Array, mb_rows: int, n_mb: int) -> dict:
        mb, valid = minibatch_rows(data, order, n_real, k, mb_rows, n_mb)
        for key in (*_ADV_KEYS, "row_leaves"):
            v = mb[key]
            mb[key] = v * valid.reshape((-1,) + (1,) * (v.ndim - 1)).astype(v.dtype)
        return mb

    def _counts(self, mb: dict) -> tuple[jax.Array, jax.Array]:
        # (token, leaf) pairs and leaves with an active token: the flat rows' denominators
        return mb["count"].sum(), mb["row_leaves"].sum()

    def _micro_loss(self, params: Any, mc: dict):
        logits = self.apply_fn(params, mc["tokens"], mc["positions"], query_blocks=mc["query_blocks"],
                               key_blocks=mc["key_blocks"])
        logp = packed_logprobs(logits, mc["tokens"], mc["parents"])
        adv = PackedAdvantages(**{key: mc[key] for key in PackedAdvantages._fields})
        if self.behaviour is not None:
            loss, metrics = self._decoupled_loss(logp, mc, adv)
        else:
            loss, metrics = packed_policy_loss(logp, mc["old_logprobs"], adv, **self.loss_kwargs)
        # a packed token's entropy is its parent position's, counted once per (token, leaf) pair
        ent = jnp.take_along_axis(self._entropy(logits), jnp.maximum(mc["parents"], 0), axis=1)
        return loss, metrics, jnp.sum(jnp.where(mc["parents"] >= 0, ent, 0.0) * mc["count"])


    def _decoupled_loss(self, logp, mc: dict, adv: PackedAdvantages):
        """``decoupled_policy_loss`` of the flat rows on packed tokens: ratios against the proximal
        log-probs, each token weighted by its capped behaviour weight; the gap and capped sums are
        weighted by the token's (token, leaf) pairs, as the flat rows count them."""
        prox, behave, count = mc["proximal_logprobs"], mc["old_logprobs"], adv.count
        w, capped = behaviour_weights(prox, behave, count, cap=self.behaviour["cap"], mode=self.behaviour["mode"])
        loss, metrics = packed_policy_loss(logp, prox, adv, weights=w, **self.loss_kwargs)
        gap = jax.lax.stop_gradient(jnp.where(count > 0, jnp.abs(prox - behave), 0.0))
        metrics = {**metrics, "behave_gap_sum": jnp.sum(count * gap), "behave_capped_sum": jnp.sum(count * capped)}
        return loss, metrics


def packed_reference_logprobs(apply_fn, params, packed: PackedBatch, place=lambda x: x) -> jax.Array:
    """Per-token log-probs ``[R, L]`` of the packed rows under ``params`` (one jitted forward per
    ``apply_fn``); ``place`` puts each input where the forward runs (``Learner.on_mesh``)."""
    fn = jitted_for(apply_fn, "packed_logprobs", lambda f: lambda p, t, q, qb, kb, par: packed_logprobs(
        f(p, t, q, query_blocks=qb, key_blocks=kb), t, par))
    return fn(params, *(place(x) for x in (packed.tokens, packed.positions, packed.query_blocks, packed.key_blocks,
                                            packed.parents)))
