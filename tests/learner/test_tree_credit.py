"""Tree credit (``jaxprm.learner.tree_credit``) against a float64 reference on random trees, and its
properties: no branching, permuted siblings, a constant reward shift, distinct anchor states."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprm.learner.tree_credit import (anchor_state_advantages, node_values, sibling_advantages,
                                        tree_value_advantages, turn_to_tokens)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


# --- random trees and the reference ------------------------------------------------------------

def random_forest(rng, groups=3, max_nodes=9, branch=0.7):
    """Per group a random tree of turns: ``parent[n]`` (-1: the group's root), node ids unique
    over the groups. Returns (parent, group_of_node, leaf rows as node paths, row group ids)."""
    parent, group_of = [], []
    rows, row_groups = [], []
    for g in range(groups):
        first = len(parent)
        for i in range(int(rng.integers(1, max_nodes + 1))):
            mine = list(range(first, len(parent)))
            p = int(rng.choice(mine)) if mine and rng.random() < branch else -1
            parent.append(p)
            group_of.append(g)
        nodes = range(first, len(parent))
        has_child = {parent[n] for n in nodes}
        for leaf in nodes:
            if leaf in has_child:
                continue
            path, n = [], leaf
            while n >= 0:
                path.append(n)
                n = parent[n]
            rows.append(path[::-1])
            row_groups.append(g)
    return parent, group_of, rows, row_groups


def as_arrays(rows, row_groups, rewards, pad_rows=1):
    D = max(len(r) for r in rows)
    B = len(rows) + pad_rows
    tn = -np.ones((B, D), np.int32)
    for b, path in enumerate(rows):
        tn[b, :len(path)] = path
    r = np.concatenate([rewards, np.zeros(pad_rows)])
    g = np.array(list(row_groups) + [0] * pad_rows, np.int32)
    return r, tn, g


def ref_values(parent, rows, rewards):
    V, L = {}, {}
    for n in range(len(parent)):
        under = [rewards[b] for b, path in enumerate(rows) if n in path]
        L[n] = len(under)
        V[n] = float(np.mean(under)) if under else 0.0
    return V, L


def ref_tree_value(parent, rows, row_groups, rewards):
    V, L = ref_values(parent, rows, rewards)
    root = {g: float(np.mean([rewards[b] for b in range(len(rows)) if row_groups[b] == g])) for g in set(row_groups)}
    out = []
    for b, path in enumerate(rows):
        vr = root[row_groups[b]]
        out.append([((V[n] - vr) + (V[n] - (V[parent[n]] if parent[n] >= 0 else vr))) / np.sqrt(L[n]) for n in path])
    return out, [[1.0 / L[n] for n in path] for path in rows]


def ref_sibling(parent, rows, rewards, eps):
    V, _ = ref_values(parent, rows, rewards)
    children = {}
    for n, p in enumerate(parent):
        if p >= 0 and any(n in path for path in rows):
            children.setdefault(p, []).append(n)
    out = []
    for path in rows:
        term, turns = 0.0, []
        for n in path:
            sib = children.get(parent[n], []) if parent[n] >= 0 else []
            if len(sib) >= 2:
                vs = np.array([V[c] for c in sib])
                term = (V[n] - vs.mean()) / (vs.std() + eps)
            turns.append(term)
        out.append(turns)
    return out


def padded(lists, shape):
    out = np.zeros(shape)
    for b, xs in enumerate(lists):
        out[b, :len(xs)] = xs
    return out


SEEDS = range(8)


def random_case(seed, pad_rows=1):
    """A random forest, its leaves' rewards and its arrays (with ``pad_rows`` padding rows)."""
    rng = np.random.default_rng(seed)
    parent, _, rows, row_groups = random_forest(rng)
    rewards = rng.normal(size=len(rows))
    return (parent, rows, row_groups, rewards, *as_arrays(rows, row_groups, rewards, pad_rows=pad_rows))


@pytest.mark.parametrize("seed", SEEDS)
def test_tree_value_matches_the_reference(seed):
    parent, rows, row_groups, rewards, r, tn, g = random_case(seed)
    adv, w = tree_value_advantages(r, tn, g, num_groups=3, num_nodes=len(parent))
    ref_adv, ref_w = ref_tree_value(parent, rows, row_groups, rewards)
    np.testing.assert_allclose(np.asarray(adv), padded(ref_adv, tn.shape), atol=1e-12)
    np.testing.assert_allclose(np.asarray(w), padded(ref_w, tn.shape), atol=1e-12)
    # each node's weighted copies sum to its one advantage: the packed tree counts a shared turn once
    for n in range(len(parent)):
        copies = tn == n
        if copies.any():
            assert np.sum(np.asarray(w)[copies]) == pytest.approx(1.0)
            np.testing.assert_allclose(np.asarray(adv)[copies], np.asarray(adv)[copies][0])


@pytest.mark.parametrize("seed", SEEDS)
def test_sibling_matches_the_reference(seed):
    parent, rows, _, rewards, r, tn, _ = random_case(seed)
    got = sibling_advantages(r, tn, num_nodes=len(parent), eps=1e-6)
    np.testing.assert_allclose(np.asarray(got), padded(ref_sibling(parent, rows, rewards, 1e-6), tn.shape), atol=1e-9)


def test_node_values_count_each_leaf_once():
    # root -> 0 -> {1, 2}; root -> 3: three leaves
    tn = np.array([[0, 1], [0, 2], [3, -1]], np.int32)
    v, n = node_values(np.array([1.0, 0.0, 0.5]), tn, num_nodes=5)
    np.testing.assert_allclose(np.asarray(v), [0.5, 1.0, 0.0, 0.5, 0.0])
    np.testing.assert_allclose(np.asarray(n), [2, 1, 1, 1, 0])


def test_a_flat_group_has_no_sibling_term_and_centred_tree_values():
    """No branching below the root (flat GRPO): sibling adds nothing to the leaf advantage, and
    tree_value is the centred outcome, doubled on the first turn."""
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    tn = np.arange(8, dtype=np.int32).reshape(4, 2)  # each row its own chain of two turns
    g = np.zeros(4, np.int32)
    assert np.all(np.asarray(sibling_advantages(rewards, tn, num_nodes=8)) == 0)
    adv, w = tree_value_advantages(rewards, tn, g, num_groups=1, num_nodes=8)
    c = rewards - rewards.mean()
    np.testing.assert_allclose(np.asarray(adv), np.stack([2 * c, c], axis=1))
    assert np.all(np.asarray(w) == 1)


def test_a_single_chain_gets_nothing():
    """One leaf: nothing to compare, like GRPO's one-row group."""
    tn = np.array([[0, 1, 2]], np.int32)
    r = np.array([3.0])
    assert np.all(np.asarray(tree_value_advantages(r, tn, np.zeros(1, np.int32), num_groups=1, num_nodes=3)[0]) == 0)
    assert np.all(np.asarray(sibling_advantages(r, tn, num_nodes=3)) == 0)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), shift=st.floats(-5, 5))
