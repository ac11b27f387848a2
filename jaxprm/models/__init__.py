"""Decoder-only LLMs in Flax NNX (layer 5): Llama / Qwen2 / Qwen3, KV cache, loading and saving.

Public API:

* ``ModelConfig`` -- frozen config; ``from_hf(dict)`` / ``to_hf()``.
* ``Transformer(config, *, rngs)`` -- ``logits, cache = model(tokens, positions, cache=None)``;
  also ``model.hidden_states(...)`` and ``model.logits(hidden)``.
* ``KVCache`` -- ``k, v [L, B, S, K, hd]``; ``KVCache.init(config, batch_size, max_len)``.
* ``next_token_logprobs`` (the learner's one log-prob function), ``logprobs_of``, ``shift_targets``, ``token_logprobs``, ``entropy_of`` -- float32 learner helpers.
* ``Tokenizer`` -- ``tokenizers`` + jinja2 chat template.
* ``load_model(name_or_path, *, dtype=None)`` -> ``(model, tokenizer)``: presets ``"tiny"``,
  ``"smollm2-135m"``, a Hugging Face directory, or a ``.gguf`` file.
* ``save_pretrained(model, tokenizer, out_dir)`` -- Hugging Face safetensors layout.
* ``LoraConfig``, ``add_lora(model, lora, key)`` -- ``nnx.LoRA`` adapters on the stacked projections;
  ``merged_params(base, adapters, scale)`` folds them into the weights.
"""

from jaxprm.models.config import ModelConfig
from jaxprm.models.hf_io import load_hf_dir, load_hf_model, save_pretrained
from jaxprm.models.gguf_io import load_gguf
from jaxprm.models.loading import PRESETS, load_model, smollm2_gguf_path
from jaxprm.models.lora import LORA_TARGETS, LoraConfig, add_lora, merged_params
from jaxprm.models.logprobs import entropy_of, logprobs_of, next_token_logprobs, shift_targets, token_logprobs
from jaxprm.models.params import build_model, model_params
from jaxprm.models.tiny import build_tiny_tokenizer, tiny_config
from jaxprm.models.tokenizer import Tokenizer
from jaxprm.models.transformer import KVCache, Transformer

__all__ = [
    "ModelConfig",
    "Transformer",
    "KVCache",
    "Tokenizer",
    "load_model",
    "save_pretrained",
    "load_hf_dir",
    "load_hf_model",
    "load_gguf",
    "build_model",
    "model_params",
    "logprobs_of",
    "next_token_logprobs",
    "shift_targets",
    "token_logprobs",
    "entropy_of",
    "tiny_config",
    "build_tiny_tokenizer",
    "smollm2_gguf_path",
    "PRESETS",
    "LoraConfig",
    "LORA_TARGETS",
    "add_lora",
    "merged_params",
]
