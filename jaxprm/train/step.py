"""The PPO train step: epochs x minibatches of policy-loss updates in one jitted program.

``TrainStep`` owns the jitted function. Its inputs have fixed shapes per bucket (rows ``B`` fixed by
``ppo.max_rows``, length ``T`` from ``ppo.len_buckets``), so steady-state training never recompiles.

Per epoch the real rows (``row_weights > 0``) are shuffled to the front, then split into
``num_minibatches`` minibatches of ``B / num_minibatches`` row slots each; the real rows are spread
evenly over the minibatches (``ceil(n_real / num_minibatches)`` per minibatch) and the other slots
are masked out. A minibatch without an active token leaves params and optimizer state unchanged.

Sharding: with a ``jax.sharding.Mesh`` of axes ``("data", "fsdp")`` the batch rows are split over
both axes and each parameter is split over ``fsdp`` along its largest divisible dimension
(replicated over ``data``); XLA inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxprm.learner import decoupled_policy_loss
from jaxprm.models.logprobs import entropy_of, next_token_logprobs
from jaxprm.modes import BEHAVIOUR_WEIGHT_MODES
from jaxprm.train.compilation import in_background

__all__ = [
    "TrainState",
    "TrainStep",
    "make_optimizer",
    "make_schedule",
    "make_mesh",
    "shard_params",
    "step_inputs",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything the learner updates (a pytree): params, optimizer state, step counter."""

    params: Any
    opt_state: Any
    step: jax.Array


def make_schedule(o, total_updates: int) -> optax.Schedule:
    """Linear warmup from 0 to ``o.lr`` over ``o.warmup_steps``, then constant or cosine decay to
    ``o.lr * o.min_lr_ratio`` at ``total_updates`` (counted in optimizer updates).

    ``o``: the optimizer section (``lr``, ``warmup_steps``, ``schedule``, ``min_lr_ratio``)."""
    lr, warm = o.lr, o.warmup_steps
    if o.schedule == "constant":
        if warm == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warm), optax.constant_schedule(lr)], [warm]
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warm else lr,
        peak_value=lr,
        warmup_steps=warm,
        decay_steps=max(total_updates, warm + 1),
        end_value=lr * o.min_lr_ratio,
    )


