"""Does weight-only quantization through qwix pay for single-stream decode on this backend?

    python -m benchmarks.quantized_decode [--model smollm2-135m] [--repeats 20] [--prompts 8]
                                          [--new-tokens 32] [--json PATH]

A decode step at ``c=1`` multiplies one token's activations by every weight of the model once, so
its floor is the time to read the weights: 135M float32 parameters are 540 MB a token. int8 weights
read 4x fewer bytes, int4 8x; llama.cpp's Q4_1 gets its single-stream speed that way. This measures
whether XLA (through qwix, not a hand-written kernel) turns those bytes into speed, and what the
quantization costs in tokens:

* **speed**: one token's projection stack (every layer's q, k, v, o, gate, up and down and the
  output head, layers unrolled as the engine runs them on CPU, the real weights) per variant:
  ``float32`` (``jnp.einsum``, what the engine runs), ``qwix int8`` / ``qwix int4`` (weight-only,
  per-output-channel scales, ``qwix.einsum`` on ``qwix.quantize``d weights), ``qwix int4/32`` (a
  scale per output channel and 32 inputs, as llama.cpp's Q4 blocks), ``qwix int8 w8a8`` (the
  token's activations quantized too) and ``int8 fused`` (the int8 weight converted inside a fused
  multiply-reduce, which XLA keeps in one loop). Median and best milliseconds per token over
  ``--repeats`` calls, the bytes of weights each reads and the tok/s ceiling it sets.
* **agreement**: greedy continuations (``--new-tokens``) of ``--prompts`` chat prompts by the
  float32 model and by the same model with its weights rounded through each quantization
  (``qwix.dequantize(qwix.quantize(w))``: the numbers a weight-only kernel multiplies by): the share
  of prompts whose continuation is identical, the mean share of tokens before the first
  difference, and the mean KL(float32 || quantized) of the next-token distributions along the
  float32 continuations (the behaviour-KL a rollout sampled from quantized weights would carry).

Writes ``--json`` (default ``benchmarks/results/quantized_decode_cpu.json``) with the commit, the
command and the machine.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.provenance import result_path, write_result  # noqa: E402
from jaxprm.models import load_model  # noqa: E402

# Contraction axes of each stacked weight ([L, ...]); every other axis gets its own scale.
CONTRACTED = {"q_proj": (1,), "k_proj": (1,), "v_proj": (1,), "o_proj": (1, 2), "gate_proj": (1,),
              "up_proj": (1,), "down_proj": (1,)}
SPECS = {"q_proj": "btd,dhk->bthk", "k_proj": "btd,dhk->bthk", "v_proj": "btd,dhk->bthk",
         "o_proj": "bthk,hkd->btd", "gate_proj": "btd,df->btf", "up_proj": "btd,df->btf",
         "down_proj": "btf,fd->btd"}
QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "int4/32": jnp.int4}  # int4/32: a scale per 32 inputs
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion briefly.",
           "List three prime numbers.", "How do plants make food?", "Say hello in Spanish.",
           "What is 12 times 7?", "Name a famous painter.", "Why is the sky blue?", "Describe a cat."]


def _quantize(w: jax.Array, contracted: tuple[int, ...], qtype: str):
    import qwix

    channelwise = tuple(a for a in range(w.ndim) if a not in contracted)
    axis = contracted[-1]
    # like llama.cpp's Q4 blocks (an axis that 32 does not divide keeps one scale)
    tiles = {axis: 32 if w.shape[axis] % 32 == 0 else w.shape[axis]} if qtype.endswith("/32") else None
    return qwix.quantize(w, QTYPES[qtype], channelwise_axes=channelwise, tiled_axes=tiles)


def projection_weights(model) -> tuple[list[dict[str, jax.Array]], jax.Array]:
    """Per layer ``{name: weight}`` of the seven projections and the output head ``[V, D]``."""
    stacked = model.layers.stacked()
    layers = [{n: stacked[n][i] for n in SPECS} for i in range(model.config.num_layers)]
    head = model.embed[...] if model.lm_head is None else model.lm_head[...]
    return layers, head


def _stack_fn(einsum, config):
    """One token's projections through every layer and the head (inputs fixed: only the weights'
    traffic and the matmuls are timed); ``einsum(spec, x, w)``."""
    c = config
    shapes = {"o_proj": (1, 1, c.num_heads, c.head_dim), "down_proj": (1, 1, c.intermediate_size)}

    def run(x, layers, head):
        total = jnp.float32(0)
        for p in layers:
            for name, spec in SPECS.items():
                lhs = jnp.ones(shapes[name], x.dtype) if name in shapes else x
                total = total + jnp.sum(einsum(spec, lhs, p[name]))
        return total + jnp.sum(einsum("btd,vd->btv", x, head))

    return jax.jit(run)


def _mul_reduce(spec, x, q, s):
    lhs, rhs_out = spec.split(",")
    rhs, out = rhs_out.split("->")
    # broadcast x over the weight's output axes and sum the contracted ones: one fused loop
    x_b = x.reshape(x.shape[2:])  # [contracted...]
    contracted = [i for i, a in enumerate(rhs) if a in lhs]
    expand = tuple(i for i in range(len(rhs)) if i not in contracted)
    prod = jnp.expand_dims(x_b, expand) * q.astype(x.dtype)
    y = jnp.sum(prod, axis=tuple(contracted))
    return (y * s.reshape(y.shape)).reshape(1, 1, *y.shape)


def time_variants(model, repeats: int) -> list[dict]:
    import qwix

    layers, head = projection_weights(model)
    D = model.config.hidden_size
    x = jnp.ones((1, 1, D), jnp.float32)
    f32_bytes = sum(int(w.size) * 4 for p in layers for w in p.values()) + int(head.size) * 4

    def q_layers(qtype):
        return ([{n: _quantize(w, tuple(a - 1 for a in CONTRACTED[n]), qtype) for n, w in p.items()}
                 for p in layers], _quantize(head, (1,), qtype))

    def fused(p_layers, p_head):
        def unpack(w):
            return w.qvalue, jnp.squeeze(w.scale)
        return [{n: unpack(w) for n, w in p.items()} for p in p_layers], unpack(p_head)

    def fused_einsum(spec, x_in, w):
        q, s = w
        return _mul_reduce(spec, x_in, q, s)

    int8_layers, int8_head = q_layers("int8")
    int4_layers, int4_head = q_layers("int4")
    int4_32_layers, int4_32_head = q_layers("int4/32")

    def w8a8(spec, x_in, w):
        xq = qwix.quantize(x_in, jnp.int8, channelwise_axes=(0, 1))
        return qwix.einsum(spec, xq, w)

    variants = [
        ("float32", jnp.einsum, (layers, head), 4.0),
        ("qwix int8", qwix.einsum, (int8_layers, int8_head), 1.0),
        ("qwix int8 w8a8", w8a8, (int8_layers, int8_head), 1.0),
        ("qwix int4", qwix.einsum, (int4_layers, int4_head), 0.5),
        ("qwix int4/32", qwix.einsum, (int4_32_layers, int4_32_head), 0.5 + 4 / 32),
        ("int8 fused", fused_einsum, fused(int8_layers, int8_head), 1.0),
    ]
    out = []
    for name, einsum, (p_layers, p_head), bytes_per in variants:
        fn = _stack_fn(einsum, model.config)
        t0 = time.perf_counter()
        fn(x, p_layers, p_head).block_until_ready()
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(x, p_layers, p_head).block_until_ready()
            times.append(time.perf_counter() - t0)
        med, best = float(np.median(times)) * 1e3, float(np.min(times)) * 1e3
        weight_mb = f32_bytes / 4 * bytes_per / 1e6
        out.append({"variant": name, "median_ms": round(med, 2), "best_ms": round(best, 2),
                    "weights_mb": round(weight_mb, 1), "ceiling_tok_s": round(1e3 / med, 1),
                    "effective_gb_s": round(weight_mb / med, 2), "compile_s": round(compile_s, 1)})
        print(f"  {name:<16s} {med:8.2f} ms/token (best {best:.2f})  {weight_mb:6.1f} MB  "
              f"-> <= {1e3 / med:6.1f} tok/s", flush=True)
    return out


def rounded_model(model, qtype: str):
    """A copy of ``model`` whose projections and embedding (also the tied head) are rounded
    through ``qtype`` with per-output-channel scales."""
    import qwix

    copy = nnx.clone(model)
    stacked = model.layers.stacked()
    for name, contracted in CONTRACTED.items():
        w = stacked[name]
        getattr(copy.layers, name)[...] = qwix.dequantize(_quantize(w, contracted, qtype)).astype(w.dtype)
    copy.embed[...] = qwix.dequantize(_quantize(model.embed[...], (1,), qtype)).astype(jnp.float32)
    if model.lm_head is not None:
        copy.lm_head[...] = qwix.dequantize(_quantize(model.lm_head[...], (1,), qtype)).astype(jnp.float32)
    return copy


def agreement(model, tok, qtypes, n_prompts: int, new_tokens: int) -> dict[str, dict]:
    from jaxprm.serve.sampler import Sampler
    from jaxprm.serve.sampling import SamplingParams
    from jaxprm.serve.static_sampler import StaticSampler

    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in (PROMPTS * (1 + n_prompts // len(PROMPTS)))[:n_prompts]]
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)

    def greedy(m):
        return [c.token_ids for c in StaticSampler(Sampler(m, eos_token_ids=tok.eos_token_ids,
                                                           max_batch=len(prompts))).generate(prompts, sp)]

    ref = greedy(model)

    @nnx.jit
    def logprobs(m, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        logits, _ = m(tokens, positions)
        return jax.nn.log_softmax(logits, axis=-1)

    out = {}
    for qtype in qtypes:
        q_model = rounded_model(model, qtype)
        got = greedy(q_model)
        same_prefix = []
        kls = []
        for p, a, b in zip(prompts, ref, got):
            n = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
            same_prefix.append(n / max(len(a), 1))
            seq = jnp.asarray([p + list(a)], jnp.int32)
            lp, lq = logprobs(model, seq)[0, len(p) - 1:-1], logprobs(q_model, seq)[0, len(p) - 1:-1]
            kls.append(float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1))))
        out[qtype] = {"identical_continuations": round(float(np.mean([a == b for a, b in zip(ref, got)])), 3),
                      "tokens_before_first_difference": round(float(np.mean(same_prefix)), 3),
                      "mean_kl_f32_to_quantized": round(float(np.mean(kls)), 5)}
        print(f"  {qtype}: {out[qtype]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="default: benchmarks/results/quantized_decode_<device>.json")
    args = p.parse_args(argv)
    args.json = args.json or result_path("quantized_decode")
    model, tok = load_model(args.model)
    print(f"{args.model}: one decode token's projections on {jax.devices()[0].platform} "
          f"({os.cpu_count()} cores), load {[round(x, 2) for x in os.getloadavg()]}")
    speed = time_variants(model, args.repeats)
    print("greedy agreement with float32 and behaviour KL:")
    agree = agreement(model, tok, ("int8", "int4", "int4/32"), args.prompts, args.new_tokens)
    write_result(args.json, {"model": args.model, "load_after": [round(x, 2) for x in os.getloadavg()],
                             "speed": speed, "agreement": agree})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
