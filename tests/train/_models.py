"""Small real models for trainer tests (the jaxprm.models Transformer at toy sizes)."""

from flax import nnx

from jaxprm.models.config import ModelConfig
from jaxprm.models.transformer import Transformer


def toy_transformer(seed: int = 0, vocab: int = 64) -> Transformer:
    cfg = ModelConfig(family="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    return Transformer(cfg, rngs=nnx.Rngs(seed))
