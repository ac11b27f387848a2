"""``benchmarks.quantized_decode``: its int8 multiply-reduce computes what qwix's einsum computes, and
its rounded model is the float model with each weight rounded through qwix (the original untouched)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")

from benchmarks.quantized_decode import CONTRACTED, SPECS, _mul_reduce, _quantize, rounded_model  # noqa: E402


@pytest.mark.parametrize("name", ["q_proj", "o_proj", "down_proj"])  # 3-D output, 2 contracted axes, 2-D
def test_the_fused_int8_projection_is_qwix_einsum(name):
    spec = SPECS[name]
    shapes = {"q_proj": (12, 3, 4), "k_proj": (12, 1, 4), "v_proj": (12, 1, 4), "o_proj": (3, 4, 12),
              "gate_proj": (12, 20), "up_proj": (12, 20), "down_proj": (20, 12)}
    kw, kx = jax.random.split(jax.random.key(hash(name) % 1000))
    w = jax.random.normal(kw, shapes[name], jnp.float32)
    contracted = tuple(a - 1 for a in CONTRACTED[name])
    x = jax.random.normal(kx, (1, 1, *[shapes[name][a] for a in contracted]), jnp.float32)
    q = _quantize(w, contracted, "int8")
    got = _mul_reduce(spec, x, q.qvalue, jnp.squeeze(q.scale))
    np.testing.assert_allclose(got, qwix.einsum(spec, x, q), rtol=1e-5, atol=1e-5)
    # and within int8 rounding of the float projection: |error| <= sum |x| * scale / 2 per output
    exact = jnp.einsum(spec, x, w)
    bound = jnp.einsum(spec, jnp.abs(x), jnp.broadcast_to(q.scale, w.shape)) / 2
    assert np.all(np.abs(np.asarray(got - exact)) <= np.asarray(bound) + 1e-5)
    assert not np.allclose(got, exact, atol=1e-7)  # it did round


def test_the_rounded_model_rounds_every_projection_and_leaves_the_original():
    from jaxprm.models import load_model

    model, _ = load_model("tiny")
    before = {n: np.asarray(w) for n, w in model.layers.stacked().items()}
    rounded = rounded_model(model, "int8")
    after = rounded.layers.stacked()
    for name, contracted in CONTRACTED.items():
        w = before[name]
        np.testing.assert_array_equal(np.asarray(model.layers.stacked()[name]), w)  # original kept
        scale = np.max(np.abs(w), axis=contracted, keepdims=True) / 127
        err = np.abs(np.asarray(after[name]) - w)
        assert np.all(err <= scale / 2 + 1e-6), name
        assert err.max() > 0, name
    # int4 with a scale per 32 inputs rounds closer than one scale per output channel
    w = before["gate_proj"]
    e4, e4_32 = (np.abs(np.asarray(qwix.dequantize(_quantize(jnp.asarray(w), (1,), q))) - w).mean()
                 for q in ("int4", "int4/32"))
    assert e4_32 < e4
