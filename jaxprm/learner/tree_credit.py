"""Credit over the turns of a rollout tree: the tree-aware advantage terms (layer 1, pure and jitted).

A group's rollouts form a tree: a node per generated turn, whose parent is the turn before it on
the same branch (the group's prompt, its *root*, for a first turn), and whose *leaves* are the
finished branches (rows) that pass through it. A turn shared by several rows (PaTR copies a
parent's turns into its children) is one node. The arrays here are turn-level, ``[B, D]``:

* ``turn_nodes[b, d]``: the node id (in ``[0, num_nodes)``) of turn ``d`` of row ``b``, -1 where
  the row has no turn ``d`` (and on every turn of a padding row). Rows that share a turn carry the
  same id there; ids are unique across groups. Node ``turn_nodes[b, d - 1]`` is the parent of
  ``turn_nodes[b, d]``; the parent of a first turn is the root of the row's group.
* ``rewards[b]``: the outcome of row ``b`` (its leaf).

From them: ``V(n)``, the mean outcome of the leaves under ``n`` (for the root, of the group's
rows), and ``L(n)``, their number. The terms:

* :func:`tree_value_advantages` (TreeRL, arXiv 2506.11902): the tokens of the turn ending at ``n``
  get ``((V(n) - V(root)) + (V(n) - V(parent(n)))) / sqrt(L(n))``; with the copies of a shared
  turn weighted ``1 / L(n)`` (the returned weights) every shared token counts once.
* :func:`sibling_advantages` (after Tree-GRPO, arXiv 2509.21240, and TreePO, arXiv 2508.17445): at
  each branching *inner* node, each child's value against its siblings',
  ``(V(c) - mean_sib V) / (std_sib V + eps)`` (population std over the node's children), carried by
  every turn of the child's segment (down to the next branching node). The root's children are
  left out: the group-level leaf advantage this term is added to already compares them.
* :func:`anchor_state_advantages` (GiGPO, arXiv 2505.10978): turns that start from the same
  environment state (``turn_states``, ids of hashed states) form a step group; a turn's
  discounted return from there is normalized in its step group, ``(G - mean_k) / (std_k + eps)``
  (weighted population std; 0 in a step group of one).

:func:`turn_to_tokens` spreads a turn-level array over the tokens of each turn (``turn_ids``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxprm.learner._checks import check_float, check_rank, check_same_shape

__all__ = ["node_values", "tree_value_advantages", "sibling_advantages", "anchor_state_advantages",
           "turn_to_tokens"]


def _check_tree(rewards: jax.Array, turn_nodes: jax.Array, group_ids: jax.Array | None = None) -> None:
    check_rank("rewards", rewards, 1)
    check_rank("turn_nodes", turn_nodes, 2)
    check_float("rewards", rewards)
    if jnp.shape(turn_nodes)[0] != jnp.shape(rewards)[0]:
        raise ValueError(f"turn_nodes {jnp.shape(turn_nodes)} and rewards {jnp.shape(rewards)} disagree on rows")
    if group_ids is not None:
        check_same_shape(rewards=rewards, group_ids=group_ids)


def _segment_mean(x: jax.Array, ids: jax.Array, n: int, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted mean of ``x`` per segment (ids ``n`` are dropped) and the weight total."""
    x, ids, weights = x.reshape(-1), ids.reshape(-1), weights.reshape(-1)
    s = jax.ops.segment_sum(x * weights, ids, num_segments=n + 1)[:n]
    w = jax.ops.segment_sum(weights, ids, num_segments=n + 1)[:n]
    return s / jnp.where(w > 0, w, 1.0), w


