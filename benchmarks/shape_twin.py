"""A model's *shape twin*: the same config and tokenizer, random weights.

    python -m benchmarks.shape_twin SOURCE OUT [--no-weights] [--seed 0]

Throughput with greedy decoding and ``ignore_eos`` does not depend on the weights' values, only on
the architecture, so a benchmark may run on a twin where the real checkpoint cannot go (the
SmolLM2-135M GGUF is 98 MB, over what travels to a lent GPU machine). ``SOURCE`` is anything
``jaxprm.models.load_model`` loads, or a directory holding only ``config.json`` and the tokenizer
files (what ``--no-weights`` writes). ``OUT`` gets the Hugging Face layout (``save_pretrained``):
config.json, tokenizer files and, unless ``--no-weights``, a float32 ``model.safetensors`` of
``Transformer(config, rngs=nnx.Rngs(seed))``, which both our loader and transformers read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flax import nnx

from jaxprm.models import Transformer, load_model
from jaxprm.models.hf_io import read_hf_config, save_pretrained
from jaxprm.models.tokenizer import Tokenizer


def config_and_tokenizer(source: str):
    """``(ModelConfig, Tokenizer)`` of ``source``: a weightless twin directory, or any loadable model."""
    path = Path(source)
    if path.is_dir() and not any(path.glob("*.safetensors")):
        return read_hf_config(path), Tokenizer.from_dir(path)
    model, tok = load_model(source)
    return model.config, tok


def write_twin(source: str, out: str | Path, *, weights: bool = True, seed: int = 0) -> Path:
    """Write ``source``'s shape twin to ``out``; returns ``out``."""
    config, tok = config_and_tokenizer(source)
    out = Path(out)
    if weights:
        return save_pretrained(Transformer(config, rngs=nnx.Rngs(seed)), tok, out)
    out.mkdir(parents=True, exist_ok=True)
    config = config.replace(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    (out / "config.json").write_text(json.dumps(config.to_hf(), indent=2, default=str) + "\n")
    tok.save(out)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shape_twin", description=__doc__.split("\n")[0])
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--no-weights", action="store_true", help="config and tokenizer only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = write_twin(args.source, args.out, weights=not args.no_weights, seed=args.seed)
    cfg = json.loads((out / "config.json").read_text())
    print(f"wrote {out}: {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
          f"vocab {cfg.get('vocab_size')}, weights {'random' if not args.no_weights else 'none'}")


if __name__ == "__main__":
    main()
