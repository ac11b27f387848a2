"""Hugging Face directories: load ``config.json`` + ``*.safetensors`` shards, save the same layout.

A saved directory holds ``config.json`` (architectures / model_type for transformers, vLLM, SGLang),
``model.safetensors`` (HF tensor names, ``[out, in]`` weights, param dtype), ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxprm.models.config import ModelConfig
from jaxprm.models.params import build_model, hf_to_params, params_to_hf
from jaxprm.models.tokenizer import Tokenizer
from jaxprm.models.transformer import Transformer

__all__ = ["load_hf_model", "load_hf_dir", "save_pretrained", "read_hf_config"]


def read_hf_config(directory: str | os.PathLike) -> ModelConfig:
    """``ModelConfig`` of a Hugging Face model directory (its ``config.json``)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs config.json")
    return ModelConfig.from_hf(json.loads(path.read_text()))


def _shard_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"safetensors shards listed in the index are missing: {missing}")
    return files


def load_hf_model(directory: str | os.PathLike, *, dtype: str | None = None) -> Transformer:
    """A ``Transformer`` from a Hugging Face directory (config.json + safetensors shards).

    ``dtype`` (``"float32"`` | ``"bfloat16"``) overrides the checkpoint's ``torch_dtype``.
    """
    d = Path(directory)
    config = read_hf_config(d)
    if dtype is not None:
        config = config.replace(param_dtype=dtype)
    where: dict[str, Path] = {}
    with contextlib.ExitStack() as stack:
        handles = {}
        for f in _shard_files(d):
            handles[f] = stack.enter_context(safe_open(str(f), framework="numpy"))
            for key in handles[f].keys():
                where[key] = f
        params = hf_to_params(
            config, lambda k: handles[where[k]].get_tensor(k), lambda k: k in where
        )
    return build_model(config, params)


def load_hf_dir(directory: str | os.PathLike, *, dtype: str | None = None) -> tuple[Transformer, Tokenizer]:
    """``(model, tokenizer)`` from a Hugging Face directory (weights + tokenizer files)."""
    return load_hf_model(directory, dtype=dtype), Tokenizer.from_dir(directory)


def save_pretrained(model: Transformer, tokenizer: Tokenizer, out_dir: str | os.PathLike) -> Path:
    """Write ``model`` and ``tokenizer`` to ``out_dir`` in the Hugging Face layout; returns the path.

    Tied models store no ``lm_head.weight`` (as transformers does). Files are written to temporary
    names and renamed, so a reader never sees a half-written ``model.safetensors``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model only {config.vocab_size} embeddings"
        )
    eos_ids = sorted(tokenizer.eos_token_ids)
    config = config.replace(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tensors = params_to_hf(model)
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    for stale in out.glob("model-*.safetensors"):
        stale.unlink()
    with contextlib.suppress(FileNotFoundError):
        (out / "model.safetensors.index.json").unlink()
    _write_json(out / "config.json", config.to_hf())
    generation = {"eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0],
                  "pad_token_id": tokenizer.pad_token_id}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    _write_json(out / "generation_config.json", generation)
    tokenizer.save(out)
    return out


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default))
    os.replace(tmp, path)


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
