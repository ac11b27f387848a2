"""jaxprm.serve.sampler (the weight holder) and jaxprm.serve.static_sampler: KV-cache decoding
against a no-cache reference, sampling semantics, buckets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from jaxprm.serve.sampler import Sampler
from jaxprm.serve.static_sampler import StaticSampler
from jaxprm.serve.sampling import SamplingParams, apply_top_k_top_p, draw_tokens, sample_next

# Small bucket sets keep the number of compiled programs (and the test time) low.
BUCKETS = dict(batch_buckets=(1, 4, 8), prompt_buckets=(16, 32, 64), new_token_buckets=(8, 16, 32))


@pytest.fixture(scope="module")
def sampler(tiny):
    model, tok = tiny
    return Sampler(model, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id, **BUCKETS)


@pytest.fixture(scope="module")
def static(sampler):
    return StaticSampler(sampler)


def _prompts(tok):
    texts = ["You are walking on a frozen lake.", "Up", "P _ O G\n_ _ _ _\nWhich action? ```Left```", "Rules:"]
    return [tok.encode(t) for t in texts]


_REF_LEN = 64


@nnx.jit
def _ref_forward(model, toks):
    logits, _ = model(toks, jnp.arange(_REF_LEN, dtype=jnp.int32)[None])
    return logits


def _reference_logits(model, ids):
    """Full causal forward pass without a cache: float32 logits [T, V] of the sequence ``ids``.

    The sequence is right-padded to a fixed length (causality keeps the padding out of the real
    positions), so the reference compiles once.
    """
    assert len(ids) <= _REF_LEN
    toks = np.zeros((1, _REF_LEN), np.int32)
    toks[0, : len(ids)] = ids
    return np.asarray(_ref_forward(model, jnp.asarray(toks))[0, : len(ids)], np.float64)


def _reference_greedy(model, prompt, n):
    seq, lps = list(prompt), []
    for _ in range(n):
        z = _reference_logits(model, seq)[-1]
        t = int(np.argmax(z))
        lps.append(float(z[t] - np.log(np.exp(z - z.max()).sum()) - z.max()))
        seq.append(t)
    return seq[len(prompt):], lps


def test_greedy_matches_no_cache_reference(tiny, sampler, static):
    model, tok = tiny
    prompts = _prompts(tok)
    out = static.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    for p, c in zip(prompts, out):
        ref_toks, ref_lps = _reference_greedy(model, p, 8)
        assert c.token_ids == ref_toks
        np.testing.assert_allclose(c.logprobs, ref_lps, atol=1e-4)
        assert c.sampling_logprobs == c.logprobs  # greedy: processed == raw by definition
        assert c.finish_reason == "length" and c.prompt_ids == p and c.weight_version == sampler.weight_version


def test_batch_composition_does_not_change_a_row(tiny, sampler, static):
    _, tok = tiny
    prompts = _prompts(tok)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = static.generate([prompts[0]], sp)[0]
    # different batch size, prompt bucket (64 vs 16), output bucket (32 vs 16) and neighbours
    long_prompt = (prompts[2] * 8)[:40]
    crowd = static.generate([prompts[2], prompts[0], long_prompt], [SamplingParams(max_new_tokens=30, seed=7), sp, sp])
    assert crowd[1].token_ids == alone.token_ids
    np.testing.assert_allclose(crowd[1].logprobs, alone.logprobs, atol=1e-5)
    again = static.generate([prompts[0]], sp)[0]
    assert again.token_ids == alone.token_ids


def test_shared_prompts_are_prefilled_once_with_identical_results(tiny, sampler, static):
    _, tok = tiny
    p, q = _prompts(tok)[:2]
    sps = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]
    prep = static._prepare([p, p, p, p], sps, [0] * 4, [0] * 4)
    assert prep.prompt.shape[0] == 1 and list(prep.src) == [0, 0, 0, 0]  # one prefill row for 4
    shared = static.generate([p, p, p, p], sps)
    for sp, c in zip(sps, shared):
        alone = static.generate([p], sp)[0]
        assert c.token_ids == alone.token_ids
        np.testing.assert_allclose(c.logprobs, alone.logprobs, atol=1e-5)
    mixed = static.generate([p, q, p, p, q, p, p, q], [SamplingParams(max_new_tokens=10, temperature=0.0)] * 8)
    assert static._prepare([p, q] * 4, [sps[0]] * 8, [0] * 8, [0] * 8).prompt.shape[0] == 4  # bucket of 2
    assert mixed[0].token_ids == mixed[2].token_ids and mixed[1].token_ids == mixed[4].token_ids
    assert mixed[0].token_ids == static.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0))[0].token_ids


def test_seeds_and_choice_index_give_different_streams(tiny, sampler, static):
    _, tok = tiny
    p = _prompts(tok)[0]
    sp = [SamplingParams(max_new_tokens=16, temperature=1.5, seed=s, ignore_eos=True) for s in (1, 2)]
    a, b = static.generate([p, p], sp)
    assert a.token_ids != b.token_ids
    c0, c1 = static.generate([p, p], [sp[0], sp[0]], choice_index=[0, 1])
    assert c0.token_ids == a.token_ids and c1.token_ids != c0.token_ids
    u1, u2 = static.generate([p, p], SamplingParams(max_new_tokens=16, temperature=1.5, ignore_eos=True))
    assert u1.token_ids != u2.token_ids  # no seed: fresh randomness per row


def test_logprobs_under_temperature_and_truncation(tiny, sampler, static):
    model, tok = tiny
    p = _prompts(tok)[1]
    T, k = 0.7, 5
    c = static.generate([p], SamplingParams(max_new_tokens=6, temperature=T, top_k=k, seed=3, ignore_eos=True, top_logprobs=3))[0]
    seq = list(p)
    for j, t in enumerate(c.token_ids):
        z = _reference_logits(model, seq)[-1]
        raw = z - np.logaddexp.reduce(z)
        zs = z / T
        kth = np.sort(zs)[-k]
        zs = np.where(zs >= kth, zs, -np.inf)
        proc = zs - np.logaddexp.reduce(zs)
        assert np.isfinite(proc[t]), "sampled a token outside the top-k"
        np.testing.assert_allclose(c.logprobs[j], raw[t], atol=1e-4)
        np.testing.assert_allclose(c.sampling_logprobs[j], proc[t], atol=1e-4)
        top = c.top_logprobs[j]
        assert [i for i, _, _ in top] == list(np.argsort(-z)[:3])
        np.testing.assert_allclose([r for _, r, _ in top], raw[[i for i, _, _ in top]], atol=1e-4)
        np.testing.assert_allclose([q for _, _, q in top], proc[[i for i, _, _ in top]], atol=1e-4)
        seq.append(t)


def test_top_k_one_and_tiny_top_p_are_greedy(tiny, sampler, static):
    _, tok = tiny
    p = _prompts(tok)[0]
    greedy = static.generate([p], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    k1, p0 = static.generate([p, p], [SamplingParams(max_new_tokens=8, temperature=2.0, top_k=1, seed=5, ignore_eos=True),
                                       SamplingParams(max_new_tokens=8, temperature=2.0, top_p=1e-6, seed=5, ignore_eos=True)])
    assert k1.token_ids == greedy.token_ids == p0.token_ids
    np.testing.assert_allclose(k1.sampling_logprobs, 0.0, atol=1e-6)  # a point mass after truncation
    np.testing.assert_allclose(k1.logprobs, greedy.logprobs, atol=1e-5)


def test_first_token_distribution_matches_softmax(tiny, sampler, static):
    """512 seeded samples of the first token follow softmax(logits / T) (total variation < 0.12)."""
    model, tok = tiny
    p = _prompts(tok)[3]
    T = 3.0  # flatten the distribution so that many tokens are involved
    z = _reference_logits(model, p)[-1] / T
    probs = np.exp(z - np.logaddexp.reduce(z))
    params = [SamplingParams(max_new_tokens=1, temperature=T, seed=s, ignore_eos=True) for s in range(512)]
    counts = np.zeros_like(probs)
    for start in range(0, 512, 8):
        for c in static.generate([p] * 8, params[start:start + 8]):
            counts[c.token_ids[0]] += 1
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    expected_noise = 0.5 * np.sum(np.sqrt(probs * (1 - probs) / 512)) * np.sqrt(2 / np.pi)
    assert tv < max(0.12, 2 * expected_noise), tv


def test_stop_tokens_max_tokens_and_zero_tokens(tiny, sampler, static):
    model, tok = tiny
    prompts = _prompts(tok)
    greedy = static.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    stop = greedy[0].token_ids[2]
    first = greedy[0].token_ids.index(stop)
    out = static.generate(prompts[:3], [
        SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,)),
        SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
        SamplingParams(max_new_tokens=0),
    ])
    assert out[0].token_ids == greedy[0].token_ids[: first + 1]
    assert out[0].finish_reason == "stop" and out[0].stop_token_id == stop
    assert out[1].token_ids == greedy[1].token_ids[:3] and out[1].finish_reason == "length"
    assert out[2].token_ids == [] and out[2].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny, sampler, static):
    model, tok = tiny
    p = tok.encode("Up")
    first = static.generate([p], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids[0]
    s = StaticSampler(Sampler(model, eos_token_ids=(first,), **BUCKETS))  # pretend the greedy token is EOS
    c = s.generate([p], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    assert c.token_ids == [first] and c.finish_reason == "stop"
    c = s.generate([p], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(c.token_ids) == 4 and c.finish_reason == "length"


def test_steady_state_never_recompiles(tiny, sampler, static):
    _, tok = tiny
    prompts = _prompts(tok)
    rng = np.random.default_rng(0)
    times = static.precompile([3], prompt_len=15, max_new_tokens=10)  # ahead of time: B=4, Tp=16, N=16
    assert list(times) == [4]
    before = static.num_compilations
    for i in range(6):
        k = int(rng.integers(2, 5))
        rows = [prompts[int(j)][: int(rng.integers(1, 16))] for j in rng.integers(0, 4, size=k)]
        sps = [SamplingParams(max_new_tokens=int(rng.integers(9, 17)), temperature=float(rng.uniform(0, 2)),
                              seed=int(rng.integers(1 << 40)), stop_token_ids=(int(rng.integers(512)),)) for _ in rows]
        static.generate(rows, sps)
    assert static.num_compilations == before


def test_update_params_swaps_without_recompiling(tiny, sampler, static):
    model, tok = tiny
    s = sampler
    p = [tok.encode("You are walking on a frozen lake.")]
    sp = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = static.generate(p, sp)[0]
    v0, compiles = s.weight_version, static.num_compilations
    rng = np.random.default_rng(1)
    perturbed = jax.tree.map(lambda x: np.asarray(x) + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), s.params)
    assert s.update_params(perturbed) == v0 + 1 and s.weight_version == v0 + 1
    after = static.generate(p, sp)[0]
    assert after.weight_version == v0 + 1 and after.logprobs != before.logprobs
    assert static.num_compilations == compiles
    # a pure dict and a whole module work too; the version can be set explicitly
    assert s.update_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), version=v0 + 10) == v0 + 10
    assert static.generate(p, sp)[0].token_ids == before.token_ids
    assert s.update_params(model) == v0 + 11
    bad = nnx.to_pure_dict(s.params)
    bad["embed"] = jnp.zeros((3, 3))
    with pytest.raises(ValueError, match="shape"):
        s.update_params(bad)
    assert s.weight_version == v0 + 11 and static.num_compilations == compiles


def test_host_loop_matches_device_loop(tiny, sampler, static):
    model, tok = tiny
    host = StaticSampler(sampler, loop="host")
    prompts = _prompts(tok)
    sp = [SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=i) for i in range(4)]
    a = static.generate(prompts, sp)
    b = host.generate(prompts, sp)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.sampling_logprobs, y.sampling_logprobs, atol=1e-5)


def test_bad_requests_raise_clear_errors(tiny, sampler, static):
    with pytest.raises(ValueError, match="empty"):
        static.generate([[]])
    with pytest.raises(ValueError, match="outside"):
        static.generate([[1, 512]])
    with pytest.raises(ValueError, match="context length"):
        static.generate([[1] * 10], SamplingParams(max_new_tokens=sampler.max_context))
    with pytest.raises(ValueError, match="largest bucket"):
        static.generate([[1] * 65])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_more_rows_than_max_batch_are_split(tiny, sampler, static):
    _, tok = tiny
    p = tok.encode("Up")
    out = static.generate([p] * 11, SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out) == 11 and all(c.token_ids == out[0].token_ids for c in out)


# --- apply_top_k_top_p against a numpy reference ------------------------------------------------


def _np_filter(z, k, p):
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    V = len(z)
    kk = V if k <= 0 else min(k, V)
    keep = np.arange(V) < kk
    q = np.where(keep, np.exp(zs - zs[0]), 0.0)
    q /= q.sum()
    excl = np.cumsum(q) - q
    keep &= excl < p
    keep[0] = True
    thr = zs[keep].min()
    return np.where(z >= thr, z, -np.inf)


@settings(max_examples=40, deadline=None)
@given(
    V=st.sampled_from([2, 37]),  # two shapes: two compilations
    k=st.integers(-1, 40),
    p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_apply_top_k_top_p_matches_numpy(V, k, p, seed):
    z = np.random.default_rng(seed).normal(size=(1, V)).astype(np.float32) * 3
    zs = np.sort(z[0].astype(np.float64))[::-1][: (V if k <= 0 else min(k, V))]
    q = np.exp(zs - zs[0]) / np.exp(zs - zs[0]).sum()
    assume(np.all(np.abs(np.cumsum(q) - q - p) > 1e-4))  # no nucleus boundary within float32 noise
    got = np.asarray(apply_top_k_top_p(jnp.asarray(z), jnp.asarray([k], jnp.int32), jnp.asarray([p], jnp.float32)))
    want = _np_filter(z[0].astype(np.float64), k, p)
    assert np.array_equal(np.isfinite(got[0]), np.isfinite(want))
    np.testing.assert_array_equal(got[0][np.isfinite(got[0])], z[0][np.isfinite(want)])


@jax.jit
def _draw_many(key, z):
    keys = jax.random.split(key, 40_000)
    return draw_tokens(keys, jnp.broadcast_to(z, (keys.shape[0], z.shape[0])), block=64)


def test_two_stage_draw_follows_the_distribution_and_never_draws_excluded_tokens():
    """40,000 draws over 150 tokens (three blocks of 64, the last one padded): total variation
    within sampling noise of softmax(z), and the excluded tokens (-inf) never come up."""
    rng = np.random.default_rng(0)
    z = rng.normal(size=150).astype(np.float32) * 2
    z[[3, 64, 100, 149]] = -np.inf
    counts = np.bincount(np.asarray(_draw_many(jax.random.key(1), jnp.asarray(z))), minlength=150)
    probs = np.exp(z - z[np.isfinite(z)].max())
    probs /= probs.sum()
    assert counts[[3, 64, 100, 149]].sum() == 0 and counts.size == 150
    tv = 0.5 * np.abs(counts / counts.sum() - probs).sum()
    expected_noise = 0.5 * np.sum(np.sqrt(probs * (1 - probs) / counts.sum())) * np.sqrt(2 / np.pi)
    assert tv < 2 * expected_noise, (tv, expected_noise)


def test_greedy_rows_take_the_first_maximal_logit_and_do_not_depend_on_sampled_rows():
    z = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [5.0, 1.0, 5.0, 5.0], [0.0, 1.0, 3.0, 2.0]], jnp.float32)
    keys = jnp.asarray(np.arange(6, dtype=np.uint32).reshape(3, 2))
    zeros_i = jnp.zeros((3,), jnp.int32)

    def run(temperature):
        return sample_next(z, jnp.asarray(temperature, jnp.float32), zeros_i, jnp.ones((3,)), keys, zeros_i,
                           top_n=0, filtering=False)

    greedy, mixed = run([0.0, 0.0, 0.0]), run([0.0, 0.0, 1.0])
    assert np.asarray(greedy["token"]).tolist() == [1, 0, 2]
    assert np.asarray(mixed["token"])[:2].tolist() == [1, 0]
    np.testing.assert_array_equal(np.asarray(mixed["logprob"])[:2], np.asarray(greedy["logprob"])[:2])
