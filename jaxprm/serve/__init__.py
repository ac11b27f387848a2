"""Embedded OpenAI / vLLM / SGLang compatible generation server.

Layers, bottom up: ``sampling`` (what a row samples: parameters, distribution, draw, log-probs),
``sampler`` (weights, versions, request limits), ``static_sampler`` (the static-batching reference
generator), ``programs`` (compiled prefill / decode over the paged KV pool), ``kv_pool`` and
``prefix_cache`` (block bookkeeping, the radix tree), ``scheduler`` (continuous batching), ``engine``
(the worker thread), ``serving`` + the dialect routers + ``app`` (HTTP), ``handle`` (in-process).

Run it as ``python -m jaxprm.serve --model tiny --host 127.0.0.1 --port 8000`` or in-process with
``ServerHandle.start(model, tokenizer)``. See ``jaxprm.serve.app`` for the endpoints.
"""

from jaxprm.serve.app import create_app
from jaxprm.serve.errors import APIError
from jaxprm.serve.serving import ServeConfig
from jaxprm.serve.engine import BatchingEngine, Engine, EngineStats
from jaxprm.serve.handle import ServerHandle

__all__ = ["APIError", "BatchingEngine", "Engine", "EngineStats", "ServeConfig", "ServerHandle", "create_app"]
