"""GGUF loading for each architecture: files written like llama.cpp's converter writes them
(tensor names, llama q/k row permutation, F32 / Q8_0 storage, gpt2 tokenizer metadata), loaded by
us and by transformers, logits compared."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from jaxprm.models import load_model  # noqa: E402
from jaxprm.models.gguf_io import _unpermute  # noqa: E402

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's ``LlamaModel.permute`` (what the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, family, state, hf_config, tokenizer, quant=None, rope_scaling=None):
    """Write an HF state dict as llama.cpp would (matrices quantized to ``quant`` if given)."""
    arch = family
    w = gguf.GGUFWriter(str(path), arch)
    c = hf_config
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling["rope_type"]))
        w.add_rope_scaling_factor(rope_scaling["factor"])
    spec = json.loads(tokenizer.backend.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_chat_template(tokenizer.chat_template)

    def add(name, arr):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quant is not None and arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, arr)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state and not c.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, g_name in _NAMES.items():
            key = f"model.layers.{i}.{hf_name}"
            if key not in state:
                continue
            arr = state[key]
            if family == "llama" and "q_proj" in hf_name:
                arr = _permute(arr, c.num_attention_heads)
            elif family == "llama" and "k_proj" in hf_name:
                arr = _permute(arr, c.num_key_value_heads)
            add(f"blk.{i}.{g_name}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    for heads in (1, 2, 4):
        np.testing.assert_array_equal(_unpermute(_permute(w, heads), heads), w)
    assert not np.array_equal(_permute(w, 2), w)


@pytest.mark.parametrize(
    "family,quant,tied",
    [("llama", None, False), ("llama", "Q8_0", True), ("qwen2", None, False), ("qwen3", "Q8_0", True)],
)
def test_gguf_logits_match_transformers(tmp_path, family, quant, tied):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.models._hf import hf_reference

    _, tokenizer = load_model("tiny")
    hf_model, hf_config = hf_reference(family, seed=7, vocab_size=tokenizer.vocab_size,
                                       tie_word_embeddings=tied)
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    qtype = None if quant is None else gguf.GGMLQuantizationType[quant]
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, family, state, hf_config, tokenizer, quant=qtype)

    model, tok = load_model(path)
    c = model.config
    assert (c.family, c.tie_embeddings, c.qkv_bias, c.qk_norm) == (
        family, tied, family == "qwen2", family == "qwen3")
    assert tok.backend.encode("Map:\nP _ G ```Left```").ids == tokenizer.encode("Map:\nP _ G ```Left```")
    assert tok.chat_template == tokenizer.chat_template and tok.eos_token_ids == tokenizer.eos_token_ids

    # transformers' GGUF config mapping ignores qwen3's attention.key_length (head_dim), so it is
    # given the config; the weights still come from the GGUF file through its own converter.
    extra = {"config": hf_config} if family == "qwen3" else {}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, attn_implementation="eager", **extra).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Map:\nP _\n_ G"}], tokenize=True)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits.numpy()
    ours = nnx.jit(lambda m, t, p: m(t, p)[0])(
        model, jnp.asarray([ids], jnp.int32), jnp.arange(len(ids), dtype=jnp.int32)[None])
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4, rtol=0)
    if quant is None:  # unquantized: the very same weights as the torch model we started from
        with torch.no_grad():
            orig = hf_model(torch.tensor([ids])).logits.numpy()
        np.testing.assert_allclose(np.asarray(ours), orig, atol=1e-4, rtol=0)


def test_gguf_rope_scaling_metadata(tmp_path):
    pytest.importorskip("transformers")
    from tests.models._hf import hf_reference

    _, tokenizer = load_model("tiny")
    hf_model, hf_config = hf_reference("llama", vocab_size=tokenizer.vocab_size, num_hidden_layers=1)
    state = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    path = tmp_path / "scaled.gguf"
    write_gguf(path, "llama", state, hf_config, tokenizer, rope_scaling={"rope_type": "linear", "factor": 4.0})
    model, _ = load_model(path, dtype="bfloat16")
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert model.embed[...].dtype == jnp.bfloat16
