"""Embedded OpenAI / vLLM / SGLang compatible generation server over ``jaxprm.sampler``.

Run it as ``python -m jaxprm.serve --model tiny --host 127.0.0.1 --port 8000`` or in-process with
``ServerHandle.start(model, tokenizer)``. See ``jaxprm.serve.app`` for the endpoints.
"""

from jaxprm.serve.app import APIError, ServeConfig, create_app
from jaxprm.serve.engine import BatchingEngine, EngineStats
from jaxprm.serve.handle import ServerHandle

__all__ = ["APIError", "BatchingEngine", "EngineStats", "ServeConfig", "ServerHandle", "create_app"]
