"""The OpenAI Responses API (``POST /v1/responses``) as a translation to and from chat completions
(layer 4), shared by the recording proxy and the embedded server.

A request becomes a chat-completions body (:func:`to_chat_body`): ``instructions`` is the first
(system) message; ``input`` (a string, or items) becomes messages: ``message`` items (string or
``input_text`` / ``output_text`` parts) keep their role, a ``function_call`` item becomes a
``tool_calls`` entry of an assistant message (joining the assistant message just before it, so
that text and calls of one answer make one message, as chat completions return them), a
``function_call_output`` a ``tool`` message; ``reasoning`` items are skipped. Function tools
(``{"type": "function", "name", "description", "parameters"}``) become chat tools; other tool
types, non-text content, ``text.format`` other than text and ``conversation`` are a 400.
``previous_response_id`` continues a stored conversation: the caller passes its messages
(:class:`ResponseStore` keeps them, bounded; instructions are not carried over, as in the API).
Fields that change nothing here (``store``, ``include``, ``reasoning``, ``truncation`` ...) are
ignored.

An answer (an assistant chat message) becomes a ``response`` object (:func:`response_object`):
a ``message`` item with one ``output_text`` part when it has content, then one ``function_call``
item per tool call (``call_id`` = the chat call id). Streamed, :class:`ResponseEvents` emits the
API's event sequence (created, in_progress, per item added / deltas / done, completed) as the
answer's text arrives (the server), or :func:`response_events` for a finished answer (the proxy).
"""

from __future__ import annotations

import collections
import json
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["to_chat_body", "input_messages", "conversation", "output_items", "response_object", "response_events",
           "ResponseEvents", "pending_response", "ResponseStore"]

ErrorFactory = Callable[[str, str], Exception]

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


def _text(content: Any, where: str, error: ErrorFactory) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise error(f"{where}.content must be a string or a list of text parts", "input")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise error(f"{where}.content[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported, got {kind!r}",
                        "input")
        out.append(part["text"])
    return "".join(out)


