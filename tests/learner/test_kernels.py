"""Kernels vs float64 numpy references on random shapes and masks, worked examples from docs/design.md,
jit/vmap/grad invariants, recompilation, and bad-input errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxprm
from tests.learner import reference as ref

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def masked_batch(draw, max_b=5, max_t=9):
    # a few sizes, not every one: each (B, T) is a program to compile, and the edge cases are 1 and max
    B = draw(st.sampled_from(sorted({1, 2, max_b})))
    T = draw(st.sampled_from(sorted({1, 2, max_t})))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    density = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    mask = (rng.random((B, T)) < density).astype(np.float64)
    mask[:, -1] = 0  # prediction positions: the last column is never active
    if draw(st.booleans()) and B > 1:
        mask[rng.integers(B)] = 0  # a row with no active token
    n_groups = draw(st.integers(1, B))
    group_ids = np.sort(rng.integers(0, n_groups, B)).astype(np.int32)
    return rng, mask, group_ids


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@SETTINGS
@given(masked_batch(), st.sampled_from([1.0, 0.9]), st.sampled_from([1.0, 0.95, 0.0]), st.booleans())
def test_gae_matches_reference(data, gamma, lam, bootstrap):
    rng, mask, _ = data
    B, T = mask.shape
    r, v = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    boot = rng.normal(size=B) if bootstrap else None
    want_a, want_r = ref.gae(r, v, mask, gamma, lam, boot)
    methods = ("scan", "associative", "cumsum") if gamma == lam == 1.0 else ("scan", "associative")
    for method in methods:
        a, ret = jaxprm.learner.gae(r, v, mask, gamma=gamma, lam=lam, method=method, bootstrap_values=boot)
        np.testing.assert_allclose(a, want_a, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(ret, want_r, rtol=1e-10, atol=1e-10)


def test_gae_scan_and_associative_agree_in_float32():
    with jax.enable_x64(False):
        rng = np.random.default_rng(0)
        B, T = 8, 256
        r = rng.normal(size=(B, T)).astype(np.float32)
        v = rng.normal(size=(B, T)).astype(np.float32)
        m = (rng.random((B, T)) < 0.6).astype(np.float32)
        a1, _ = jaxprm.learner.gae(r, v, m, gamma=0.99, lam=0.95, method="scan")
        a2, _ = jaxprm.learner.gae(r, v, m, gamma=0.99, lam=0.95, method="associative")
        assert a1.dtype == a2.dtype == jnp.float32
        np.testing.assert_allclose(a1, a2, rtol=1e-4, atol=1e-4)
        b1, _ = jaxprm.learner.gae(r, v, m, method="scan")
        b3, _ = jaxprm.learner.gae(r, v, m, method="cumsum")
        np.testing.assert_allclose(b1, b3, rtol=1e-4, atol=2e-4)
        with pytest.raises(ValueError, match="cumsum' needs gamma == lam == 1"):
            jaxprm.learner.gae(r, v, m, gamma=0.9, method="cumsum")


@SETTINGS
@given(masked_batch(), st.sampled_from(["batch", "group", None]), st.sampled_from(["batch", "group", None]),
       st.booleans())
def test_normalize_matches_reference(data, mean_level, std_level, unbiased):
    rng, mask, gids = data
    x = rng.normal(size=mask.shape)
    out = jaxprm.learner.normalize(x, mask, group_ids=gids, num_groups=mask.shape[0], mean_level=mean_level,
                           std_level=std_level, unbiased=unbiased)
    np.testing.assert_allclose(out, ref.normalize(x, mask, gids, mean_level, std_level, unbiased),
                               rtol=1e-9, atol=1e-9)
    assert np.all(np.asarray(out)[mask == 0] == 0)


@SETTINGS
@given(masked_batch(), st.booleans())
def test_group_normalize_rewards_excludes_padding(data, std):
    rng, mask, gids = data
    B = mask.shape[0]
    r = rng.normal(size=B)
    w = (rng.random(B) < 0.8).astype(np.float64)
    out = np.asarray(jaxprm.group_normalize_rewards(r, gids, B, std=std, weights=w))
    want = ref.normalize(r[w > 0][:, None], np.ones(((w > 0).sum(), 1)), gids[w > 0], "group",
                         "group" if std else None)[:, 0]
    np.testing.assert_allclose(out[w > 0], want, rtol=1e-9, atol=1e-9)
    assert np.all(out[w == 0] == 0)


@SETTINGS
@given(masked_batch(), st.sampled_from(["additive", "gvpo", "process_weighted"]))
def test_shaping_matches_reference(data, mode):
    rng, mask, _ = data
    A = rng.normal(size=mask.shape)
    A[rng.random(mask.shape) < 0.2] = 0.0
    if mode == "process_weighted":
        p = rng.choice([0.0, 0.25, 1.0], size=mask.shape) * mask
    else:
        p = rng.normal(size=mask.shape) * mask
    out = jaxprm.shape_advantages(A, p, mask, mode=mode)
    np.testing.assert_allclose(out, ref.shape(A, p, mask > 0, mode), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(masked_batch(), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
       st.sampled_from([None, 3.0]), st.sampled_from([None, 0.28]))
def test_policy_loss_matches_reference(data, agg, c_clip, eps_hi):
    rng, mask, _ = data
    logp, old = -rng.random(mask.shape) * 3, -rng.random(mask.shape) * 3
    A = rng.normal(size=mask.shape)
    loss, m = jaxprm.policy_loss(logp, old, A, mask, eps_clip=0.2, eps_clip_higher=eps_hi, c_clip=c_clip, agg=agg)
    np.testing.assert_allclose(loss, ref.policy_loss(logp, old, A, mask, 0.2, eps_hi, c_clip, agg), rtol=1e-10,
                               atol=1e-12)
    np.testing.assert_allclose(m["loss_sum"] / max(float(m["loss_count"]), 1.0), loss, rtol=1e-12, atol=1e-15)


@SETTINGS
@given(masked_batch(), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
       st.sampled_from([None, 3.0]), st.sampled_from([(None, "truncate"), (1.5, "truncate"), (1.5, "mask"),
                                                      (2.0, "mask_sequence")]))
def test_decoupled_policy_loss_and_its_gradient_match_the_reference(data, agg, c_clip, cap_mode):
    rng, mask, _ = data
    cap, mode = cap_mode
    logp, prox = -rng.random(mask.shape) * 3, -rng.random(mask.shape) * 3
    behave = prox + rng.normal(size=mask.shape) * 0.5  # stale samples: w = exp(prox - behave) around 1
    A = rng.normal(size=mask.shape)
    kw = dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=c_clip, agg=agg, behave_cap=cap, behave_mode=mode)
    w = ref.behaviour_weights(prox, behave, mask, cap, mode)

    def want(lp):
        return ref.policy_loss(lp, prox, A, mask, 0.2, 0.28, c_clip, agg, weights=w)

    loss, m = jaxprm.decoupled_policy_loss(logp, prox, behave, A, mask, **kw)
    np.testing.assert_allclose(loss, want(logp), rtol=1e-10, atol=1e-12)
    grad = jax.grad(lambda lp: jaxprm.decoupled_policy_loss(lp, prox, behave, A, mask, **kw)[0])(logp)
    h, fd = 1e-6, np.zeros_like(logp)
    for i in np.ndindex(*logp.shape):
        e = np.zeros_like(logp)
        e[i] = h
        fd[i] = (want(logp + e) - want(logp - e)) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7)
    active = mask > 0
    gap = np.abs(prox - behave)[active]
    np.testing.assert_allclose(m["behave_gap_max"], gap.max() if gap.size else 0.0, rtol=1e-12)
    capped = 0 if cap is None else int(((w != np.where(active, np.exp(prox - behave), 0.0)) & active).sum())
    assert int(m["behave_capped_sum"]) == capped


@SETTINGS
@given(masked_batch(), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_decoupled_loss_with_the_behaviour_as_proximal_policy_is_the_synchronous_loss(data, agg):
    rng, mask, _ = data
    logp, old, A = -rng.random(mask.shape) * 3, -rng.random(mask.shape) * 3, rng.normal(size=mask.shape)
    kw = dict(eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0, agg=agg)
    sync = lambda lp: jaxprm.policy_loss(lp, old, A, mask, **kw)[0]  # noqa: E731
    dec = lambda lp: jaxprm.decoupled_policy_loss(lp, old, old, A, mask, **kw)[0]  # noqa: E731
    for cap in (None, 2.0):
        d = lambda lp: jaxprm.decoupled_policy_loss(lp, old, old, A, mask, behave_cap=cap, **kw)[0]  # noqa: E731
        assert float(d(logp)) == float(sync(logp))
        np.testing.assert_array_equal(jax.grad(d)(logp), jax.grad(sync)(logp))
    assert float(dec(logp)) == float(sync(logp))


def test_behaviour_weights_refuse_a_bad_cap_or_mode():
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="cap must be > 0"):
        jaxprm.behaviour_weights(z, z, z, cap=0.0)
    with pytest.raises(ValueError, match="mode"):
        jaxprm.behaviour_weights(z, z, z, cap=2.0, mode="clip")


@SETTINGS
@given(masked_batch(), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_matches_reference(data, estimator):
    rng, mask, _ = data
    a, b = rng.normal(size=mask.shape) * 8, rng.normal(size=mask.shape) * 8
    np.testing.assert_allclose(jaxprm.kl_penalty(a, b, estimator=estimator), ref.kl(a, b, estimator),
                               rtol=1e-12, atol=1e-12)


def test_shift_and_placement():
    x = np.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(jaxprm.shift_to_prediction(x), ref.shift(x))
    np.testing.assert_array_equal(jaxprm.shift_to_prediction(np.ones((3, 1))), np.zeros((3, 1)))  # T = 1
    out = jaxprm.place_outcome_rewards(np.array([1.0, 2.0, 3.0]), np.array([6, 1, 0]), 6)
    want = np.zeros((3, 6))
    want[0, 4], want[1, 0], want[2, 0] = 1, 2, 3
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(jaxprm.transform_outcome_rewards(np.array([30.0, -1.0]), scale=2, bias=1, clip=20),
                               [20.0, 0.0])


# --- Worked examples from docs/design.md, verbatim --------------------------------------------------


def test_gvpo_worked_example():
    A = np.array([[-2, -0.1, 0, 0.1, 2]])
    p = -np.ones_like(A)
    out = jaxprm.shape_advantages(A, p, np.ones_like(A), mode="gvpo", zero_eps=0.1)
    np.testing.assert_allclose(out, [[-2.4, -0.4, -0.4, -0.4, 0]], atol=1e-12)


def test_process_weighted_worked_example():
    A = np.array([[-2, -1, 0, 2, 3]], float)
    p = np.array([[0, 0.25, 0.5, 0.25, 1]])
    out = jaxprm.shape_advantages(A, p, np.ones_like(A), mode="process_weighted")
    np.testing.assert_allclose(out, [[-2, 0.25, 0, 0.5, 3]], atol=1e-12)


def _worked_batch(process):
    # Five active positions, outcome 1, process -0.2 on turn 2 (the last three), gamma = lambda = 1.
    T = 6
    mask = np.array([[1, 1, 1, 1, 1, 0]], float)
    turn = np.array([[0, 0, 1, 1, 1, -1]], np.int32)
    return jaxprm.Batch(
        tokens=np.zeros((1, T), np.int32), loss_mask=mask, old_logprobs=np.zeros((1, T)),
        ref_logprobs=np.zeros((1, T)), process_rewards=process * mask, values=np.zeros((1, T)),
        outcome_rewards=np.array([1.0]), group_ids=np.zeros(1, np.int32), turn_ids=turn,
        seq_lens=np.array([T], np.int32), truncated=np.zeros(1, bool), row_weights=np.ones(1), num_groups=1,
    )


def test_direct_vs_folded_worked_example():
    proc = np.array([[0, 0, -0.2, -0.2, -0.2, 0]])
    b = _worked_batch(proc)
    none = dict(adv_mean_level=None, adv_std_level=None)
    direct = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(shaping_mode="additive", **none))
    np.testing.assert_allclose(direct.advantages[0, :5], [1, 1, 0.8, 0.8, 0.8], atol=1e-12)
    np.testing.assert_allclose(direct.returns[0, :5], [1, 1, 1, 1, 1], atol=1e-12)
    folded = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(token_rewards_as_adv=False, **none))
    np.testing.assert_allclose(folded.advantages[0, :5], [0.8] * 5, atol=1e-12)
    np.testing.assert_allclose(folded.returns[0, :5], [0.8] * 5, atol=1e-12)


def test_folded_rejects_non_uniform_turn():
    b = _worked_batch(np.array([[0, 0, -0.2, -0.1, -0.2, 0]]))
    cfg = jaxprm.AdvantageConfig(token_rewards_as_adv=False)
    with pytest.raises(Exception, match="not uniform"):
        jax.block_until_ready(jaxprm.compute_advantages(b, cfg).advantages)
    with pytest.raises(ValueError, match="not uniform"):
        jaxprm.fold_turn_rewards(np.zeros((1, 6)), np.asarray(b.process_rewards), b.loss_mask, b.turn_ids)
    assert not bool(jaxprm.check_uniform_turn_rewards(b.process_rewards, b.loss_mask, b.turn_ids)[0])


def test_folded_without_turn_ids_uses_runs_of_the_loss_mask():
    # Two turns separated by an observation token; process -0.2 on turn 2; no turn ids in the batch.
    mask = np.array([[1, 1, 0, 1, 1, 1, 0]], float)
    proc = np.array([[0, 0, 0, -0.2, -0.2, -0.2, 0]])
    with_ids = dataclasses.replace(_worked_batch(np.zeros((1, 6))), loss_mask=mask, process_rewards=proc,
                                   turn_ids=np.array([[0, 0, -1, 1, 1, 1, -1]], np.int32),
                                   tokens=np.zeros((1, 7), np.int32), old_logprobs=np.zeros((1, 7)),
                                   ref_logprobs=np.zeros((1, 7)), values=np.zeros((1, 7)),
                                   seq_lens=np.array([7], np.int32))
    without = dataclasses.replace(with_ids, turn_ids=np.full((1, 7), -1, np.int32))
    cfg = jaxprm.AdvantageConfig(token_rewards_as_adv=False, adv_mean_level=None, adv_std_level=None)
    a, b = jaxprm.compute_advantages(with_ids, cfg), jaxprm.compute_advantages(without, cfg)
    np.testing.assert_allclose(b.returns, a.returns, atol=1e-12)
    np.testing.assert_allclose(b.returns[0, [0, 1, 3, 4, 5]], [0.8] * 5, atol=1e-6)  # the reward is not dropped


def test_shaping_modes_need_direct_process_advantages():
    for mode in ("gvpo", "process_weighted"):
        with pytest.raises(ValueError, match="token_rewards_as_adv=True"):
            jaxprm.AdvantageConfig(shaping_mode=mode, token_rewards_as_adv=False)
    jaxprm.AdvantageConfig(shaping_mode="additive", token_rewards_as_adv=False)  # folded additive is the folded mode


def test_truncated_rows_bootstrap_and_mask_no_eos():
    T = 5
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]], float)
    values = np.array([[0.5, 0.5, 0.5, 2.0, 9.0]] * 2)
    b = jaxprm.Batch(
        tokens=np.zeros((2, T), np.int32), loss_mask=mask, old_logprobs=np.zeros((2, T)),
        ref_logprobs=np.zeros((2, T)), process_rewards=-0.5 * mask, values=values,
        outcome_rewards=np.array([1.0, 1.0]), group_ids=np.zeros(2, np.int32),
        turn_ids=np.where(mask > 0, 0, -1).astype(np.int32), seq_lens=np.array([4, 4], np.int32),
        truncated=np.array([False, True]), row_weights=np.ones(2), num_groups=2,
    )
    none = dict(adv_mean_level=None, adv_std_level=None)
    out = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(**none))
    # EOS row: bootstrap 0; truncated row: bootstrap from the value at its last position (index 3).
    want0, _ = ref.gae(np.asarray(out.rewards)[:1], values[:1], mask[:1], 1.0, 1.0, [0.0])
    want1, _ = ref.gae(np.asarray(out.rewards)[1:], values[1:], mask[1:], 1.0, 1.0, [2.0])
    np.testing.assert_allclose(out.advantages, np.concatenate([want0, want1]), atol=1e-12)
    z = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(mask_no_eos_with_zero=True, shaping_mode="additive", **none))
    np.testing.assert_allclose(z.outcome_rewards, [1.0, 0.0])
    assert np.all(np.asarray(z.token_advantages)[1] == 0) and np.all(np.asarray(z.token_advantages)[0, :3] == -0.5)


def test_group_reward_norm_in_pipeline():
    T = 4
    B = 4
    mask = np.tile([1.0, 1.0, 0, 0], (B, 1))
    b = jaxprm.Batch(
        tokens=np.zeros((B, T), np.int32), loss_mask=mask, old_logprobs=np.zeros((B, T)),
        ref_logprobs=np.zeros((B, T)), process_rewards=np.zeros((B, T)), values=np.zeros((B, T)),
        outcome_rewards=np.array([1.0, 0.0, 1.0, 5.0]), group_ids=np.array([0, 0, 1, 0], np.int32),
        turn_ids=np.zeros((B, T), np.int32), seq_lens=np.full(B, 3, np.int32), truncated=np.zeros(B, bool),
        row_weights=np.array([1.0, 1.0, 1.0, 0.0]), num_groups=B,
    )
    out = jaxprm.compute_advantages(b, jaxprm.AdvantageConfig(group_reward_norm=True, adv_mean_level=None,
                                                              adv_std_level=None))
    s = np.std([1.0, 0.0], ddof=1)
    np.testing.assert_allclose(out.outcome_rewards, [0.5 / (s + 1e-5), -0.5 / (s + 1e-5), 0.0, 0.0], atol=1e-9)


# --- Transformations: jit, vmap, grad, recompilation ------------------------------------------


def test_jit_vmap_grad():
    rng = np.random.default_rng(1)
    B, T = 3, 7
    r, v = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    m = (rng.random((B, T)) < 0.7).astype(float)
    for method in ("scan", "associative"):
        eager = jaxprm.learner.gae(r, v, m, method=method)
        jitted = jax.jit(lambda r, v, m: jaxprm.learner.gae(r, v, m, method=method))(r, v, m)
        np.testing.assert_allclose(eager[0], jitted[0], atol=1e-12)
        # vmap over an extra leading axis (e.g. several minibatches at once).
        vm = jax.vmap(lambda r, v, m: jaxprm.learner.gae(r, v, m, method=method)[0])(r[None], v[None], m[None])
        np.testing.assert_allclose(vm[0], eager[0], atol=1e-12)
    vm = jax.vmap(lambda a, p, mm: jaxprm.shape_advantages(a, p, mm, mode="gvpo"))(r[None], -m[None], m[None])
    np.testing.assert_allclose(vm[0], jaxprm.shape_advantages(r, -m, m, mode="gvpo"))

    logp, old, A = -rng.random((B, T)), -rng.random((B, T)), rng.normal(size=(B, T))

    def f(lp):
        return jaxprm.policy_loss(lp, old, A, m)[0]

    g = jax.grad(f)(logp)
    eps = 1e-6
    e = np.zeros((B, T))
    idx = tuple(np.argwhere(m > 0)[0])
    e[idx] = eps
    fd = (f(logp + e) - f(logp - e)) / (2 * eps)
    np.testing.assert_allclose(g[idx], fd, rtol=1e-5, atol=1e-8)
    assert np.all(np.asarray(g)[m == 0] == 0)


def _random_batch(rng, B=8, T=32):
    mask = (rng.random((B, T)) < 0.6).astype(np.float32)
    mask[:, -1] = 0
    f = lambda: rng.normal(size=(B, T)).astype(np.float32)  # noqa: E731
    return jaxprm.Batch(
        tokens=rng.integers(0, 100, (B, T)).astype(np.int32), loss_mask=mask, old_logprobs=f() * mask,
        ref_logprobs=f() * mask, process_rewards=rng.random((B, T)).astype(np.float32) * mask,
        values=np.zeros((B, T), np.float32), outcome_rewards=rng.normal(size=B).astype(np.float32),
        group_ids=(np.arange(B) // 4).astype(np.int32), turn_ids=np.zeros((B, T), np.int32),
        seq_lens=np.full(B, T, np.int32), truncated=rng.random(B) < 0.3, row_weights=np.ones(B, np.float32),
        num_groups=B,
    )


def test_compute_advantages_does_not_recompile_on_new_content():
    from jaxprm.learner.advantages import _compute_advantages_jit

    with jax.enable_x64(False):
        rng = np.random.default_rng(2)
        cfg = jaxprm.AdvantageConfig(shaping_mode="process_weighted", group_reward_norm=True, kl_ctl=0.1)
        jaxprm.compute_advantages(_random_batch(rng), cfg)
        before = _compute_advantages_jit._cache_size()
        for _ in range(3):
            out = jaxprm.compute_advantages(_random_batch(rng), cfg)
        jax.block_until_ready(out)
        assert _compute_advantages_jit._cache_size() == before
        assert out.advantages.dtype == jnp.float32


def test_process_weighted_out_of_range_raises_eager_and_jit():
    A = np.zeros((1, 3))
    m = np.ones((1, 3))
    p = np.array([[0.5, 1.5, 0.0]])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        jaxprm.shape_advantages(A, p, m, mode="process_weighted")
    f = jax.jit(lambda a, p, m: jaxprm.shape_advantages(a, p, m, mode="process_weighted"))
    with pytest.raises(Exception, match=r"in \[0, 1\]"):
        jax.block_until_ready(f(A, p, m))
    # Out of range on a masked token is fine; validate_process_rewards is the jittable flag.
    np.testing.assert_array_equal(jaxprm.validate_process_rewards(p, np.array([[1, 0, 1]]), mode="process_weighted"),
                                  [True])
    jaxprm.shape_advantages(A, p, np.array([[1, 0, 1]]), mode="process_weighted")


# --- Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("call, match", [
    (lambda: jaxprm.learner.gae(np.zeros(3), np.zeros(3), np.zeros(3)), "rewards must have rank 2"),
    (lambda: jaxprm.learner.gae(np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((2, 3))), "shape mismatch"),
    (lambda: jaxprm.learner.gae(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)), method="fft"), r"method='fft'.*allowed"),
    (lambda: jaxprm.kl_penalty(np.zeros(2), np.zeros(2), estimator="k4"), r"estimator='k4'.*\('k1', 'k2', 'k3'\)"),
    (lambda: jaxprm.learner.normalize(np.zeros((2, 2)), np.ones((2, 2)), mean_level="row"), r"mean_level='row'.*allowed"),
    (lambda: jaxprm.learner.normalize(np.zeros((2, 2)), np.ones((2, 2)), std_level="group"), "group_ids is required"),
    (lambda: jaxprm.shape_advantages(np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), mode="mul"), "mode='mul'"),
    (lambda: jaxprm.policy_loss(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), agg="sum"),
     r"agg='sum'.*token-mean"),
    (lambda: jaxprm.policy_loss(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2)), c_clip=0.5),
     "c_clip must be > 1"),
    (lambda: jaxprm.place_outcome_rewards(np.zeros((2, 2)), np.zeros(2), 4), "rewards must have rank 1"),
    (lambda: jaxprm.AdvantageConfig(shaping_mode="process_weighted", mask_no_eos_with_zero=True),
     "rejects mask_no_eos_with_zero"),
    (lambda: jaxprm.AdvantageConfig(adv_std_level="token"), r"adv_std_level: 'token' is not supported"),
    (lambda: jaxprm.AdvantageConfig(zero_penalty=-1.0), "zero_penalty: must be a finite number >= 0"),
    (lambda: jaxprm.AdvantageConfig(negative_scale=float("nan")), "negative_scale"),
])
def test_bad_input_errors(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