@functools.partial(jax.jit, static_argnames=("num_nodes",))
def node_values(rewards: jax.Array, turn_nodes: jax.Array, *, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """``V [num_nodes]``, the mean outcome of the rows through each node, and ``L [num_nodes]``,
    their number (0 for unused ids). Shapes ``[B], [B, D] -> [N], [N]``."""
    _check_tree(rewards, turn_nodes)
    dt = jnp.result_type(rewards, jnp.float32)
    valid = turn_nodes >= 0
    ids = jnp.where(valid, turn_nodes, num_nodes)
    r = jnp.broadcast_to(rewards.astype(dt)[:, None], turn_nodes.shape)
    return _segment_mean(r, ids, num_nodes, valid.astype(dt))


def _root_values(rewards, turn_nodes, group_ids, num_groups, dt):
    """Per row: the mean outcome of its group's rows (rows with a first turn)."""
    real = (turn_nodes[:, 0] >= 0).astype(dt)
    v, _ = _segment_mean(rewards.astype(dt), jnp.where(real > 0, group_ids, num_groups), num_groups, real)
    return v[group_ids]


def _previous(turn_nodes):
    """The node of each turn's previous turn, its parent (-1 for a first turn: the root)."""
    return jnp.concatenate([jnp.full_like(turn_nodes[:, :1], -1), turn_nodes[:, :-1]], axis=1)


@functools.partial(jax.jit, static_argnames=("num_groups", "num_nodes"))
def tree_value_advantages(rewards: jax.Array, turn_nodes: jax.Array, group_ids: jax.Array, *,
                          num_groups: int, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """TreeRL's turn advantages and the copies' weights, both ``[B, D]`` (0 where ``turn_nodes``
    is -1): ``A = ((V(n) - V(root)) + (V(n) - V(parent))) / sqrt(L(n))`` and ``w = 1 / L(n)``.

    ``sum_b w[b, d] * A[b, d]`` over the copies of a node is its one advantage, so a loss that
    weights each flat token copy by ``w`` equals the loss on the packed tree, where the node's
    tokens appear once. A group with no branching below the root (flat GRPO) gets
    ``2 (r - mean_g r)`` on each first turn and ``r - mean_g r`` on every later one."""
    _check_tree(rewards, turn_nodes, group_ids)
    dt = jnp.result_type(rewards, jnp.float32)
    v, n_leaves = node_values(rewards.astype(dt), turn_nodes, num_nodes=num_nodes)
    v_root = _root_values(rewards, turn_nodes, group_ids, num_groups, dt)
    node = jnp.maximum(turn_nodes, 0)
    valid = turn_nodes >= 0
    prev = _previous(turn_nodes)
    v_par = jnp.where(prev >= 0, v[jnp.maximum(prev, 0)], v_root[:, None])
    leaves = jnp.where(valid, n_leaves[node], 1.0)
    adv = ((v[node] - v_root[:, None]) + (v[node] - v_par)) / jnp.sqrt(leaves)
    return jnp.where(valid, adv, 0.0), jnp.where(valid, 1.0 / leaves, 0.0)


@functools.partial(jax.jit, static_argnames=("num_nodes", "eps"))
def sibling_advantages(rewards: jax.Array, turn_nodes: jax.Array, *, num_nodes: int,
                       eps: float = 1e-6) -> jax.Array:
    """The sibling term ``[B, D]`` (0 where ``turn_nodes`` is -1): at each inner node with two or
    more children, ``z(c) = (V(c) - mean V) / (std V + eps)`` over its children ``c`` (population
    std, each child once); a turn carries ``z`` of the child that starts its segment, i.e. its own
    ``z`` if its parent branches, else its parent's turn's term (0 below the root's children)."""
    _check_tree(rewards, turn_nodes)
    dt = jnp.result_type(rewards, jnp.float32)
    v, n_leaves = node_values(rewards.astype(dt), turn_nodes, num_nodes=num_nodes)
    valid = turn_nodes >= 0
    prev = _previous(turn_nodes)
    # parent id of every node (num_nodes for the root's children and unused ids), from any copy
    par_of = jax.ops.segment_max(jnp.where(valid & (prev >= 0), prev, -1).reshape(-1),
                                 jnp.where(valid, turn_nodes, num_nodes).reshape(-1),
                                 num_segments=num_nodes + 1)[:num_nodes]
    used = n_leaves > 0
    par_seg = jnp.where(used & (par_of >= 0), par_of, num_nodes)
    ones = used.astype(dt)
    mean, n_children = _segment_mean(v, par_seg, num_nodes, ones)
    sq, _ = _segment_mean((v - mean[jnp.minimum(par_seg, num_nodes - 1)]) ** 2, par_seg, num_nodes, ones)
    inner = par_seg < num_nodes
    p = jnp.minimum(par_seg, num_nodes - 1)
    z = jnp.where(inner, (v - mean[p]) / (jnp.sqrt(sq[p]) + eps), 0.0)
    branches = jnp.where(inner, n_children[p] >= 2, False)
    node = jnp.maximum(turn_nodes, 0)
    out = []
    carry = jnp.zeros(turn_nodes.shape[0], dt)
    for d in range(turn_nodes.shape[1]):
        carry = jnp.where(branches[node[:, d]], z[node[:, d]], carry)
        carry = jnp.where(valid[:, d], carry, 0.0)
        out.append(carry)
    return jnp.stack(out, axis=1)


@functools.partial(jax.jit, static_argnames=("num_states", "eps"))
def anchor_state_advantages(turn_returns: jax.Array, turn_states: jax.Array, *, num_states: int,
                            weights: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """GiGPO's step advantage ``[B, D]``: ``(G - mean_k G) / (std_k G + eps)`` over the turns of
    step group ``k = turn_states[b, d]`` (a state id in ``[0, num_states)``, -1 for no turn),
    ``weights``-weighted (``1 / L(n)`` for a tree's shared copies; default 1) with the population
    std; 0 in a step group of one turn and where ``turn_states`` is -1. ``turn_returns``: each
    turn's discounted return from its start, ``[B, D]``."""
    check_rank("turn_returns", turn_returns, 2)
    check_float("turn_returns", turn_returns)
    check_same_shape(turn_returns=turn_returns, turn_states=turn_states)
    dt = jnp.result_type(turn_returns, jnp.float32)
    valid = turn_states >= 0
    w = jnp.ones(turn_states.shape, dt) if weights is None else jnp.asarray(weights, dt)
    w = jnp.where(valid, w, 0.0).reshape(-1)
    ids = jnp.where(valid, turn_states, num_states).reshape(-1)
    g = turn_returns.astype(dt).reshape(-1)
    mean, _ = _segment_mean(g, ids, num_states, w)
    k = jnp.minimum(ids, num_states - 1)
    sq, _ = _segment_mean((g - mean[k]) ** 2, ids, num_states, w)
    count = jax.ops.segment_sum(valid.reshape(-1).astype(dt), ids, num_segments=num_states + 1)[:num_states]
    a = (g - mean[k]) / (jnp.sqrt(sq[k]) + eps)
    a = jnp.where(valid.reshape(-1) & (count[k] > 1), a, 0.0)
    return a.reshape(turn_states.shape)


@jax.jit
def turn_to_tokens(turn_values: jax.Array, turn_ids: jax.Array) -> jax.Array:
    """``out[b, t] = turn_values[b, turn_ids[b, t]]``, 0 where ``turn_ids`` is -1 (or beyond D).
    Shapes ``[B, D], [B, T] -> [B, T]``."""
    check_rank("turn_values", turn_values, 2)
    check_rank("turn_ids", turn_ids, 2)
    D = turn_values.shape[1]
    ok = (turn_ids >= 0) & (turn_ids < D)
    out = jnp.take_along_axis(turn_values, jnp.clip(turn_ids, 0, D - 1), axis=1)
    return jnp.where(ok, out, 0.0)
