"""Loading and saving: presets, Hugging Face directories (ours and transformers'), clear errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprm.models import (ModelConfig, Tokenizer, Transformer, load_model, model_params,
                           save_pretrained)


@nnx.jit
def _forward(model, tokens, positions):
    return model(tokens, positions)[0]


def _inputs(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Map:\nP _ O\n_ _ G\nWhat is your move?"}], tokenize=True
    )
    tokens = jnp.asarray([ids], jnp.int32)
    return tokens, jnp.arange(len(ids), dtype=jnp.int32)[None]


def test_tiny_preset_is_seeded_and_consistent():
    model, tokenizer = load_model("tiny")
    again, _ = load_model("tiny")
    other, _ = load_model("tiny", seed=1)
    assert model.config.vocab_size == tokenizer.vocab_size
    assert 2 <= model.config.num_layers <= 4 and 64 <= model.config.hidden_size <= 128
    np.testing.assert_array_equal(model.embed[...], again.embed[...])
    assert not np.array_equal(model.embed[...], other.embed[...])
    assert tokenizer.eos_token_ids == {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")}
    bf16, _ = load_model("tiny", dtype="bfloat16")
    assert bf16.embed[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_load_round_trip(tmp_path, dtype):
    model, tokenizer = load_model("tiny", dtype=dtype)
    out = save_pretrained(model, tokenizer, tmp_path / "ckpt")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["torch_dtype"] == dtype
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == tokenizer.chat_template

    loaded, tok2 = load_model(out)
    assert loaded.config == model.config.replace(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    for name, value in model_params(model).items():
        np.testing.assert_array_equal(np.asarray(model_params(loaded)[name]), np.asarray(value), err_msg=name)
    assert tok2.backend.to_str() == tokenizer.backend.to_str()
    assert tok2.eos_token_ids == tokenizer.eos_token_ids and tok2.pad_token_id == tokenizer.pad_token_id
    tokens, positions = _inputs(tokenizer)
    np.testing.assert_array_equal(_forward(loaded, tokens, positions), _forward(model, tokens, positions))
    # dtype override on load
    other, _ = load_model(out, dtype="float32" if dtype == "bfloat16" else "bfloat16")
    assert other.config.param_dtype != dtype


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_saved_directory_loads_in_transformers(tmp_path, family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, tokenizer = load_model("tiny")
    config = ModelConfig(
        family=family, vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3", tie_embeddings=family == "qwen3",
        rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = Transformer(config, rngs=nnx.Rngs(3))
    # Random norm weights and biases, so a swapped tensor would show.
    from jaxprm.models import build_model

    rng = np.random.default_rng(0)
    params = {k: np.asarray(v) + rng.normal(0, 0.1, v.shape).astype(np.float32)
              for k, v in model_params(model).items()}
    model = build_model(config, params)
    out = save_pretrained(model, tokenizer, tmp_path / family)

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf_model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "system", "content": "Play."}, {"role": "user", "content": "Map:\nP _\n_ G"}]
    text = tokenizer.apply_chat_template(messages)
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = tokenizer.encode(text)
    assert hf_tok(text, add_special_tokens=True)["input_ids"] == ids
    assert hf_tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits.numpy()
    ours = _forward(model, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None])
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)


def test_loads_a_transformers_saved_directory(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.models._hf import hf_reference, torch_logits

    hf_model, _ = hf_reference("llama", seed=5, vocab_size=300, tie_word_embeddings=False)
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards + an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    _, tokenizer = load_model("tiny")
    tokenizer.save(tmp_path)
    model, tok = load_model(tmp_path)
    assert tok.vocab_size == tokenizer.vocab_size
    tokens = np.random.default_rng(0).integers(0, 300, (1, 12))
    np.testing.assert_allclose(
        np.asarray(_forward(model, jnp.asarray(tokens, jnp.int32), jnp.arange(12)[None])),
        torch_logits(hf_model, tokens), atol=1e-4, rtol=0)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a preset"):
        load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="float16")
    model, tokenizer = load_model("tiny")
    out = save_pretrained(model, tokenizer, tmp_path / "ckpt")
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(out)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nowhere")
