"""``benchmarks.shape_twin``: a weightless twin directory (config + tokenizer) turns into a model with
the source's architecture and tokenizer and fresh random weights, which our loader reads back."""

import numpy as np

from benchmarks.shape_twin import write_twin
from jaxprm.models import load_model, model_params


def test_a_twin_has_the_sources_shapes_and_tokenizer_but_its_own_weights(tmp_path):
    src, src_tok = load_model("tiny", seed=3)
    shape = write_twin("tiny", tmp_path / "shape", weights=False)
    assert not list(shape.glob("*.safetensors"))
    twin, twin_tok = load_model(write_twin(shape, tmp_path / "twin", seed=0))
    assert twin.config.to_hf() == src.config.replace(
        bos_token_id=src_tok.bos_token_id, eos_token_id=src_tok.eos_token_id, pad_token_id=src_tok.pad_token_id).to_hf()
    text = "<|im_start|>user\nP _ _ G<|im_end|>\n"
    assert twin_tok.encode(text) == src_tok.encode(text)
    assert twin_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True) == \
        src_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    a, b = model_params(src), model_params(twin)
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert not np.allclose(np.asarray(a["embed"]), np.asarray(b["embed"]))