def make_optimizer(o, total_updates: int) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; ``o`` the optimizer section (``grad_clip``, ``b1``, ``b2``,
    ``eps``, ``weight_decay`` and the schedule's fields)."""
    return optax.chain(
        optax.clip_by_global_norm(o.grad_clip),
        optax.adamw(make_schedule(o, total_updates), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )


def make_mesh(data: int = -1, fsdp: int = 1, devices=None) -> Mesh:
    """A ``("data", "fsdp")`` mesh over ``devices`` (default all); ``-1`` fills the remainder."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if data == -1:
        if n % fsdp:
            raise ValueError(f"mesh.fsdp={fsdp} does not divide the {n} devices")
        data = n // fsdp
    elif fsdp == -1:
        if n % data:
            raise ValueError(f"mesh.data={data} does not divide the {n} devices")
        fsdp = n // data
    if data * fsdp > n:
        raise ValueError(f"mesh data*fsdp = {data}*{fsdp} needs {data * fsdp} devices; {n} available")
    arr = np.asarray(devices[: data * fsdp]).reshape(data, fsdp)
    return Mesh(arr, ("data", "fsdp"))


def _param_spec(x: jax.Array, fsdp: int) -> P:
    if fsdp <= 1 or not hasattr(x, "shape") or x.ndim == 0:
        return P()
    dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
    for d in dims:
        if x.shape[d] % fsdp == 0:
            spec = [None] * x.ndim
            spec[d] = "fsdp"
            return P(*spec)
    return P()


def shard_params(tree: Any, mesh: Mesh) -> Any:
    """Shardings for a params-like pytree: FSDP over the largest divisible dim, else replicated."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, _param_spec(x, fsdp)), tree)


def step_inputs(batch, advantages, loss_weights=None) -> dict[str, jax.Array]:
    """The arrays the train step reads from a ``jaxprm.Batch`` plus advantages ``[B, T]``;
    ``loss_weights`` (``Advantages.loss_weights``) replaces the batch's loss mask when given."""
    mask = batch.loss_mask if loss_weights is None else loss_weights
    return {
        "tokens": batch.tokens,
        "loss_mask": mask * batch.row_weights[:, None],
        "old_logprobs": batch.old_logprobs,
        "advantages": advantages.astype(jnp.float32),
        "row_weights": batch.row_weights,
    }


def minibatch_rows(data: dict, order: jax.Array, n_real: jax.Array, k: jax.Array, mb_rows: int,
                   n_mb: int) -> tuple[dict, jax.Array]:
    """Minibatch ``k`` of ``n_mb``: the real rows (first ``n_real`` of ``order``) spread evenly, ``ceil(n_real
    / n_mb)`` per minibatch, in ``mb_rows`` slots. Returns the gathered rows of every array of ``data``
    (leading axis rows) and ``valid [mb_rows]`` (slots that hold a real row of this minibatch)."""
    B = data["tokens"].shape[0]
    per_mb = (n_real + n_mb - 1) // n_mb
    i = jnp.arange(mb_rows)
    pos = k * per_mb + i
    valid = (i < per_mb) & (pos < n_real)
    idx = order[jnp.clip(pos, 0, B - 1)]
    return {name: jnp.take(v, idx, axis=0) for name, v in data.items()}, valid


class TrainStep:
    """Builds and owns the jitted PPO step.

    Args:
      apply_fn: ``apply_fn(params, tokens[B, T], positions[B, T]) -> logits[B, T, V]``.
      optimizer: an optax transformation.
      loss_fn: ``loss_fn(logprobs, old_logprobs, advantages, mask, **loss_kwargs) -> (loss, metrics)``
        (normally ``jaxprm.policy_loss``).
      epochs, num_minibatches: PPO passes over the batch and minibatches per pass.
      loss_kwargs: static keyword options for ``loss_fn`` (eps_clip, eps_clip_higher, c_clip, agg).
      mesh: optional ``("data", "fsdp")`` mesh.
      microbatch_rows: gradient accumulation inside a minibatch (bounds activation memory); the
        accumulated gradient equals the minibatch gradient because each microbatch contributes
        ``loss_sum_i / denom`` with ``denom`` the minibatch's token (or sequence) count. Requires
        ``loss_fn`` metrics ``loss_count`` and the ``*_sum`` numerators (as ``jaxprm.policy_loss``).
      entropy_coef: an entropy bonus ``c``: the minibatch objective is ``loss - c * H`` with ``H``
        the token mean, over the minibatch's active tokens (whatever ``agg``), of the policy's
        next-token entropy ``-sum_v p log p``. The ``entropy`` metric is that mean (reported for
        any ``c``; with ``c = 0`` it carries no gradient).
      behaviour: decoupled PPO (AReaL): ``{"cap": float | None, "mode": str}`` (see
        ``jaxprm.behaviour_weights``). ``data`` then carries ``proximal_logprobs`` (the learner's
        own log-probs before the step), the ratio is taken against them and each token's loss is
        weighted by ``exp(proximal - old)`` capped; ``loss_fn`` is ``jaxprm.decoupled_policy_loss``
        in place of the given one. Metrics gain ``behave_gap`` (mean ``|proximal - old|``) and
        ``behave_capped_fraction``.
      target_kl: PPO's early stop: a minibatch whose approx KL (k3, token mean, measured at the
        params before its update) is above ``1.5 * target_kl`` is not applied, nor is any later
        minibatch of the step (``kl_stopped`` counts them; ``updates`` counts those applied).
      frozen: weights ``apply_fn`` needs but the step does not train (LoRA's base, ``Policy.base``):
        ``apply_fn`` then gets ``(params, frozen)``; they are an argument of every call (never
        donated, never updated, not in the state, so not in the optimizer or the checkpoints).
    """

    def __init__(
        self,
        apply_fn: Callable,
        optimizer: optax.GradientTransformation,
        loss_fn: Callable,
        *,
        epochs: int = 1,
        num_minibatches: int = 1,
        loss_kwargs: dict | None = None,
        mesh: Mesh | None = None,
        logprob_fn: Callable = next_token_logprobs,
        microbatch_rows: int | None = None,
        entropy_coef: float = 0.0,
        behaviour: dict | None = None,
        target_kl: float | None = None,
        frozen: Any = None,
    ) -> None:
        if not entropy_coef >= 0:
            raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef}")
        self.apply_fn = apply_fn
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.epochs = int(epochs)
        self.num_minibatches = int(num_minibatches)
        self.loss_kwargs = dict(loss_kwargs or {})
        self.mesh = mesh
        self.logprob_fn = logprob_fn
        self.microbatch_rows = microbatch_rows
        self.entropy_coef = float(entropy_coef)
        if target_kl is not None and not target_kl > 0:
            raise ValueError(f"target_kl must be > 0 (or None), got {target_kl}")
        self.target_kl = None if target_kl is None else float(target_kl)
        self.behaviour = None if behaviour is None else {"cap": behaviour.get("cap"), "mode": behaviour.get("mode", "truncate")}
        if self.behaviour is not None:
            if self.behaviour["mode"] not in BEHAVIOUR_WEIGHT_MODES:
                raise ValueError(f"behaviour mode must be one of {BEHAVIOUR_WEIGHT_MODES}, got {self.behaviour['mode']!r}")
            self.SUM_KEYS = (*self.SUM_KEYS, "behave_gap_sum", "behave_capped_sum")
        self.frozen = frozen
        self.compiles = 0  # number of traces of the step (one per distinct input shape)
        self._jitted = None
        self._state_shardings = None

    # -- state -------------------------------------------------------------------------------
    def init_state(self, params: Any) -> TrainState:
        params = jax.tree.map(jnp.copy, params)  # the step donates its state: never alias the caller's
        state = TrainState(params=params, opt_state=self.optimizer.init(params), step=jnp.zeros((), jnp.int32))
        if self.mesh is not None:
            state = jax.device_put(state, self.state_shardings(state))
        return state

    def state_shardings(self, state: TrainState):
        if self._state_shardings is None:
            assert self.mesh is not None
            self._state_shardings = shard_params(state, self.mesh)
        return self._state_shardings

    def batch_sharding(self) -> NamedSharding | None:
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, P(("data", "fsdp")))

    # -- the step ----------------------------------------------------------------------------
    # The hooks below are what a row layout changes (``PackedTrainStep`` overrides them); ``_step``
    # is the one epochs x minibatches x microbatches loop both layouts share.
    SUM_KEYS = ("loss_sum", "loss_count", "n_valid_tokens", "clip_sum", "dual_clip_sum", "approx_kl_sum", "ratio_sum",
                "entropy_sum")

    def _micro_rows(self, mb_rows: int, T: int) -> int:
        """Rows per gradient-accumulation chunk (a divisor of ``mb_rows``)."""
        micro = mb_rows if not self.microbatch_rows else min(self.microbatch_rows, mb_rows)
        if mb_rows % micro:
            raise ValueError(f"minibatch rows {mb_rows} not divisible by ppo.microbatch_rows={micro}")
        return micro

    def _minibatch(self, data: dict, order: jax.Array, n_real: jax.Array, k: jax.Array, mb_rows: int, n_mb: int) -> dict:
        """Minibatch ``k``'s rows (see :func:`minibatch_rows`), slots without a real row masked out."""
        mb, valid = minibatch_rows(data, order, n_real, k, mb_rows, n_mb)
        mb["loss_mask"] = mb["loss_mask"] * valid[:, None].astype(mb["loss_mask"].dtype)
        return mb

    def _counts(self, mb: dict) -> tuple[jax.Array, jax.Array]:
        """``(active tokens, active sequences)`` of a minibatch: the ``token-mean`` and the
        seq-mean denominators."""
        mask = mb["loss_mask"]
        return mask.sum(), (mask.sum(axis=1) > 0).sum()

    def _micro_loss(self, params: Any, mc: dict):
        """``loss_fn`` on one microbatch: forward, per-token log-probs, ``(loss, metrics,
        entropy_sum)`` with ``entropy_sum`` the next-token entropy summed over the active tokens."""
        tokens = mc["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits = self.apply_fn(params, tokens, positions)
        logp = self.logprob_fn(logits, tokens)
        if self.behaviour is not None:
            loss, metrics = decoupled_policy_loss(
                logp, mc["proximal_logprobs"], mc["old_logprobs"], mc["advantages"], mc["loss_mask"],
                behave_cap=self.behaviour["cap"], behave_mode=self.behaviour["mode"], **self.loss_kwargs)
        else:
            loss, metrics = self.loss_fn(logp, mc["old_logprobs"], mc["advantages"], mc["loss_mask"],
                                         **self.loss_kwargs)
        active = (mc["loss_mask"] > 0).astype(jnp.float32)
        return loss, metrics, jnp.sum(self._entropy(logits) * active)

    def _entropy(self, logits: jax.Array) -> jax.Array:
        """Per-position entropy, with a gradient only when the bonus is on."""
        if self.entropy_coef == 0:
            logits = jax.lax.stop_gradient(logits)
        return entropy_of(logits)

    def _step(self, state: TrainState, data: dict, rng: jax.Array, frozen: Any = None):
        if not in_background():  # runs at trace time only; ahead-of-time compiles are not counted
            self.compiles += 1
        B, T = data["tokens"].shape
        n_mb = self.num_minibatches
        if B % n_mb:
            raise ValueError(f"batch rows {B} not divisible by ppo.num_minibatches={n_mb}")
        mb_rows = B // n_mb
        real = data["row_weights"] > 0
        n_real = real.sum().astype(jnp.int32)
        micro = self._micro_rows(mb_rows, T)
        n_micro = mb_rows // micro
        per_seq = self.loss_kwargs.get("agg", "token-mean") != "token-mean"

        def micro_objective(params, mc, denom, n_tokens):
            # loss_i * count_i / denom summed over microbatches == the minibatch's aggregated loss
            loss, metrics, ent_sum = self._micro_loss(params if frozen is None else (params, frozen), mc)
            metrics = {**metrics, "entropy_sum": jax.lax.stop_gradient(ent_sum)}
            objective = loss * jnp.maximum(metrics["loss_count"], 1.0) / denom
            if self.entropy_coef:
                objective = objective - self.entropy_coef * ent_sum / n_tokens
            return objective, metrics

        grad_fn = jax.grad(micro_objective, has_aux=True)

        def mb_update(carry, xs):
            params, opt_state, go = carry
            order, k = xs
            mb = self._minibatch(data, order, n_real, k, mb_rows, n_mb)
            tokens, seqs = self._counts(mb)
            denom = jnp.maximum(seqs if per_seq else tokens, 1.0)
            chunks = jax.tree.map(lambda v: v.reshape((n_micro, micro) + v.shape[1:]), mb)

            def acc(carry2, mc):
                g_acc, s_acc = carry2
                g, met = grad_fn(params, mc, denom, jnp.maximum(tokens, 1.0))
                g_acc = jax.tree.map(jnp.add, g_acc, g)
                s_acc = {key: s_acc[key] + met[key] for key in s_acc}
                return (g_acc, s_acc), None

            zeros_g = jax.tree.map(jnp.zeros_like, params)
            zeros_s = {key: jnp.zeros((), jnp.float32) for key in self.SUM_KEYS}
            (grads, sums), _ = jax.lax.scan(acc, (zeros_g, zeros_s), chunks)
            gnorm = optax.global_norm(grads)
            updates, new_opt = self.optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            active = tokens > 0
            nv = jnp.maximum(sums["n_valid_tokens"], 1.0)
            if self.target_kl is not None:  # early stop: this minibatch and every later one of the step
                go = go & (sums["approx_kl_sum"] / nv <= 1.5 * self.target_kl)
            applied = active & go
            keep = lambda new, old: jnp.where(applied, new, old)  # noqa: E731
            params = jax.tree.map(keep, new_params, params)
            opt_state = jax.tree.map(keep, new_opt, opt_state)
            out = {"loss": sums["loss_sum"] / jnp.maximum(sums["loss_count"], 1.0), "grad_norm": gnorm,
                   "clip_fraction": sums["clip_sum"] / nv, "dual_clip_fraction": sums["dual_clip_sum"] / nv,
                   "approx_kl": sums["approx_kl_sum"] / nv, "ratio_mean": sums["ratio_sum"] / nv,
                   "entropy": sums["entropy_sum"] / nv,
                   "active": active.astype(jnp.float32), "applied": applied.astype(jnp.float32), "tokens": tokens}
            if self.behaviour is not None:
                out.update(behave_gap=sums["behave_gap_sum"] / nv, behave_capped_fraction=sums["behave_capped_sum"] / nv)
            return (params, opt_state, go), out

        def epoch(carry, key):
            u = jax.random.uniform(key, (B,))
            order = jnp.argsort(jnp.where(real, u, 2.0))
            orders = jnp.broadcast_to(order, (n_mb, B))
            return jax.lax.scan(mb_update, carry, (orders, jnp.arange(n_mb)))

        keys = jax.random.split(rng, self.epochs)
        go0 = jnp.ones((), bool)
        (params, opt_state, _), outs = jax.lax.scan(epoch, (state.params, state.opt_state, go0), keys)
        w = outs["active"]
        denom = jnp.maximum(w.sum(), 1.0)
        metrics = {k2: (v * w).sum() / denom for k2, v in outs.items() if k2 not in ("active", "applied", "tokens")}
        metrics["updates"] = outs["applied"].sum()
        if self.target_kl is not None:  # minibatches with tokens whose update the KL stop skipped
            metrics["kl_stopped"] = w.sum() - outs["applied"].sum()
        # The first minibatch is scored before any update: its KL measures how far the sampler's
        # logprobs are from the learner's own (numerics, stale weights); it should be ~0.
        metrics["behavior_kl"] = outs["approx_kl"][0, 0]
        metrics["trained_tokens"] = outs["tokens"].sum() / self.epochs
        new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1)
        return new_state, metrics

    def _build(self, state: TrainState):
        if self.mesh is None:
            return jax.jit(self._step, donate_argnums=(0,))
        st = self.state_shardings(state)
        bs = self.batch_sharding()
        rep = NamedSharding(self.mesh, P())
        fr = None if self.frozen is None else shard_params(self.frozen, self.mesh)
        return jax.jit(self._step, in_shardings=(st, bs, rep, fr), out_shardings=(st, rep), donate_argnums=(0,))

    def lower(self, state: Any, data: dict, rng: Any):
        """The step lowered for these inputs (arrays or ``jax.ShapeDtypeStruct`` specs), as a call
        with them would be: ``step.lower(...).compile()`` compiles ahead of time (into the
        persistent cache, where it is on)."""
        if self._jitted is None:
            self._jitted = self._build(state)
        if self.mesh is not None:
            with self.mesh:
                return self._jitted.lower(state, data, rng, self.frozen)
        return self._jitted.lower(state, data, rng, self.frozen)

    def __call__(self, state: TrainState, data: dict, rng: jax.Array):
        """One learner step on ``data`` (see :func:`step_inputs`); returns ``(state, metrics)``."""
        if self._jitted is None:
            self._jitted = self._build(state)
        if self.mesh is not None:
            data = jax.device_put(data, self.batch_sharding())
            with self.mesh:
                return self._jitted(state, data, rng, self.frozen)
        return self._jitted(state, data, rng, self.frozen)


_JITTED: dict[tuple[int, str], tuple[Callable, Callable]] = {}


def jitted_for(apply_fn: Callable, kind: str, build: Callable[[Callable], Callable]) -> Callable:
    """``jax.jit(build(apply_fn))``, made once per ``(apply_fn, kind)`` and reused (the entry keeps
    ``apply_fn`` alive, so its ``id`` is never another model's)."""
    key = (id(apply_fn), kind)
    if key not in _JITTED:
        _JITTED[key] = (apply_fn, jax.jit(build(apply_fn)))
    return _JITTED[key][1]


def reference_logprobs(apply_fn: Callable, params: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-token log-probs ``[B, T]`` of ``tokens`` under ``params`` (the KL reference policy), one
    jitted forward per ``apply_fn``."""
    fn = jitted_for(apply_fn, "flat_logprobs", lambda f: lambda p, t, q: next_token_logprobs(f(p, t, q), t))
    return fn(params, tokens, positions)


def param_count(params: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params) if hasattr(x, "shape")))
