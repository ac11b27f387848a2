"""Function tools: the request side (``tools``, ``tool_choice``, ``parallel_tool_calls``, tool
messages) and the answer side (tool calls parsed out of generated text) (layer 4).

Shared by the embedded server (``jaxprm.serve``) and the recording proxy, so both accept and answer
tools the same way, as vLLM does with ``--enable-auto-tool-choice --tool-call-parser NAME``:

* **Rendering.** Tools go to the chat template as its ``tools`` variable (Hugging Face templates
  with tool support; ``rollout.chat.TOOLS_TEMPLATE`` is Qwen2.5's Hermes-style format). A template
  that ignores ``tools`` is refused (:func:`template_renders_tools`), never silently dropped.
* **Parsing.** A parser from :data:`TOOL_CALL_PARSERS` (``hermes``: ``<tool_call>{json}</tool_call>``
  blocks after optional text; ``llama3_json``: the answer is one or more ``{"name", "parameters"}``
  objects, separated by ``;``, optionally after ``<|python_tag|>``) splits the generated text into
  ``content`` and ``tool_calls`` (ids ``call_<hex>``, JSON-string ``arguments``) with
  ``finish_reason: "tool_calls"``. Markup that does not parse (half a call, bad JSON, no name) comes
  back as plain content and is counted (``ParsedOutput.failed``), as vLLM does.
* **tool_choice.** ``none``: tools are rendered, nothing is parsed. ``auto`` (the default with
  tools): calls are parsed when the model writes them. ``required`` and a named function
  (``{"type": "function", "function": {"name": ...}}``) have no constrained decoding here: the
  parser's opening markup (for a named function, up to its arguments) is *prefilled* after the
  generation prompt, as prompt tokens, so the model writes only the rest of the call.
* **parallel_tool_calls: false** keeps the first parsed call only.

The generated tokens, markup included, are what a trainer trains on; the prefill is prompt.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ToolCall", "ParsedOutput", "ToolCallParser", "HermesParser", "Llama3JsonParser", "TOOL_CALL_PARSERS",
           "get_parser", "ToolRequest", "parse_tool_request", "check_tool_messages", "template_renders_tools",
           "StreamSplitter", "new_call_id"]

#: an error factory: ``error(message, param)`` returns the exception to raise (a 400 of the caller's kind)
ErrorFactory = Callable[[str, str], Exception]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PROBE_NAME = "jaxprm_probe_tool_7f3a"


def new_call_id() -> str:
    """A fresh tool-call id (``call_`` + 24 hex digits)."""
    return f"call_{secrets.token_hex(12)}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is a JSON object serialized as a string (the OpenAI shape)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    """Generated text split into ``content`` (``None`` when only calls) and ``calls``; ``failed``:
    call markup was there but did not parse (then ``content`` is the whole text and ``calls`` empty)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()
    failed: bool = False


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """A ``ToolCall`` from a decoded ``{"name": ..., args_key: {...}}`` object, else ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # a model may write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Splits generated text into content and tool calls (see the module docstring).

    ``parse(text)``: the split. ``hold_from(text)``: while streaming, the index from which ``text``
    may be (the start of) a call and must be held back (``len(text)``: nothing to hold).
    ``prefill(name)``: the opening markup of a call (of function ``name``, or of any function).
    """

    name = ""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def hold_from(self, text: str) -> int:
        raise NotImplementedError

    def prefill(self, name: str | None) -> str:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """``text <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call> ...`` (Qwen2.5/3, Hermes);
    an unclosed last block (the model stopped at its end-of-turn token) is read to the end."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for m in self._BLOCK.finditer(text, start):
            body = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ParsedOutput(text, failed=True)
            calls.append(call)
        rest = self._BLOCK.sub("", text[start:])
        if rest.strip():  # text between or after the blocks: not a clean call
            return ParsedOutput(text, failed=True)
        return ParsedOutput(_content(text[:start]), tuple(calls))

    def hold_from(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):  # a marker cut by the stream
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def prefill(self, name: str | None) -> str:
        return self.START + "\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')


class Llama3JsonParser(ToolCallParser):
    """The whole answer is ``{"name": ..., "parameters": {...}}`` (``; ``-separated for several),
    optionally after ``<|python_tag|>`` (Llama 3.1-3.3 JSON tool calling)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _body(self, text: str) -> str:
        s = text.lstrip()
        return s[len(self.TAG):].lstrip() if s.startswith(self.TAG) else s

    def parse(self, text: str) -> ParsedOutput:
        body = self._body(text)
        if not body.startswith("{"):
            return ParsedOutput(text)
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return ParsedOutput(text, failed=True)
            call = _call(obj, "parameters")
            if call is None:
                return ParsedOutput(text, failed=True)
            calls.append(call)
            rest = body[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return ParsedOutput(text, failed=True)
            i = len(body) - len(rest)
        return ParsedOutput(None, tuple(calls))

    def hold_from(self, text: str) -> int:
        s = text.lstrip()
        if not s or s.startswith("{") or s.startswith(self.TAG) or self.TAG.startswith(s):
            return 0
        return len(text)

    def prefill(self, name: str | None) -> str:
        return "{" if name is None else '{"name": ' + json.dumps(name) + ', "parameters": '


#: ``--tool-call-parser`` names
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``; a ``ValueError`` names the allowed values."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}; allowed: {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A request's validated tools: ``tools`` (OpenAI function tools, as given), ``choice``
    (``"none"``, ``"auto"``, ``"required"`` or a function name) and ``parallel``."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    named: bool = False
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the answer is parsed for calls (every choice but ``none``)."""
        return self.choice != "none"

    def prefill(self, parser: ToolCallParser) -> str:
        """The text prefilled after the generation prompt (``required`` / a named function)."""
        if self.choice == "required":
            return parser.prefill(None)
        return parser.prefill(self.choice) if self.named else ""

    def finish(self, parser: ToolCallParser, generated: str) -> ParsedOutput:
        """The answer of ``prefill + generated``: parsed (``parses``), first call only unless ``parallel``."""
        text = self.prefill(parser) + generated
        if not self.parses:
            return ParsedOutput(text)
        out = parser.parse(text)
        if out.calls and not self.parallel:
            out = dataclasses.replace(out, calls=out.calls[:1])
        return out


def _check_tool(i: int, tool: Any, error: ErrorFactory) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise error(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
                    "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise error(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise error(f"{where}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and (not isinstance(params, Mapping) or params.get("type", "object") != "object"):
        raise error(f"{where}.function.parameters must be a JSON schema object ({{'type': 'object', ...}})", "tools")
    return name


def parse_tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any, error: ErrorFactory
                       ) -> ToolRequest | None:
    """Validate a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; ``None`` when
    the request has no tools (then ``tool_choice`` may only be absent or ``"none"``)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise error(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise error("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise error("tools must be a list of function tools", "tools")
    names = [_check_tool(i, t, error) for i, t in enumerate(tools)]
    if len(set(names)) != len(names):
        raise error(f"tools has duplicate function names: {names}", "tools")
    named = isinstance(tool_choice, Mapping)
    if named:
        fn = tool_choice.get("function")
        choice = fn.get("name") if tool_choice.get("type") == "function" and isinstance(fn, Mapping) else None
        if not isinstance(choice, str):
            raise error("tool_choice must be 'none', 'auto', 'required' or "
                        "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if choice not in names:
            raise error(f"tool_choice names {choice!r}, which is not among the tools {names}", "tool_choice")
    elif tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    else:
        raise error(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                    "tool_choice")
    return ToolRequest(tuple(dict(t) for t in tools), choice, named, parallel_tool_calls is not False)


def check_tool_messages(messages: Sequence[Mapping[str, Any]], error: ErrorFactory) -> None:
    """Assistant ``tool_calls`` must be function calls with an id, a name and string arguments, and
    every ``tool`` message must answer (``tool_call_id``) a call of an earlier assistant message."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise error(f"messages[{i}].tool_calls must be a list", "messages")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, Mapping) else None
                if (not isinstance(c, Mapping) or not isinstance(c.get("id"), str) or not isinstance(fn, Mapping)
                        or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
                    raise error(f"messages[{i}].tool_calls[{j}] must be {{'id': str, 'type': 'function', "
                                "'function': {'name': str, 'arguments': str}}", "messages")
                ids.add(c["id"])
        elif m.get("role") == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or tid not in ids:
                raise error(f"messages[{i}] (role 'tool') has tool_call_id {tid!r}, which answers no tool call "
                            "of an earlier assistant message", "messages")


def template_renders_tools(render: Callable[..., str]) -> bool:
    """Whether a chat template shows ``tools`` to the model: ``render(messages, tools=...)`` of a
    probe tool must contain its name (a template without tool support ignores the variable)."""
    probe = [{"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = render([{"role": "user", "content": "x"}], tools=probe)
    except Exception:  # noqa: BLE001 - a template that fails on tools cannot render them
        return False
    return _PROBE_NAME in text


class StreamSplitter:
    """Streams a row's content while holding back what may be a tool call (one per row).

    ``feed(piece)`` returns the content that is safe to send now; ``finish()`` parses the whole
    text (prefill included) and returns ``(the content not yet sent, the parsed output)``. With a
    prefill everything is held (the answer is a call by construction)."""

    def __init__(self, request: ToolRequest, parser: ToolCallParser):
        self.request, self.parser = request, parser
        self.text = ""
        self.sent = 0
        self.hold_all = bool(request.prefill(parser))

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.hold_all:
            return ""
        cut = max(self.sent, self.parser.hold_from(self.text)) if self.request.parses else len(self.text)
        out, self.sent = self.text[self.sent:cut], cut
        return out

    def finish(self) -> tuple[str, ParsedOutput]:
        out = self.request.finish(self.parser, self.text)
        return (out.content or "")[self.sent:], out  # no calls: the content is the whole text