def input_messages(items: Any, error: ErrorFactory) -> list[dict[str, Any]]:
    """Chat messages of a request's ``input`` (see the module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise error("input must be a string or a list of input items", "input")
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise error(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise error(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", "input")
            msgs.append({"role": role, "content": _text(item.get("content"), where, error)})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise error(f"{where} (function_call) needs string call_id, name and arguments", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise error(f"{where} (function_call_output) needs a string call_id", "input")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": _text(output, where, error)})
        elif kind == "reasoning":
            continue
        else:
            raise error(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                        "function_call_output)", "input")
    return msgs


def _chat_tools(tools: Any, error: ErrorFactory) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise error("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, Mapping) else type(t).__name__
            raise error(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any, error: ErrorFactory) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise error(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                f"got {choice!r}", "tool_choice")


def to_chat_body(body: Any, history: Sequence[Mapping[str, Any]] | None, error: ErrorFactory) -> dict[str, Any]:
    """The chat-completions body of a Responses request; ``history``: the messages of
    ``previous_response_id``'s conversation (``None``: none)."""
    if not isinstance(body, Mapping):
        raise error("the request body must be a JSON object", "body")
    if body.get("conversation") is not None:
        raise error("conversation is not supported; use previous_response_id or send the input items", "conversation")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type", "text") != "text":
        raise error(f"text.format {fmt.get('type')!r} is not supported (no constrained decoding)", "text")
    if body.get("prompt") is not None:
        raise error("prompt (stored prompt templates) is not supported", "prompt")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise error("instructions must be a string", "instructions")
    msgs = [{"role": "system", "content": instructions}] if instructions else []
    msgs += [dict(m) for m in history or ()]
    msgs += input_messages(body.get("input"), error)
    if not msgs:
        raise error("input is empty", "input")
    chat: dict[str, Any] = {"messages": msgs, "stream": bool(body.get("stream"))}
    for src, dst in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                     ("top_k", "top_k"), ("max_output_tokens", "max_tokens"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _chat_tools(body.get("tools"), error)
    if tools:
        chat["tools"] = tools
    choice = _chat_tool_choice(body.get("tool_choice"), error)
    if choice is not None and (tools or choice != "auto"):
        chat["tool_choice"] = choice
    return chat


def conversation(chat_messages: Sequence[Mapping[str, Any]], answer: Mapping[str, Any],
                 instructions: str | None) -> list[dict[str, Any]]:
    """What ``previous_response_id`` continues: the request's messages without its instructions,
    plus the answer."""
    msgs = list(chat_messages)
    if instructions and msgs and msgs[0].get("role") == "system" and msgs[0].get("content") == instructions:
        msgs = msgs[1:]
    return [*msgs, dict(answer)]


def output_items(message: Mapping[str, Any], *, incomplete: bool = False) -> list[dict[str, Any]]:
    """The Responses ``output`` of an assistant chat message: a ``message`` item when it has
    content, then one ``function_call`` item per tool call."""
    items: list[dict[str, Any]] = []
    content = message.get("content")
    if content or not message.get("tool_calls"):
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                      "status": "incomplete" if incomplete else "completed",
                      "content": [{"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}]})
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                      "name": fn["name"], "arguments": fn["arguments"], "status": "completed"})
    return items


def response_object(response_id: str, model: str, message: Mapping[str, Any], request: Mapping[str, Any], *,
                    input_tokens: int, output_tokens: int, cached_tokens: int = 0, truncated: bool = False,
                    created_at: float | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object of an answer; ``request`` is the Responses request body (echoed
    fields); ``truncated``: the answer hit its token limit (``status: incomplete``)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at or time.time(), "model": model,
        "status": "incomplete" if truncated else "completed", "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "output": output_items(message, incomplete=truncated),
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": request.get("previous_response_id"),
        "temperature": request.get("temperature"), "top_p": request.get("top_p"),
        "tool_choice": request.get("tool_choice") or "auto", "tools": list(request.get("tools") or []),
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": request.get("metadata") or {},
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                  "total_tokens": input_tokens + output_tokens,
                  "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        **(extra or {}),
    }


class ResponseEvents:
    """The Responses API's server-sent events, emitted as an answer is generated.

    ``start(pending)`` gives ``response.created`` and ``response.in_progress`` (``pending``: the
    response object so far: ``status: in_progress``, no output, no usage); ``text(delta)`` opens the
    ``message`` item (``output_item.added``, ``content_part.added``) at the first text and gives an
    ``output_text.delta`` per call; ``finish(response)`` closes the message (``output_text.done``,
    ``content_part.done``, ``output_item.done``), gives every other item of the final ``response``
    whole (a ``function_call``: added, ``function_call_arguments.delta`` / ``.done``, done) and ends
    with ``response.completed`` (``response.incomplete`` when truncated). The streamed message item
    keeps its id in the final object (``message_id``). Every event carries its ``sequence_number``.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.text_so_far = ""
        self.opened = False

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = json.dumps({"type": kind, "sequence_number": self.seq, **data}, separators=(",", ":"))
        self.seq += 1
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def start(self, pending: Mapping[str, Any]) -> list[bytes]:
        return [self._event("response.created", response=dict(pending)),
                self._event("response.in_progress", response=dict(pending))]

    def _open(self) -> list[bytes]:
        self.opened = True
        item = {"type": "message", "id": self.message_id, "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                            content_index=0, part=part)]

    def text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        out = [] if self.opened else self._open()
        self.text_so_far += delta
        return out + [self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                  content_index=0, delta=delta, logprobs=[])]

    def finish(self, response: dict[str, Any]) -> list[bytes]:
        """The closing events for the final ``response`` (its message item, if any, takes
        ``message_id``; its text must start with what was streamed)."""
        response = {**response, "output": [dict(item) for item in response["output"]]}
        out: list[bytes] = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                item["id"] = self.message_id
                text = item["content"][0]["text"]
                if not text.startswith(self.text_so_far):
                    raise ValueError("the final text does not continue the streamed text")
                if not self.opened:
                    out += self._open()
                if text[len(self.text_so_far):]:
                    out += self.text(text[len(self.text_so_far):])
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                out += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=text, logprobs=[]),
                        self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                    content_index=0, part=part)]
            else:
                out += [self._event("response.output_item.added", output_index=index,
                                    item={**item, "status": "in_progress", "arguments": ""}),
                        self._event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=item["arguments"]),
                        self._event("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=index, name=item["name"], arguments=item["arguments"])]
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self._event(done, response=dict(response))]


def pending_response(response: Mapping[str, Any]) -> dict[str, Any]:
    """The ``response`` object of the first events: ``in_progress``, no output, no usage."""
    return {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}


def response_events(response: dict[str, Any]) -> Iterator[bytes]:
    """Server-sent events of a finished ``response`` (:class:`ResponseEvents` with the whole text at
    once): ``response.created``, ``response.in_progress``, then per output item
    ``output_item.added``, its text (``content_part.added``, ``output_text.delta``,
    ``output_text.done``, ``content_part.done``) or arguments (``function_call_arguments.delta`` /
    ``.done``), ``output_item.done``; then ``response.completed`` (``response.incomplete`` when
    truncated)."""
    events = ResponseEvents()
    yield from events.start(pending_response(response))
    yield from events.finish(response)


class ResponseStore:
    """``response id -> conversation messages`` for ``previous_response_id``, the most recent
    ``capacity`` kept (the proxy keeps one per session, so a session's conversations go with it)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = messages
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: Any, error: ErrorFactory) -> list[dict[str, Any]]:
        """The stored conversation, or a 400 (``error``) naming the id when it is not here."""
        found = self._items.get(response_id) if isinstance(response_id, str) else None
        if found is None:
            raise error(f"previous_response_id {response_id!r} not found (unknown, expired, or another session's)",
                        "previous_response_id")
        return [dict(m) for m in found]

    def __len__(self) -> int:
        return len(self._items)
