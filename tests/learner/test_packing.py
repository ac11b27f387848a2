"""Tree packing: layout invariants on random trees, and the packed loss (values, metrics and
gradients) equal to the flat rows' for every aggregation, clip-higher, dual clip, KL estimator,
process-reward shaping and GAE with per-leaf values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprm
from tests.learner.trees import random_groups


def _packed(rows, **kw):
    flat = jaxprm.pad_rows(rows)
    return flat, jaxprm.pack_rows(rows, flat_shape=flat.shape, **kw)


@pytest.mark.parametrize("seed,trees_per_row", [(0, None), (1, None), (2, 1), (3, 1), (4, None), (5, 2)])
def test_layout_reconstructs_every_row(seed, trees_per_row):
    rows = random_groups(seed, groups=4, leaves=(1, 7), share=0.7 if seed % 2 else 0.0)
    flat, pk = _packed(rows, trees_per_row=trees_per_row)
    tok, pos, par, end = (np.asarray(x) for x in (pk.tokens, pk.positions, pk.parents, pk.subtree_end))
    fidx, frows = np.asarray(pk.flat_index), np.asarray(pk.flat_rows)
    R, L = tok.shape
    mask = np.asarray(jaxprm.learner.tree_attention_mask(pk.subtree_end))
    distinct = set()
    for b, row in enumerate(rows):
        n = len(row.tokens)
        r = frows[b]
        slots = fidx[b, : n - 1] - r * L
        assert (fidx[b, : n - 1] // L == r).all() and (fidx[b, n - 1:] == -1).all()
        np.testing.assert_array_equal(tok[r, slots], row.tokens[1:])
        np.testing.assert_array_equal(pos[r, slots], np.arange(1, n))
        # The parent chain walks the row backwards; the first token is a root.
        first = par[r, slots[0]]
        assert par[r, first] == -1 and tok[r, first] == row.tokens[0] and pos[r, first] == 0
        path = np.concatenate([[first], slots])
        np.testing.assert_array_equal(par[r, path[1:]], path[:-1])
        # Each token sees exactly its root path.
        for i, q in enumerate(path):
            np.testing.assert_array_equal(np.flatnonzero(mask[r, q]), np.sort(path[: i + 1]))
        np.testing.assert_allclose(np.asarray(pk.loss_mask)[r, slots], row.loss_mask[1:])
        np.testing.assert_allclose(np.asarray(pk.old_logprobs)[r, slots], row.logprobs[1:] * row.loss_mask[1:])
    # Attention blocks: each packed token is a query of exactly one block, whose keys are its root
    # path by depth.
    qb, kb = np.asarray(pk.query_blocks), np.asarray(pk.key_blocks)
    for r in range(R):
        qs = qb[r][qb[r] >= 0]
        assert sorted(qs.tolist()) == list(range(int(np.asarray(pk.lengths)[r])))
        for nb in range(qb.shape[1]):
            for q in qb[r, nb][qb[r, nb] >= 0]:
                path = [q]
                while par[r, path[-1]] >= 0:
                    path.append(par[r, path[-1]])
                np.testing.assert_array_equal(kb[r, nb, : len(path)], path[::-1])
    # Every packed token is one distinct (group, prefix of (token, mask, log-prob)): nothing twice.
    keys = {b: list(zip(r.tokens.tolist(), r.loss_mask.tolist(), r.logprobs.tolist())) for b, r in enumerate(rows)}
    n_distinct = len({(r.group_id, tuple(keys[b][: i + 1])) for b, r in enumerate(rows) for i in range(len(r.tokens))})
    assert int(np.asarray(pk.lengths).sum()) == n_distinct
    assert (np.asarray(pk.lengths) <= L).all() and ((np.asarray(pk.lengths) > 0) == (np.asarray(pk.row_weights) > 0)).all()


def test_sharing_needs_equal_logprobs():
    rows = random_groups(0, groups=1, leaves=(2, 3), share=0.0)
    a = rows[0]
    b = dataclasses.replace(a, logprobs=a.logprobs.copy())
    b.logprobs[-1] -= 0.5  # same tokens, a different behaviour log-prob at the last token
    if a.loss_mask[-1] == 0:
        b.loss_mask[-1] = 1.0
    _, pk = _packed([a, b])
    n = len(a.tokens)
    assert int((np.asarray(pk.tokens)[0] != 0).sum()) <= n + 1
    # The last token is not shared: two slots, everything before it shared.
    fi = np.asarray(pk.flat_index)
    np.testing.assert_array_equal(fi[0, : n - 2], fi[1, : n - 2])
    assert fi[0, n - 2] != fi[1, n - 2]


def _flat_and_packed_loss(flat, pk, adv, packed_lp, **loss_kw):
    mask = flat.loss_mask * flat.row_weights[:, None]

    def flat_loss(lp):
        return jaxprm.policy_loss(jaxprm.learner.gather_to_flat(lp, pk.flat_index), flat.old_logprobs, adv, mask,
                                  **loss_kw)

    def packed_loss(lp):
        pa = jaxprm.pack_advantages(adv, mask, pk, agg=loss_kw.get("agg", "token-mean"))
        return jaxprm.packed_policy_loss(lp, pk.old_logprobs, pa, **loss_kw)

    (lf, mf), gf = jax.value_and_grad(flat_loss, has_aux=True)(packed_lp)
    (lq, mq), gq = jax.value_and_grad(packed_loss, has_aux=True)(packed_lp)
    return (lf, mf, gf), (lq, mq, gq)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("agg,eps_hi,c_clip", [
    ("token-mean", None, None), ("token-mean", 0.28, 1.5), ("seq-mean-token-mean", 0.28, None),
    ("seq-mean-token-mean", None, 3.0), ("seq-mean-token-sum", None, None), ("seq-mean-token-sum", 0.28, 1.5),
])
def test_packed_loss_equals_flat(agg, eps_hi, c_clip, x64):
    rows = random_groups(7, groups=5, leaves=(1, 7), share=0.7)
    flat, pk = _packed(rows)
    rng = np.random.default_rng(1)
    # Per-leaf advantages: shared tokens get different advantages in different leaves.
    adv = jnp.asarray(rng.normal(size=flat.shape) * np.asarray(flat.loss_mask))
    adv = adv.at[0, :3].set(0.0)  # some exact zeros
    lp = jnp.asarray(np.asarray(pk.old_logprobs) + rng.normal(size=pk.shape) * 0.4 * np.asarray(pk.loss_mask))
    kw = dict(eps_clip=0.2, eps_clip_higher=eps_hi, c_clip=c_clip, agg=agg)
    (lf, mf, gf), (lq, mq, gq) = _flat_and_packed_loss(flat, pk, adv, lp, **kw)
    np.testing.assert_allclose(lq, lf, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gq, gf, rtol=1e-10, atol=1e-12)
    for k in ("loss_sum", "loss_count", "n_valid_tokens", "clip_sum", "dual_clip_sum", "approx_kl_sum", "ratio_sum"):
        np.testing.assert_allclose(mq[k], mf[k], rtol=1e-10, atol=1e-10, err_msg=k)
    assert float(mf["clip_sum"]) > 0 and (c_clip is None or c_clip > 2 or float(mf["dual_clip_sum"]) > 0)


@pytest.mark.parametrize("estimator,shaping", [("k1", None), ("k2", "gvpo"), ("k3", "additive")])
def test_packed_loss_with_kl_process_rewards_and_gae_values(estimator, shaping):
    """float32, the trainer's path: compute_advantages on the flat rows (KL reward, per-leaf
    values in GAE with gamma/lambda < 1, group normalization, process-reward shaping), then the
    packed loss equals the flat loss and gradients to float32 rounding."""
    rows = random_groups(11, groups=4, leaves=(2, 7), share=0.8)
    flat, pk = _packed(rows)
    rng = np.random.default_rng(2)
    mask = np.asarray(flat.loss_mask)
    flat = flat.replace(
        ref_logprobs=jnp.asarray((np.asarray(flat.old_logprobs) - rng.random(flat.shape) * 0.3) * mask, jnp.float32),
        values=jnp.asarray(rng.normal(size=flat.shape), jnp.float32),  # per leaf, even on shared tokens
    )
    cfg = jaxprm.AdvantageConfig(group_reward_norm=True, kl_ctl=0.1, kl_estimator=estimator, gamma=0.99, lam=0.95,
                                 shaping_mode=shaping)
    adv = jaxprm.compute_advantages(flat, cfg).advantages
    lp = pk.old_logprobs + jnp.asarray(rng.normal(size=pk.shape) * 0.3, jnp.float32) * pk.loss_mask
    for agg in ("token-mean", "seq-mean-token-mean"):
        (lf, mf, gf), (lq, mq, gq) = _flat_and_packed_loss(flat, pk, adv, lp, eps_clip=0.2, eps_clip_higher=0.3,
                                                           c_clip=3.0, agg=agg)
        np.testing.assert_allclose(lq, lf, rtol=2e-6, atol=1e-6)
        scale = float(jnp.abs(gf).max())
        np.testing.assert_allclose(gq, gf, rtol=1e-5, atol=1e-6 * scale)
        for k in ("clip_sum", "dual_clip_sum", "n_valid_tokens", "loss_count"):
            np.testing.assert_allclose(mq[k], mf[k], err_msg=k)


def test_packing_saves_tokens_and_flat_groups_share_only_the_prompt():
    tree_rows = random_groups(3, groups=4, leaves=(4, 8), share=0.9)
    flat_rows = random_groups(3, groups=4, leaves=(4, 8), share=0.0)
    n_tree = int(np.asarray(_packed(tree_rows)[1].lengths).sum())
    assert n_tree < 0.7 * sum(len(r.tokens) for r in tree_rows)
    n_flat = int(np.asarray(_packed(flat_rows)[1].lengths).sum())
    prompts = {r.group_id: r for r in flat_rows}
    shared = sum(len(r.tokens) for r in flat_rows) - n_flat
    # Flat groups share their prompt (and only what matches by chance right after it).
    assert shared >= sum((sum(1 for r in flat_rows if r.group_id == g) - 1) for g in prompts)


def test_packed_logprobs_reads_the_parent_position():
    R, L, V = 2, 5, 7
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(R, L, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, (R, L)), jnp.int32)
    parents = jnp.asarray([[-1, 0, 1, 1, 0], [-1, 0, -1, 2, 3]], jnp.int32)
    got = jaxprm.learner.packed_logprobs(logits, tokens, parents)
    lsm = jax.nn.log_softmax(logits, axis=-1)
    for r in range(R):
        for j in range(L):
            p = int(parents[r, j])
            want = 0.0 if p < 0 else float(lsm[r, p, tokens[r, j]])
            np.testing.assert_allclose(got[r, j], want, rtol=1e-6, atol=1e-6)


def test_pack_rows_errors():
    rows = random_groups(0, groups=2)
    with pytest.raises(ValueError, match="partition"):
        jaxprm.pack_rows(rows, flat_shape=(64, 64), trees=[[0]])
    with pytest.raises(ValueError, match="longer than the flat length"):
        jaxprm.pack_rows(rows, flat_shape=(64, 2))
