"""Transformer behaviour: KV cache equivalence, padding, logprobs, gradients, config checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprm.models import (KVCache, ModelConfig, Transformer, entropy_of, logprobs_of, shift_targets,
                           token_logprobs)
from jaxprm.models.transformer import init_params


def _config(family="qwen3", **kw):
    base = dict(family=family, vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=family == "qwen2",
                qk_norm=family == "qwen3")
    return ModelConfig(**{**base, **kw})


@nnx.jit
def _forward(model, tokens, positions):
    return model(tokens, positions)[0]


@nnx.jit
def _forward_cached(model, tokens, positions, cache):
    return model(tokens, positions, cache)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_prefill_then_decode_matches_full_forward_with_right_padding(family):
    config = _config(family, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = Transformer(config, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    lengths = np.array([9, 4, 6])  # full sequence lengths (prompt + generated)
    prompt = np.array([5, 2, 3])  # prompt lengths inside them
    B, T, S = 3, 12, 16
    tokens = rng.integers(0, config.vocab_size, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    full = np.asarray(_forward(model, jnp.asarray(tokens), jnp.asarray(positions)))

    # Prefill with the prompts right-padded to the longest prompt, pad entries continuing positions.
    P = int(prompt.max())
    pad_tokens = np.where(np.arange(P)[None] < prompt[:, None], tokens[:, :P], 0)
    cache = KVCache.init(config, B, S)
    logits, cache = _forward_cached(model, jnp.asarray(pad_tokens), jnp.asarray(positions[:, :P]), cache)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(logits)[b, : prompt[b]], full[b, : prompt[b]], atol=1e-5)
    # Decode one token per row per step at each row's own position (rows at different lengths).
    got = {b: [] for b in range(B)}
    pos = prompt.copy()
    for _ in range(int((lengths - prompt).max())):
        step_tok = tokens[np.arange(B), np.minimum(pos, T - 1)][:, None]
        logits, cache = _forward_cached(model, jnp.asarray(step_tok), jnp.asarray(pos[:, None]), cache)
        for b in range(B):
            if pos[b] < lengths[b]:
                got[b].append(np.asarray(logits)[b, 0])
        pos = np.minimum(pos + 1, lengths)
    for b in range(B):
        np.testing.assert_allclose(np.stack(got[b]), full[b, prompt[b]: lengths[b]], atol=1e-5)
    assert cache.k.shape == (config.num_layers, B, S, config.num_kv_heads, config.head_dim)
    assert cache.k.dtype == config.dtype


def test_padding_never_changes_real_entries():
    config = _config("llama")
    model = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    real = rng.integers(0, 61, (1, 7)).astype(np.int32)
    alone = _forward(model, jnp.asarray(real), jnp.arange(7, dtype=jnp.int32)[None])
    # Right padding: any tokens and any positions after the real ones.
    right = np.concatenate([real, rng.integers(0, 61, (1, 5))], axis=1).astype(np.int32)
    right_pos = np.concatenate([np.arange(7), rng.integers(-3, 50, 5)])[None].astype(np.int32)
    out = _forward(model, jnp.asarray(right), jnp.asarray(right_pos))
    np.testing.assert_allclose(out[:, :7], alone, atol=1e-5)
    # Left padding: pad entries with a negative position are never attended.
    left = np.concatenate([rng.integers(0, 61, (1, 3)), real], axis=1).astype(np.int32)
    left_pos = np.concatenate([[-1, -1, -1], np.arange(7)])[None].astype(np.int32)
    out = _forward(model, jnp.asarray(left), jnp.asarray(left_pos))
    np.testing.assert_allclose(out[:, 3:], alone, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()
    # Other rows of the batch do not interact.
    both = np.concatenate([right, rng.integers(0, 61, (1, 12)).astype(np.int32)])
    out = _forward(model, jnp.asarray(both), jnp.asarray(np.stack([right_pos[0], np.arange(12)])))
    np.testing.assert_allclose(out[:1, :7], alone, atol=1e-5)


def test_cache_drops_out_of_range_positions():
    config = _config("qwen2")
    model = Transformer(config, rngs=nnx.Rngs(0))
    cache = KVCache.init(config, 1, 4)
    tokens = jnp.asarray([[3, 4, 5, 6, 7, 8]], jnp.int32)
    positions = jnp.asarray([[0, 1, -1, 3, 4, 9]], jnp.int32)
    logits, new = _forward_cached(model, tokens, positions, cache)
    assert np.isfinite(np.asarray(logits)).all()
    k = np.asarray(new.k)
    assert np.abs(k[:, 0, [0, 1, 3]]).sum(axis=(1, 2, 3)).min() > 0  # written slots
    assert np.abs(k[:, 0, 2]).max() == 0  # slot 2 only had a negative position: untouched
    # A row whose real positions fit behaves as if the other entries were absent.
    ref, _ = _forward_cached(model, tokens[:, :2], positions[:, :2], KVCache.init(config, 1, 4))
    np.testing.assert_allclose(logits[:, :2], ref, atol=1e-5)


def test_token_logprobs_shift_and_float32():
    config = _config("llama")
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    lp = nnx.jit(token_logprobs)(model, tokens, positions)
    assert lp.dtype == jnp.float32 and lp.shape == (2, 6)
    logits = _forward(model, tokens, positions)
    manual = np.asarray(jax.nn.log_softmax(logits, -1))
    toks = np.asarray(tokens)
    expected = np.take_along_axis(manual[:, :-1], toks[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(lp)[:, :-1], expected, atol=1e-5)
    assert np.all(np.asarray(lp[:, -1]) == 0)
    np.testing.assert_array_equal(shift_targets(tokens)[:, :-1], tokens[:, 1:])
    np.testing.assert_allclose(logprobs_of(logits, shift_targets(tokens))[:, :-1], lp[:, :-1], atol=1e-6)
    ent = entropy_of(logits)
    assert ent.shape == (2, 6) and float(ent.min()) >= 0


def test_gradients_flow_through_the_layer_scan():
    config = _config("qwen3", num_layers=3)
    model = Transformer(config, rngs=nnx.Rngs(0), remat=True)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 5)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))

    def loss(m):
        return -token_logprobs(m, tokens, positions)[:, :-1].mean()

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    # Each layer of the stacked q projection gets its own nonzero gradient.
    gq = np.asarray(grads.layers.q_proj[...])
    assert gq.shape[0] == 3 and (np.abs(gq).reshape(3, -1).max(axis=1) > 0).all()


def test_config_validation_and_hf_round_trip():
    with pytest.raises(ValueError, match="family"):
        _config("gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        _config(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="param_dtype"):
        _config(param_dtype="float16")
    with pytest.raises(ValueError, match="rope_type"):
        _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        _config(rope_scaling={"rope_type": "llama3", "factor": 2.0})
    for family in ("llama", "qwen2", "qwen3"):
        config = _config(family, tie_embeddings=True, initializer_range=0.125,
                         rope_scaling={"type": "linear", "factor": 3.0}, param_dtype="bfloat16")
        again = ModelConfig.from_hf(config.to_hf())
        assert again == config and hash(again) == hash(config)
    with pytest.raises(ValueError, match="initializer_range"):
        _config(initializer_range=0.0)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**_config().to_hf(), "model_type": "mistral"})
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf({**_config("qwen2").to_hf(), "use_sliding_window": True})
    # transformers >= 5 writes rope settings under rope_parameters.
    hf = _config("llama").to_hf()
    hf.pop("rope_theta"), hf.pop("rope_scaling")
    hf["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("std", [0.02, 0.125])
def test_initial_weights_follow_initializer_range(std):
    params = init_params(_config("llama", initializer_range=std, hidden_size=64, head_dim=16), jax.random.key(0))
    for name in ("embed", "layers.q_proj", "layers.down_proj"):
        assert abs(float(jnp.std(params[name])) - std) < 0.1 * std, name
    assert bool(jnp.all(params["layers.attn_norm"] == 1.0))


def test_causal_attention_in_chunks_equals_the_masked_attention():
    """Query chunks that skip later keys: same values and gradients as the full causal mask (to the
    float32 rounding of the scores, which ``attention`` keeps in float32), for a length that is not
    a multiple of the chunk, with padding keys and a row of one real token."""
    from jaxprm.models.transformer import attention, causal_attention

    rng = np.random.default_rng(0)
    B, T, H, K, hd = 3, 45, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, n, hd)), jnp.float32) for n in (H, K, K))
    valid = jnp.asarray(np.arange(T)[None, :] < np.array([45, 30, 1])[:, None])
    idx = jnp.arange(T)
    mask = (idx[None, :, None] >= idx[None, None, :]) & valid[:, None, :]
    w = jnp.asarray(rng.standard_normal((B, T, H, hd)), jnp.float32)

    def full(q, k, v):
        return attention(q, k, v, mask)

    g_full = jax.grad(lambda *a: (full(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    for chunk in (8, 16, 45, 64):
        def chunked(q, k, v, chunk=chunk):
            return causal_attention(q, k, v, valid, chunk)

        np.testing.assert_allclose(chunked(q, k, v), full(q, k, v), rtol=1e-5, atol=1e-6)
        g_chunk = jax.grad(lambda *a: (chunked(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(g_chunk, g_full):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_long_forward_uses_the_chunks_and_matches_the_mask(monkeypatch):
    """A cache-free forward of T >= 2 * CAUSAL_CHUNK runs causal_attention; its logits equal the
    masked path's (chunking off) to float32 rounding."""
    import jaxprm.models.transformer as tr

    config = _config("llama")
    model = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    B, T = 2, 40
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
    positions = jnp.asarray(np.where(np.arange(T)[None] < np.array([[40], [25]]), np.arange(T)[None], -1), jnp.int32)
    calls = []
    original = tr.causal_attention
    monkeypatch.setattr(tr, "causal_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    monkeypatch.setattr(tr, "CAUSAL_CHUNK", 8)
    chunked = model(tokens, positions)[0]
    assert calls, "T >= 2 * CAUSAL_CHUNK must take the chunked path"
    monkeypatch.setattr(tr, "CAUSAL_CHUNK", 1000)
    masked = model(tokens, positions)[0]
    assert len(calls) == 1
    np.testing.assert_allclose(np.asarray(chunked)[0], np.asarray(masked)[0], atol=2e-5)
    np.testing.assert_allclose(np.asarray(chunked)[1, :25], np.asarray(masked)[1, :25], atol=2e-5)
