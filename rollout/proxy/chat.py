"""OpenAI chat-completions requests in, OpenAI answers out (plain and streamed) for the proxy.

``parse_chat_request`` validates a request body into :class:`ChatRequest` (each problem a
``ProxyError`` 400 naming the field). Supported: ``messages`` (string or text-part contents),
``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k`` (extension),
``seed``, ``n`` (1 only), ``stream`` with ``stream_options.include_usage``, ``logprobs`` (the
sampled token's log-prob per token). ``stop`` strings are accepted and not applied: in concat mode
the stop token ends a turn (a stop string would cut the recorded tokens). Function ``tools``,
``tool_choice`` and ``parallel_tool_calls`` as ``rollout.tool_calls`` describes (the proxy's
``tool_call_parser``); an answer with calls has ``message.tool_calls`` and ``finish_reason:
"tool_calls"``, streamed as one tool-call delta per call.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rollout.client import SamplingParams
from rollout.proxy.config import ProxyError
from rollout.tool_calls import ToolRequest, check_tool_messages, parse_tool_request
from rollout.types import ModelResponse

__all__ = ["ChatRequest", "parse_chat_request", "chat_answer", "stream_chunks"]

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_REFUSED = {"functions": "functions (the deprecated form) are not supported; use tools",
            "response_format": "response_format is not supported (no constrained decoding)"}


class ChatRequest:
    """A validated chat request: its messages and what to sample."""

    __slots__ = ("messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "include_usage",
                 "logprobs", "model", "tools")

    def __init__(self, messages: list[dict[str, Any]], *, max_tokens: int | None, temperature: float, top_p: float,
                 top_k: int, seed: int | None, stream: bool, include_usage: bool, logprobs: bool, model: str | None,
                 tools: ToolRequest | None = None):
        self.messages = messages
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.model = model
        self.tools = tools

    def sampling(self, default_max_tokens: int, room: int | None = None, *,
                 default_seed: int | None = None) -> SamplingParams:
        """Sampling params; ``max_tokens`` defaults to ``default_max_tokens`` and is clipped to ``room``;
        the request's ``seed``, else ``default_seed``."""
        n = self.max_tokens if self.max_tokens is not None else default_max_tokens
        if room is not None:
            n = min(n, room)
        return SamplingParams(max_tokens=n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed if self.seed is not None else default_seed)


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not lo <= v <= hi:
        raise ProxyError(400, f"{key} must be a number in [{lo}, {hi}], got {v!r}", param=key)
    return float(v)


def _int(body: Mapping[str, Any], key: str, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ProxyError(400, f"{key} must be an integer >= {lo}, got {v!r}", param=key)
    return int(v)


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate an OpenAI chat-completions body (see the module docstring)."""
    if not isinstance(body, Mapping):
        raise ProxyError(400, "the request body must be a JSON object")
    for key, why in _REFUSED.items():
        if body.get(key):
            raise ProxyError(400, why, param=key)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ProxyError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise ProxyError(400, f"messages[{i}] must be an object, got {type(m).__name__}", param="messages")
        if m.get("role") not in _ROLES:
            raise ProxyError(400, f"messages[{i}].role must be one of {list(_ROLES)}, got {m.get('role')!r}",
                             param="messages")
    def error(message: str, param: str) -> ProxyError:
        return ProxyError(400, message, param=param)

    tools = parse_tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), error)
    check_tool_messages(msgs, error)
    n = body.get("n")
    if n not in (None, 1):
        raise ProxyError(400, f"n must be 1 (one recorded turn per call), got {n!r}", param="n")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    top_k = _int(body, "top_k", -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ProxyError(400, f"seed must be an integer, got {seed!r}", param="seed")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ProxyError(400, f"stream must be true or false, got {stream!r}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise ProxyError(400, "stream_options must be an object", param="stream_options")
    if body.get("top_logprobs"):
        raise ProxyError(400, "top_logprobs is not supported (the upstream returns the sampled token's "
                              "log-prob only); use logprobs: true", param="top_logprobs")
    model = body.get("model")
    return ChatRequest(
        [dict(m) for m in msgs], max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=-1 if top_k is None else top_k, seed=seed, stream=stream,
        include_usage=bool(opts.get("include_usage")), logprobs=bool(body.get("logprobs")),
        model=model if isinstance(model, str) else None, tools=tools,
    )


def _finish(response: ModelResponse, message: Mapping[str, Any]) -> str:
    if message.get("tool_calls"):
        return "tool_calls"
    return "length" if response.stop_reason == "length" else "stop"


def _logprobs(response: ModelResponse, token_text) -> dict[str, Any]:
    content = []
    for t, lp in zip(response.output_tokens.tolist(), response.output_logprobs.tolist()):
        s = token_text(t)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return {"content": content, "refusal": None}


def _usage(response: ModelResponse) -> dict[str, int]:
    p, c = response.input_len, response.output_len
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def chat_answer(record_id: str, model: str, response: ModelResponse, message: Mapping[str, Any], *,
                logprobs: bool, token_text, created: int | None = None) -> dict[str, Any]:
    """The ``chat.completion`` object for a finished record (``id`` = the interaction id)."""
    choice: dict[str, Any] = {"index": 0, "message": dict(message), "finish_reason": _finish(response, message),
                              "logprobs": _logprobs(response, token_text) if logprobs else None}
    return {"id": record_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(response)}


def stream_chunks(record_id: str, model: str, response: ModelResponse, message: Mapping[str, Any], *,
                  logprobs: bool, include_usage: bool, token_text) -> Iterator[bytes]:
    """Server-sent events of a finished record: a role chunk, one content chunk, one chunk per tool
    call (its whole ``id``, ``function.name`` and ``function.arguments`` at its ``index``), the finish
    chunk, an optional usage chunk (``stream_options.include_usage``), then ``[DONE]``."""
    created = int(time.time())

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {"id": record_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": choices, **extra}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    yield event([{"index": 0, "delta": {"content": message.get("content") or ""}, "finish_reason": None,
                  "logprobs": _logprobs(response, token_text) if logprobs else None}])
    for i, call in enumerate(message.get("tool_calls") or ()):
        yield event([{"index": 0, "delta": {"tool_calls": [{"index": i, **call}]}, "finish_reason": None}])
    yield event([{"index": 0, "delta": {}, "finish_reason": _finish(response, message)}])
    if include_usage:
        yield event([], usage=_usage(response))
    yield b"data: [DONE]\n\n"
