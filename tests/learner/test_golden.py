"""The learner kernels against AReaL's own outputs (tests/data/areal_learner_vectors.json).

Float64 cases run with x64 enabled and must match to ~1e-12; the float32 paths match AReaL's
float32 outputs to float32 rounding.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprm
from jaxprm.learner.loss import policy_loss_terms

DATA = json.loads((pathlib.Path(__file__).parents[1] / "data" / "areal_learner_vectors.json").read_text())
CASES = DATA["cases"]


def cases(kind):
    return [pytest.param(c, id=c["name"]) for c in CASES if c["kind"] == kind]


def test_case_counts():
    kinds = {}
    for c in CASES:
        kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    assert kinds == {"gae": 8, "policy_loss": 9, "kl": 3, "normalize": 13, "shaping": 9, "end_to_end": 2}


def f64(x):
    return np.asarray(x, np.float64)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("case", cases("gae"))
@pytest.mark.parametrize("method", ["scan", "associative", "cumsum"])
def test_gae(case, method, x64):
    p, i, o = case["params"], case["inputs"], case["outputs"]
    if method == "cumsum" and not p["gamma"] == p["lam"] == 1.0:
        pytest.skip("cumsum is the gamma = lambda = 1 closed form")
    assert not any(p["seq_no_eos_mask"])
    adv, ret = jaxprm.learner.gae(f64(i["rewards"]), f64(i["values"]), np.asarray(i["mask"]),
                          gamma=p["gamma"], lam=p["lam"], method=method)
    np.testing.assert_allclose(adv, f64(o["advantages"]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret, f64(o["returns"]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", cases("policy_loss"))
def test_policy_loss(case, x64):
    p, i, o = case["params"], case["inputs"], case["outputs"]
    assert p["importance_sampling_level"] == "token"
    args = (f64(i["logprobs"]), f64(i["old_logprobs"]), f64(i["advantages"]), np.asarray(i["mask"]))
    kw = dict(eps_clip=p["eps_clip"], eps_clip_higher=p["eps_clip_higher"], c_clip=p["c_clip"])
    loss, m = jaxprm.policy_loss(*args, **kw, agg=p["aggregation"])
    np.testing.assert_allclose(loss, o["loss"], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m["clip_fraction"], o["clip_fraction"], rtol=1e-12)
    np.testing.assert_allclose(m["dual_clip_fraction"], o["dual_clip_fraction"], rtol=1e-12)
    assert int(m["n_valid_tokens"]) == o["n_valid_tokens"]
    t = policy_loss_terms(*args, **kw)
    np.testing.assert_array_equal(np.asarray(t.clip_mask), np.asarray(o["clip_mask"], bool))
    np.testing.assert_array_equal(np.asarray(t.dual_clip_mask), np.asarray(o["dual_clip_mask"], bool))
    np.testing.assert_allclose(t.ratio, f64(o["ratio"]), rtol=1e-12, atol=1e-12)
    mask = np.asarray(i["mask"]) > 0
    np.testing.assert_allclose(np.where(mask, t.pg_loss, 0), np.where(mask, f64(o["pg_loss"]), 0),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", cases("kl"))
def test_kl(case, x64):
    p, i, o = case["params"], case["inputs"], case["outputs"]
    assert p["apply_clamp"] and p["clamp"] == [-10.0, 10.0]
    kl64 = jaxprm.kl_penalty(f64(i["logprobs"]), f64(i["ref_logprobs"]), estimator=p["estimator"])
    np.testing.assert_allclose(kl64, f64(o["kl_f64"]), rtol=1e-12, atol=1e-12)
    kl32 = jaxprm.kl_penalty(np.float32(i["logprobs"]), np.float32(i["ref_logprobs"]), estimator=p["estimator"])
    assert kl32.dtype == jnp.float32
    np.testing.assert_allclose(kl32, np.float32(o["kl"]), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("case", cases("normalize"))
def test_normalize(case, x64):
    p, i, o = case["params"], case["inputs"], case["outputs"]
    assert not p["mean_leave1out"]
    x = f64(i["x"])
    mask = np.ones(x.shape, np.int32) if i["mask"] is None else np.asarray(i["mask"])
    if x.ndim == 1 and p["mean_level"] == "group":
        # 1-D outcome rewards (reward_norm usage): the GRPO helper must agree too.
        r = jaxprm.group_normalize_rewards(x, np.asarray(i["group_ids"]), len(i["group_sizes"]),
                                           std=p["std_level"] == "group", eps=p["eps"])
        np.testing.assert_allclose(r, f64(o["normalized_f64"]), rtol=1e-12, atol=1e-12)
    out = jaxprm.learner.normalize(x, mask, group_ids=np.asarray(i["group_ids"]), num_groups=len(i["group_sizes"]),
                           mean_level=p["mean_level"], std_level=p["std_level"],
                           unbiased=p["std_unbiased"], eps=p["eps"])
    expected = f64(o["normalized_f64"])
    if not mask.any():
        # The one deliberate difference (golden README): an all-masked input normalizes to 0.
        assert case["name"] == "normalize_10"
        expected = np.zeros_like(expected)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    out32 = jaxprm.learner.normalize(np.float32(x), mask, group_ids=np.asarray(i["group_ids"]),
                             num_groups=len(i["group_sizes"]), mean_level=p["mean_level"],
                             std_level=p["std_level"], unbiased=p["std_unbiased"], eps=p["eps"])
    assert out32.dtype == jnp.float32
    if mask.any():
        np.testing.assert_allclose(out32, np.float32(o["normalized"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", cases("shaping"))
def test_shaping(case, x64):
    p, i, o = case["params"], case["inputs"], case["outputs"]
    kw = {k: v for k, v in p.items() if k in ("negative_scale", "zero_penalty", "zero_eps")}
    out = jaxprm.shape_advantages(f64(i["advantages"]), f64(i["process_rewards"]), np.asarray(i["mask"]),
                                  mode=p["mode"], **kw)
    np.testing.assert_allclose(out, f64(o["advantages"]), rtol=1e-12, atol=1e-12)


def _end_to_end_batch(i, dtype):
    """Token-aligned rollout tensors -> a Batch (the export's single shift)."""
    ids = np.asarray(i["input_ids"], np.int32)
    attn = np.asarray(i["attention_mask"])
    loss_mask = np.asarray(jaxprm.shift_to_prediction(np.asarray(i["loss_mask"], np.float32)))
    old = np.asarray(jaxprm.shift_to_prediction(np.asarray(i["logprobs"], dtype))) * loss_mask
    proc = np.asarray(jaxprm.shift_to_prediction(np.asarray(i["token_rewards"], dtype))) * loss_mask
    ref = np.asarray(i["ref_logp"], dtype) if "ref_logp" in i else old
    B, T = ids.shape
    return jaxprm.Batch(
        tokens=ids, loss_mask=loss_mask.astype(dtype), old_logprobs=old.astype(dtype), ref_logprobs=ref,
        process_rewards=proc.astype(dtype), values=np.zeros((B, T), dtype),
        outcome_rewards=np.asarray(i["rewards"], dtype), group_ids=np.zeros(B, np.int32),
        turn_ids=np.where(loss_mask > 0, 0, -1).astype(np.int32), seq_lens=attn.sum(-1).astype(np.int32),
        truncated=np.asarray(i["is_truncated"], bool), row_weights=np.ones(B, dtype), num_groups=B,
    )


def _e2e_config(p):
    assert p["values"].startswith("none")
    n = p["adv_norm"]
    return jaxprm.AdvantageConfig(
        reward_scale=p["reward_scaling"], reward_bias=p["reward_bias"], reward_clip=p["reward_clip"],
        kl_ctl=p["kl_ctl"], kl_estimator=p["kl_estimator"], gamma=p["discount"], lam=p["gae_lambda"],
        adv_mean_level=n["mean_level"], adv_std_level=n["std_level"], adv_unbiased=n["std_unbiased"],
        adv_eps=n["eps"], shaping_mode=p["shaping_mode"], negative_scale=p["gvpo_negative_scale"],
        zero_penalty=p["gvpo_zero_penalty"], zero_eps=p["gvpo_zero_eps"],
        token_rewards_as_adv=p["token_rewards_as_adv"], mask_no_eos_with_zero=p["mask_no_eos_with_zero"],
    )


E2E_FIELDS = {
    "kl_rewards": "kl_rewards", "rewards": "rewards", "token_advantages": "token_advantages",
    "advantages_gae": "advantages_gae", "returns": "returns",
    "advantages_normalized": "advantages_normalized", "advantages": "advantages",
}


@pytest.mark.parametrize("case", cases("end_to_end"))
def test_end_to_end_f64(case, x64):
    i, o = case["inputs"], case["outputs_f64"]
    batch = _end_to_end_batch(i, np.float64)
    np.testing.assert_allclose(batch.loss_mask, f64(o["loss_mask"]))
    np.testing.assert_allclose(batch.old_logprobs, f64(o["old_logprobs"]), rtol=1e-12, atol=1e-12)
    out = jaxprm.compute_advantages(batch, _e2e_config(case["params"]))
    for ours, theirs in E2E_FIELDS.items():
        np.testing.assert_allclose(getattr(out, ours), f64(o[theirs]), rtol=1e-10, atol=1e-10, err_msg=ours)


@pytest.mark.parametrize("case", cases("end_to_end"))
def test_end_to_end_f32(case):
    i, o = case["inputs"], case["outputs"]
    out = jaxprm.compute_advantages(_end_to_end_batch(i, np.float32), _e2e_config(case["params"]))
    for ours, theirs in E2E_FIELDS.items():
        got = getattr(out, ours)
        assert got.dtype == jnp.float32, ours
        np.testing.assert_allclose(got, np.float32(o[theirs]), rtol=1e-5, atol=1e-5, err_msg=ours)