def test_a_constant_added_to_every_reward_changes_nothing(seed, shift):
    rng = np.random.default_rng(seed)
    parent, _, rows, row_groups = random_forest(rng)
    rewards = rng.normal(size=len(rows))
    r, tn, g = as_arrays(rows, row_groups, rewards, pad_rows=0)
    N = len(parent)
    a0, _ = tree_value_advantages(r, tn, g, num_groups=3, num_nodes=N)
    a1, _ = tree_value_advantages(r + shift, tn, g, num_groups=3, num_nodes=N)
    np.testing.assert_allclose(np.asarray(a0), np.asarray(a1), atol=1e-9)
    np.testing.assert_allclose(np.asarray(sibling_advantages(r, tn, num_nodes=N)),
                               np.asarray(sibling_advantages(r + shift, tn, num_nodes=N)), atol=1e-6)
    states = rng.integers(0, 4, tn.shape).astype(np.int32)
    returns = rng.normal(size=tn.shape)
    np.testing.assert_allclose(np.asarray(anchor_state_advantages(returns, states, num_states=4)),
                               np.asarray(anchor_state_advantages(returns + shift, states, num_states=4)), atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_permuting_rows_and_relabelling_nodes_permutes_the_advantages(seed):
    """Siblings in another order (the rows, hence the children, permuted; node ids relabelled)."""
    rng = np.random.default_rng(seed)
    parent, _, rows, row_groups = random_forest(rng)
    rewards = rng.normal(size=len(rows))
    r, tn, g = as_arrays(rows, row_groups, rewards, pad_rows=0)
    N = len(parent)
    perm = rng.permutation(len(rows))
    relabel = rng.permutation(N).astype(np.int32)
    tn2 = np.where(tn[perm] >= 0, relabel[np.maximum(tn[perm], 0)], -1).astype(np.int32)
    a0, w0 = tree_value_advantages(r, tn, g, num_groups=3, num_nodes=N)
    a1, w1 = tree_value_advantages(r[perm], tn2, g[perm], num_groups=3, num_nodes=N)
    np.testing.assert_allclose(np.asarray(a0)[perm], np.asarray(a1), atol=1e-12)
    np.testing.assert_allclose(np.asarray(w0)[perm], np.asarray(w1), atol=1e-12)
    np.testing.assert_allclose(np.asarray(sibling_advantages(r, tn, num_nodes=N))[perm],
                               np.asarray(sibling_advantages(r[perm], tn2, num_nodes=N)), atol=1e-9)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_anchor_states_all_distinct_leave_only_the_episode_term(seed):
    rng = np.random.default_rng(seed)
    B, D = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    states = rng.permutation(B * D).reshape(B, D).astype(np.int32)
    states[rng.random((B, D)) < 0.2] = -1
    got = anchor_state_advantages(rng.normal(size=(B, D)), states, num_states=B * D)
    assert np.all(np.asarray(got) == 0)


def test_anchor_state_normalizes_within_a_step_group():
    # turns 0 of rows 0-2 start from state 0 (returns 1, 0, 2); row 0 turn 1 and row 1 turn 1 share state 1
    returns = np.array([[1.0, 4.0], [0.0, 2.0], [2.0, 7.0]])
    states = np.array([[0, 1], [0, 1], [0, 2]], np.int32)
    got = np.asarray(anchor_state_advantages(returns, states, num_states=3, eps=0.0))
    s0 = np.array([1.0, 0.0, 2.0])
    np.testing.assert_allclose(got[:, 0], (s0 - s0.mean()) / s0.std())
    np.testing.assert_allclose(got[:2, 1], [1.0, -1.0])
    assert got[2, 1] == 0  # alone in its step group
    # weights: a copy of weight 1/2 counts half
    w = np.array([[0.5, 1.0], [0.5, 1.0], [1.0, 1.0]])
    got_w = np.asarray(anchor_state_advantages(returns, states, num_states=3, weights=w, eps=0.0))
    m = (0.5 * 1 + 0.5 * 0 + 1 * 2) / 2.0
    sd = np.sqrt((0.5 * (1 - m) ** 2 + 0.5 * (0 - m) ** 2 + (2 - m) ** 2) / 2.0)
    np.testing.assert_allclose(got_w[:, 0], (s0 - m) / sd)


def test_turn_values_spread_over_their_tokens():
    values = np.array([[1.0, 2.0], [3.0, 4.0]])
    turn_ids = np.array([[-1, 0, 0, -1, 1], [-1, -1, 0, 1, 1]], np.int32)
    np.testing.assert_allclose(np.asarray(turn_to_tokens(values, turn_ids)),
                               [[0, 1, 1, 0, 2], [0, 0, 3, 4, 4]])


# --- compute_advantages(estimator=...) -----------------------------------------------------------

def _tree_batch(seed):
    import jax.numpy as jnp

    import jaxprm
    from tests.learner.trees import random_groups

    rows = random_groups(seed, groups=3, leaves=(2, 6), share=0.8, vocab=40, turns=3)
    rng = np.random.default_rng(seed)
    for r in rows:
        r.outcome_reward = float(rng.normal())
        r.turn_rewards = rng.normal(size=len(r.turn_nodes)).astype(np.float32)
        r.turn_states = [int(s) for s in rng.integers(0, 3, len(r.turn_nodes))]
    b = jaxprm.pad_rows(rows, len_buckets=(64, 128))
    return b.replace(outcome_rewards=jnp.asarray(b.outcome_rewards, jnp.float64),
                     old_logprobs=jnp.asarray(b.old_logprobs, jnp.float64),
                     turn_rewards=jnp.asarray(b.turn_rewards, jnp.float64))


@pytest.mark.parametrize("estimator", ["tree_value", "sibling", "anchor_state"])
def test_compute_advantages_adds_the_estimators_turn_credit(estimator):
    import jaxprm

    b = _tree_batch(3)
    mask = np.asarray(b.loss_mask)
    cfg = dict(group_reward_norm=True, adv_mean_level=None, adv_std_level=None)
    leaf = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(**cfg))
    got = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(**cfg, estimator=estimator, anchor_weight=0.5,
                                                              anchor_gamma=0.9))
    r, B, D = np.asarray(leaf.outcome_rewards), *b.turn_nodes.shape
    tn = np.where(np.asarray(b.row_weights)[:, None] > 0, np.asarray(b.turn_nodes), -1)
    if estimator == "tree_value":
        adv, w = tree_value_advantages(r, tn, b.group_ids, num_groups=b.num_groups, num_nodes=B * D)
        expect = np.asarray(turn_to_tokens(adv, b.turn_ids)) * mask
        np.testing.assert_allclose(np.asarray(got.loss_weights), np.asarray(turn_to_tokens(w, b.turn_ids)) * mask)
    elif estimator == "sibling":
        expect = np.asarray(leaf.advantages_gae) + np.asarray(
            turn_to_tokens(sibling_advantages(r, tn, num_nodes=B * D), b.turn_ids)) * mask
    else:  # reference returns: G_d = sum_j>=d 0.9^(j-d) r_j over the row's turns
        tr = np.where(tn >= 0, np.asarray(b.turn_rewards), 0.0)
        G = np.array([[sum(0.9 ** (j - d) * tr[i, j] for j in range(d, D)) for d in range(D)] for i in range(B)])
        _, leaves = node_values(r, tn, num_nodes=B * D)
        w = np.where(tn >= 0, 1.0 / np.maximum(np.asarray(leaves)[np.maximum(tn, 0)], 1), 0.0)
        step = anchor_state_advantages(G, np.where(tn >= 0, np.asarray(b.turn_states), -1), num_states=B * D,
                                       weights=w)
        expect = np.asarray(leaf.advantages_gae) + 0.5 * np.asarray(turn_to_tokens(step, b.turn_ids)) * mask
        assert np.abs(np.asarray(step)).max() > 0
    np.testing.assert_allclose(np.asarray(got.advantages_gae), expect, atol=1e-9)
    assert not np.allclose(np.asarray(got.advantages_gae), np.asarray(leaf.advantages_gae))
    # it composes with process-reward shaping
    shaped = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(**cfg, estimator=estimator, shaping_mode="additive"))
    assert np.isfinite(np.asarray(shaped.advantages)).all()


def test_an_estimator_without_the_turns_says_what_is_missing():
    import jaxprm

    b = _tree_batch(0).replace(turn_nodes=None)
    with pytest.raises(ValueError, match="needs the batch's turn_nodes"):
        jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(estimator="tree_value"))
