"""Tree-packed attention (the dense ``subtree_end`` mask and the block-sparse ``query_blocks`` /
``key_blocks`` path): every packed token's logits equal the logits of the same token in each flat
row that contains it, for the tiny policy and a Qwen2-shaped model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprm
from jaxprm.models import ModelConfig, Transformer
from jaxprm.models.tiny import tiny_config
from jaxprm.models import next_token_logprobs
from tests.learner.trees import random_groups

CONFIGS = {
    "tiny": lambda: tiny_config(),
    "qwen2": lambda: ModelConfig(family="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, rope_theta=1e6),
}


@pytest.mark.parametrize("name,path", [("tiny", "dense"), ("tiny", "blocks"), ("qwen2", "blocks"),
                                       ("tiny", "coarse_blocks")])
def test_packed_logits_equal_per_row_logits(name, path):
    config = CONFIGS[name]()
    model = Transformer(config, rngs=nnx.Rngs(0))
    rows = random_groups(5, groups=3, leaves=(2, 6), share=0.8, vocab=config.vocab_size, turns=4)
    flat = jaxprm.pad_rows(rows, len_buckets=(32, 64, 128))
    # coarse_blocks: coarse key-length and block-count buckets (fewer shapes, more padding)
    coarse = {"key_len_buckets": (8, 16, 256), "block_buckets": (64,)} if path == "coarse_blocks" else {}
    pk = jaxprm.pack_rows(rows, flat_shape=flat.shape, len_buckets=(32, 64, 128), query_block=8, **coarse)
    B, T = flat.shape
    if coarse:
        assert pk.key_blocks.shape[1:] == (64, 256) and pk.key_blocks.shape[2] != T

    @nnx.jit
    def fwd(m, tokens, positions, attn):
        return m(tokens, positions, **attn)[0]

    flat_logits = fwd(model, flat.tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), {})
    attn = ({"subtree_end": pk.subtree_end} if path == "dense" else
            {"query_blocks": pk.query_blocks, "key_blocks": pk.key_blocks})
    packed = fwd(model, pk.tokens, pk.positions, attn)
    R, L, V = packed.shape
    fi = np.asarray(pk.flat_index)
    scale = float(jnp.abs(flat_logits).max())
    for b, row in enumerate(rows):
        n = len(row.tokens)
        # Token i (i >= 1) of row b sits at packed slot fi[b, i - 1]; token 0 is its tree's root.
        slots = fi[b, : n - 1]
        got = packed.reshape(R * L, V)[slots]
        np.testing.assert_allclose(got, flat_logits[b, 1:n], rtol=1e-5, atol=2e-5 * scale)
    # Log-probs: the packed token-aligned ones are the flat prediction-position ones.
    flat_lp = next_token_logprobs(flat_logits, flat.tokens) * flat.loss_mask
    packed_lp = jaxprm.learner.packed_logprobs(packed, pk.tokens, pk.parents) * pk.loss_mask
    np.testing.assert_allclose(jaxprm.learner.gather_to_flat(packed_lp, pk.flat_index), flat_lp, rtol=1e-5, atol=1e-5)


def test_subtree_end_needs_matching_shape_and_no_cache():
    config = CONFIGS["qwen2"]()
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="subtree_end"):
        model(tokens, tokens, subtree_end=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="query_blocks"):
        model(tokens, tokens, query_blocks=jnp.zeros((1, 2, 2), jnp.int32))
