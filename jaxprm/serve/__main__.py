"""``python -m jaxprm.serve --model tiny --host 127.0.0.1 --port 8000``."""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from jaxprm.serve.sampler import Sampler
from jaxprm.serve.app import create_app
from jaxprm.serve.serving import ServeConfig
from jaxprm.serve.weights import resolve_roots
from rollout.tool_calls import TOOL_CALL_PARSERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxprm.serve", description=__doc__)
    p.add_argument("--model", required=True, help="preset name ('tiny', 'smollm2-135m') or a model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="name clients send as 'model' (default: --model)")
    p.add_argument("--api-key", default=os.environ.get("JAXPRM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $JAXPRM_API_KEY, else no key); "
                        "an empty key is an error")
    p.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                   help="/update_weights_from_disk loads only from under DIR (repeatable; none: loading from "
                        "disk is refused)")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences decoding at once")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="an idle engine waits for more arrivals until none came for this long")
    p.add_argument("--max-batch-wait-ms", type=float, default=50.0,
                   help="an idle engine starts at most this long after the first arrival")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool memory budget (GiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps per compiled decode call (default: 8 for models under 20M parameters, else 1)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per sequence per prefill call")
    p.add_argument("--max-prefill-tokens", type=int, default=1024, help="padded prompt tokens per prefill call")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the prefix cache")
    p.add_argument("--shared-prefix-attention", choices=("auto", "on", "off"), default="auto",
                   help="gather decode rows' common cached prefix once per batch (auto: on from 20M parameters)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="serve the weights in this dtype (logits and log-probs stay float32)")
    p.add_argument("--max-context", type=int, default=None, help="cap on prompt + output tokens")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="output cap when a chat request gives none (default: rest of the context)")
    p.add_argument("--logprobs-mode", choices=("processed", "raw"), default="processed",
                   help="processed: under the sampling distribution; raw: the policy at temperature 1")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-request-tokens", type=int, default=32768,
                   help="most tokens of work per request: rows (n x prompts) x (prompt tokens + max_tokens); "
                        "beyond it a 400 (0: no limit)")
    p.add_argument("--decode-loop", choices=("device", "host"), default="device",
                   help="ignored: the server decodes with its engine (the static sampler's loop option, "
                        "jaxprm.serve.static_sampler, is not part of the server); kept so command lines still parse")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default="hermes",
                   help="how tool calls are read out of chat answers to requests with tools (vLLM's flag): hermes "
                        "(Qwen2.5/3, Hermes templates) or llama3_json")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool calls are always parsed when a request has tools")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile the decode and prefill programs of requests up to --warmup-max-len positions "
                        "in the background from start, at a lower CPU priority (default: on); GET /health "
                        "reports [compiled, planned]")
    p.add_argument("--warmup-max-len", type=int, default=1024,
                   help="longest prompt + output the warm-up prepares for (0: the server's longest)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key (or $JAXPRM_API_KEY) is empty; give a key, or leave both unset to serve without one")
    try:
        weights_roots = resolve_roots(args.weights_root)
    except ValueError as exc:
        parser.error(f"--weights-root: {exc}")
    logging.basicConfig(level=args.log_level.upper())
    from jaxprm.models import load_model

    model, tokenizer = load_model(args.model)
    sampler = Sampler(model, eos_token_ids=tuple(tokenizer.eos_token_ids), pad_token_id=tokenizer.pad_token_id or 0,
                      max_batch=args.max_batch, max_context=args.max_context, dtype=args.dtype)
    config = ServeConfig(model_name=args.served_model_name or args.model, api_key=args.api_key,
                         max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                         max_request_tokens=args.max_request_tokens or None,
                         logprobs_mode=args.logprobs_mode, collect_window_s=args.batch_window_ms / 1000.0,
                         max_collect_s=args.max_batch_wait_ms / 1000.0, max_batch=args.max_batch,
                         kv_cache_bytes=int(args.kv_cache_gb * (1 << 30)), block_size=args.block_size,
                         decode_steps=args.decode_steps, prefill_chunk=args.prefill_chunk,
                         max_prefill_tokens=args.max_prefill_tokens, enable_prefix_cache=not args.no_prefix_cache,
                         weights_roots=weights_roots, tool_call_parser=args.tool_call_parser,
                         shared_prefix_attention={"auto": None, "on": True, "off": False}[args.shared_prefix_attention],
                         warmup=args.warmup, warmup_max_len=args.warmup_max_len or None)
    app = create_app(sampler, tokenizer, config, load_fn=load_model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())


if __name__ == "__main__":
    main()
