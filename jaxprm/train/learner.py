"""``Learner``: the policy's train state and its update, for the trainer.

It owns what a step of learning needs and nothing of the orchestration around it:
- the flat ``TrainStep`` and, for ``rollout.export: tree_packed``, the ``PackedTrainStep`` made
  like it (built here, once), under the configured mesh;
- the train state (params, optimizer state, step), the KL reference params and the base PRNG key,
  with their checkpoint tree;
- one update from groups, from rows (agent rollouts) or from a padded batch: export, reference
  (and, decoupled, proximal) log-probs, ``jaxprm.compute_advantages``, the PPO step;
- the packed learner's neighbouring shapes, handed to the background compiler after each step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import jaxprm
from jaxprm.train import adapters, multihost
from jaxprm.train.compilation import BackgroundCompiler
from jaxprm.train.config import TrainConfig
from jaxprm.train.packed import (PackedTrainStep, layout_costs, packed_reference_logprobs, packed_row_buckets,
                                 packed_step_inputs, precompile_neighbours, prefer_packed)
from jaxprm.train.policy import Policy
from jaxprm.train.step import TrainStep, make_optimizer, reference_logprobs, shard_params, step_inputs
from rollout.export import export_groups, export_groups_packed

__all__ = ["Learner"]


class Learner:
    """The train state of ``policy`` and its PPO update (see the module docstring).

    ``mesh``: the device mesh of the step; ``multi``: a multi-process run (forwards with the global
    params then take global inputs); ``precompiler``: compiles neighbouring packed shapes in the
    background (or ``None``). After construction, :meth:`start` sets the initial params (warm
    started) or :meth:`restore` a checkpoint's."""

    def __init__(self, cfg: TrainConfig, policy: Policy, mesh: jax.sharding.Mesh, *, multi: bool,
                 precompiler: BackgroundCompiler | None = None) -> None:
        self.cfg, self.policy, self.mesh, self.multi, self.precompiler = cfg, policy, mesh, multi, precompiler
        n_dev = mesh.devices.size
        self.capacity = adapters.row_capacity(cfg, n_dev)
        self.row_multiple = math.lcm(cfg.ppo.num_minibatches, n_dev)
        ppo = cfg.ppo
        # the learner's forward (remat, compute dtype): the step and its reference / proximal log-probs alike
        self.apply_fn = policy.learner_apply_fn(remat=ppo.remat, compute_dtype=cfg.model.compute_dtype)
        self.flat_step = TrainStep(
            self.apply_fn, make_optimizer(cfg.optimizer, adapters.total_updates(cfg)), jaxprm.policy_loss,
            epochs=ppo.epochs, num_minibatches=ppo.num_minibatches, loss_kwargs=adapters.loss_kwargs(cfg),
            mesh=mesh if n_dev > 1 else None, microbatch_rows=ppo.microbatch_rows, entropy_coef=ppo.entropy_coef,
            behaviour={"cap": ppo.behave_cap, "mode": ppo.behave_mode} if ppo.decoupled else None,
            target_kl=ppo.target_kl, frozen=policy.base)  # LoRA: the frozen weights, an argument of the step
        self.packed_step = None
        if cfg.rollout.export == "tree_packed":  # shared prefixes forwarded once (jaxprm.train.packed)
            microbatch_tokens = (ppo.microbatch_rows or 0) * max(ppo.len_buckets) or None
            self.packed_step = PackedTrainStep.like(self.flat_step, microbatch_tokens=microbatch_tokens)
        self.adv_cfg = adapters.advantage_config(cfg)
        self.state: Any = None
        self.ref_params: Any = None
        self.base_key = jax.random.key(cfg.seed)

    # -- state ----------------------------------------------------------------------------------
    def start(self, params: Any) -> None:
        """Initial train state from ``params`` (and, with ``advantage.kl_ctl > 0``, the KL
        reference: a copy of them)."""
        if self.cfg.advantage.kl_ctl > 0:
            self.ref_params = jax.tree.map(jnp.copy, params)
            if self.multi:  # global arrays, as the learner's own: its forward runs on the whole mesh
                self.ref_params = jax.device_put(self.ref_params, shard_params(self.ref_params, self.mesh))
        self.state = self.flat_step.init_state(params)
        self.policy.params = self.state.params

    def checkpoint_tree(self) -> dict[str, Any]:
        """What a checkpoint saves of the learner (also the restore target)."""
        tree = {"train": self.state, "rng": self._replicated(jax.random.key_data(self.base_key))}
        if self.ref_params is not None:
            tree["ref"] = self.ref_params
        return tree

    def restore(self, restored: dict[str, Any]) -> None:
        """Take a restored :meth:`checkpoint_tree`."""
        self.state = restored["train"]
        self.base_key = jax.random.wrap_key_data(multihost.local_array(restored["rng"]))
        self.ref_params = restored.get("ref", self.ref_params)
        self.policy.params = self.state.params

    def skip_step(self) -> None:
        """A step with nothing to learn from still counts (the optimizer schedule's step)."""
        self.state = dataclasses.replace(self.state, step=self.state.step + 1)

    def host_params(self) -> Any:
        """This host's copy of the current weights (the policy's, in a single-process run)."""
        return multihost.host_copy(self.state.params) if self.multi else self.state.params

    # -- learning -------------------------------------------------------------------------------
    def learn_groups(self, groups, step: int) -> dict[str, float]:
        """One update from rolled-out groups (with the process rewards they carry, if scored)."""
        if self.packed_step is not None:
            return self._learn_packed(groups, step)
        batch, meta = export_groups(
            groups, row_buckets=(self.capacity,), len_buckets=tuple(self.cfg.ppo.len_buckets), min_rows=self.capacity)
        return self.learn_batch(batch, len(meta), step)

    def learn_rows(self, rows, step: int) -> dict[str, float]:
        """One update from ``jaxprm.RowData`` rows (agent rollouts), through the flat path."""
        batch = jaxprm.pad_rows(rows, row_buckets=(self.capacity,), len_buckets=tuple(self.cfg.ppo.len_buckets),
                                min_rows=self.capacity)
        return self.learn_batch(batch, len(rows), step)

    def learn_batch(self, batch: jaxprm.Batch, n_rows: int, step: int) -> dict[str, float]:
        """One update from a padded batch: reference log-probs, advantages, the flat PPO step."""
        batch = self._with_reference(batch, use_packed=False, packed=None)
        adv = jaxprm.compute_advantages(batch, self.adv_cfg)
        data = step_inputs(batch, adv.advantages, adv.loss_weights)
        if self.cfg.ppo.decoupled:  # the proximal policy: this step's weights, before it updates them
            data["proximal_logprobs"] = self._flat_logprobs(self.state.params, batch)
        self.state, m = self.flat_step(self.state, data, self._key(step))
        return {**self._finish(m, batch, adv), "rows": n_rows}

    def _learn_packed(self, groups, step: int) -> dict[str, float]:
        """``rollout.export: tree_packed``: the groups exported flat (for ``compute_advantages``) and
        packed (for the model); the step trains on the packed rows unless ``layout_costs`` estimates
        the flat ones clearly cheaper (``prefer_packed``)."""
        ppo = self.cfg.ppo
        batch, packed, meta = export_groups_packed(
            groups, row_buckets=(self.capacity,), len_buckets=tuple(ppo.len_buckets), min_rows=self.capacity,
            packed_row_buckets=packed_row_buckets(self.row_multiple), packed_len_buckets=tuple(ppo.packed_len_buckets))
        flat_tokens, packed_tokens = int(batch.seq_lens.sum()), int(packed.lengths.sum())
        flat_cost, packed_cost = layout_costs(self.policy.config, batch.tokens.shape, packed.shape, packed.block_shape)
        use_packed = prefer_packed(flat_cost, packed_cost)
        batch = self._with_reference(batch, use_packed=use_packed, packed=packed)
        adv = jaxprm.compute_advantages(batch, self.adv_cfg)
        key = self._key(step)
        if use_packed:
            inputs = packed_step_inputs(packed, batch, adv.advantages, agg=ppo.agg, loss_weights=adv.loss_weights)
            if ppo.decoupled:  # the proximal policy: this step's weights, before it updates them
                inputs["proximal_logprobs"] = packed_reference_logprobs(
                    self.apply_fn, self.policy.with_frozen(self.state.params), packed, self.on_mesh)
            self.state, m = self.packed_step(self.state, inputs, key)
            if self.precompiler is not None:
                R, N, S = inputs["key_blocks"].shape
                self.precompiler.mark(("packed_step", R, inputs["tokens"].shape[1], N, S))
                precompile_neighbours(self.precompiler, self.packed_step, self.state, inputs, key,
                                      packed_row_buckets(self.row_multiple), ppo.len_buckets)
        else:
            data = step_inputs(batch, adv.advantages, adv.loss_weights)
            if ppo.decoupled:
                data["proximal_logprobs"] = self._flat_logprobs(self.state.params, batch)
            self.state, m = self.flat_step(self.state, data, key)
        out = self._finish(m, batch, adv)
        out.update(packed_step=float(use_packed), rows=len(meta), packed_rows=int((packed.row_weights > 0).sum()),
                   packed_len=int(packed.tokens.shape[1]), packed_blocks=int(packed.query_blocks.shape[1]),
                   forwarded_tokens=packed_tokens if use_packed else flat_tokens, flat_tokens=flat_tokens,
                   packed_cost_ratio=packed_cost / flat_cost)
        return out

    def on_mesh(self, x: jax.Array) -> jax.Array:
        """Rows ``x [B, ...]`` as a global array split over the mesh, in a multi-process run (where a
        forward with the learner's global params must see global inputs); else ``x``."""
        return jax.device_put(x, self.flat_step.batch_sharding()) if self.multi else x

    # -- pieces ---------------------------------------------------------------------------------
    def _key(self, step: int) -> jax.Array:
        return jax.random.fold_in(self.base_key, step)

    def _flat_logprobs(self, params: Any, batch: jaxprm.Batch) -> jax.Array:
        pos = jnp.broadcast_to(jnp.arange(batch.tokens.shape[1], dtype=jnp.int32), batch.tokens.shape)
        return reference_logprobs(self.apply_fn, self.policy.with_frozen(params), self.on_mesh(batch.tokens),
                                  self.on_mesh(pos))

    def _with_reference(self, batch: jaxprm.Batch, *, use_packed: bool, packed) -> jaxprm.Batch:
        """``batch`` with the KL reference's log-probs (masked), when the KL reward is on."""
        if self.ref_params is None:
            return batch
        if use_packed:
            ref = multihost.local_array(
                packed_reference_logprobs(self.apply_fn, self.policy.with_frozen(self.ref_params), packed, self.on_mesh))
            ref = jaxprm.learner.gather_to_flat(ref, packed.flat_index)
        else:
            ref = multihost.local_array(self._flat_logprobs(self.ref_params, batch))
        return batch.replace(ref_logprobs=ref * batch.loss_mask)

    def _finish(self, metrics: Any, batch: jaxprm.Batch, adv: jaxprm.Advantages) -> dict[str, float]:
        """The new weights to the policy; the step's metrics as floats, with the batch's."""
        self.policy.params = self.state.params
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        active = jnp.maximum(batch.loss_mask.sum(), 1)
        out["seq_len"] = int(batch.tokens.shape[1])
        out["adv_abs_mean"] = float(jnp.sum(jnp.abs(adv.advantages) * batch.loss_mask) / active)
        if self.cfg.prm.active:
            out["process_reward_mean"] = float(jnp.sum(batch.process_rewards) / active)
        return out

    def _replicated(self, x: jax.Array) -> jax.Array:
        """``x`` (the same on every process) as a global array replicated over the mesh, in a
        multi-process run (what orbax saves once for all processes); else ``x``."""
        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec())) if self.multi else x
