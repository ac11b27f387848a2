"""GGUF files (llama.cpp): config from metadata, dequantized weights, tokenizer, chat template.

Supported architectures: ``llama``, ``qwen2``, ``qwen3``. Weights are dequantized to float32 with
``gguf.quants.dequantize`` (numpy shape = HF ``[out, in]``). llama.cpp's converter permutes the
rows of the llama ``attn_q`` / ``attn_k`` weights (it interleaves the two RoPE halves of each head
for its GPT-J style rotation); we undo that so the HF "rotate half" RoPE applies. Qwen files use
llama.cpp's NeoX rotation and are stored unpermuted.

The tokenizer (``tokenizer.ggml.model == "gpt2"``: byte-level BPE) is rebuilt from
``tokenizer.ggml.tokens`` / ``merges`` / ``token_type`` into a ``tokenizers.Tokenizer``; the
pre-tokenizer follows ``tokenizer.ggml.pre`` (``smollm``: single digits + GPT-2 byte-level split,
matching SmolLM2's own tokenizer.json; ``llama-bpe``/``llama3`` and ``qwen2``: their split regexes).
Control tokens (type 3) become special added tokens; user-defined tokens (type 4) plain added tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from jaxprm.models.config import ModelConfig
from jaxprm.models.params import build_model, hf_to_params
from jaxprm.models.tokenizer import Tokenizer
from jaxprm.models.transformer import Transformer

__all__ = ["load_gguf", "gguf_config", "gguf_tokenizer"]

ARCHITECTURES = ("llama", "qwen2", "qwen3")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# stacked name -> GGUF per-layer tensor name and how to reshape its [out, in] matrix
_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "o_proj": "attn_output.weight",
    "o_bias": "attn_output.bias",
    "mlp_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}
# the HF name of each, for reuse of params.hf_to_params
_HF = {
    "attn_norm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "o_proj": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias", "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


class _Meta:
    """Read access to a GGUF file's metadata fields."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks metadata key {key!r}")
        return value


def _open(path: str | os.PathLike) -> tuple[GGUFReader, _Meta]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {p} not found")
    reader = GGUFReader(str(p))
    return reader, _Meta(reader, p)


def gguf_config(meta: _Meta, tensor_names: set[str], vocab_size: int) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (``{arch}.block_count``, ``.embedding_length`` ...)."""
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {meta.path}: architecture {arch!r} is not supported; allowed: {ARCHITECTURES}")
    key = lambda name: f"{arch}.{name}"  # noqa: E731
    hidden = int(meta.require(key("embedding_length")))
    num_heads = int(meta.require(key("attention.head_count")))
    head_dim = meta.get(key("attention.key_length")) or meta.get(key("rope.dimension_count")) or hidden // num_heads
    rope_scaling = None
    scaling_type = meta.get(key("rope.scaling.type"))
    if scaling_type not in (None, "none"):
        factor = meta.get(key("rope.scaling.factor"))
        rope_scaling = {"rope_type": scaling_type, "factor": float(factor)}
        original = meta.get(key("rope.scaling.original_context_length"))
        if original:
            rope_scaling["original_max_position_embeddings"] = int(original)
    has_bias = "blk.0.attn_q.bias" in tensor_names
    o_bias = "blk.0.attn_output.bias" in tensor_names
    return ModelConfig(
        family=arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(meta.require(key("feed_forward_length"))),
        num_layers=int(meta.require(key("block_count"))),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(key("attention.head_count_kv")) or num_heads),
        head_dim=int(head_dim),
        rope_theta=float(meta.get(key("rope.freq_base"), 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(meta.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        tie_embeddings="output.weight" not in tensor_names,
        qkv_bias=has_bias or arch == "qwen2",
        qk_norm=arch == "qwen3",
        max_position_embeddings=int(meta.get(key("context_length"), 4096)),
        param_dtype="float32",
        o_bias=o_bias,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows ``[n_head, hd/2, 2] -> [n_head, 2, hd/2]``."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_tokenizer(meta: _Meta) -> Tokenizer:
    """The tokenizer described by the file's ``tokenizer.*`` metadata (gpt2 byte-level BPE)."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF file {meta.path}: tokenizer.ggml.model={kind!r} is not supported; allowed: ['gpt2']"
        )
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "qwen2", "deepseek-r1-qwen"):
        split = _QWEN2_SPLIT if "qwen" in pre else _LLAMA3_SPLIT
        if "qwen" in pre:
            backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # "default", "gpt-2" and unknown: GPT-2's own split
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4]
    backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    bos, eos = tok("bos_token_id"), tok("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        backend.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            ),
        ])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    context = meta.get(f"{meta.get('general.architecture')}.context_length")
    return Tokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=bos,
        eos_token=eos,
        pad_token=tok("padding_token_id") or eos,
        unk_token=tok("unknown_token_id"),
        add_bos_token=add_bos,
        model_max_length=int(context) if context else None,
    )


def load_gguf(path: str | os.PathLike, *, dtype: str | None = None) -> tuple[Transformer, Tokenizer]:
    """``(model, tokenizer)`` from a GGUF file, weights dequantized (float32 unless ``dtype``)."""
    reader, meta = _open(path)
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = gguf_tokenizer(meta)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"GGUF file {path} lacks tensor 'token_embd.weight'")
    vocab_size = int(embd.shape[-1])  # GGUF shapes are [in, out]: [D, V]
    config = gguf_config(meta, set(tensors), vocab_size)
    if dtype is not None:
        config = config.replace(param_dtype=dtype)
    arch = config.family

    def load(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"GGUF file {path} lacks tensor {name!r}")
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": load("token_embd.weight"),
        "model.norm.weight": load("output_norm.weight"),
    }
    if not config.tie_embeddings:
        hf["lm_head.weight"] = load("output.weight")
    for i in range(config.num_layers):
        for name, gname in _LAYER.items():
            full = f"blk.{i}.{gname}"
            if full not in tensors:
                continue
            w = load(full)
            if arch == "llama" and name in ("q_proj", "q_bias"):
                w = _unpermute(w, config.num_heads)
            elif arch == "llama" and name in ("k_proj", "k_bias"):
                w = _unpermute(w, config.num_kv_heads)
            hf[f"model.layers.{i}.{_HF[name]}"] = w
    params = hf_to_params(config, hf.__getitem__, hf.__contains__)
    del hf
    return build_model(config, params), tokenizer
