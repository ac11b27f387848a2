"""Request bodies of the generation server (pydantic), in the vLLM / SGLang field conventions.

Unknown fields are ignored (as vLLM does), so clients written for vLLM or SGLang work unchanged;
fields that change the output in ways this server does not implement (``best_of``, penalties
other than the neutral value, ``echo`` with logprobs) are rejected with a 400 by the app.

Types are strict (what the OpenAPI document says is what is accepted): an integer field takes
only JSON integers (not ``1.0``, ``true`` or ``"1"``), a number field integers or floats, a string
field only strings, and every string of a body (keys, prompts, chat content, names, ``rid``) must
be valid Unicode: a JSON escape of a lone UTF-16 surrogate (``"\\ud800"``) is a 400 naming where it
is (:class:`TextError`), checked once per body (:func:`check_text`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "ResponsesRequest",
    "GenerateRequest",
    "SGLangSamplingParams",
    "UpdateWeightsFromDiskRequest",
    "PauseGenerationRequest",
    "LogprobsMode",
    "TextError",
    "check_text",
]

TokenId = int
LogprobsMode = Literal["raw", "processed"]
_MAX_SEED = 2**63 - 1


class TextError(ValueError):
    """A string of a request body that is not valid Unicode; ``param`` is its dotted location."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def _loc(path: list) -> str:
    return ".".join(str(p) if isinstance(p, int) else p.encode("utf-8", "backslashreplace").decode()
                    for p in path) or "body"


def _first_bad_string(data: Any) -> tuple[list, str] | None:
    """``(path, string)`` of the first string (or key) of ``data`` that UTF-8 cannot encode."""
    stack: list[tuple[list, Any]] = [([], data)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path, x
        elif isinstance(x, dict):
            for k, v in reversed(list(x.items())):
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return [*path, k], k
                stack.append(([*path, k], v))
        elif isinstance(x, (list, tuple)):
            stack.extend(([*path, i], v) for i, v in reversed(list(enumerate(x))))
    return None


def check_text(data: Any) -> None:
    """Raise :class:`TextError` if any string or key in ``data`` (a decoded JSON body) holds a lone
    surrogate. One C-speed pass (``json.dumps`` + UTF-8 encode) over the body; the location is
    searched only when it fails."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError, RecursionError):  # not JSON data (an in-process caller): walk it
        pass
    found = _first_bad_string(data)
    if found is None:
        return
    path, text = found
    bad = next(i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF)
    raise TextError(f"{_loc(path)}: not valid Unicode: lone surrogate \\u{ord(text[bad]):04x} at character {bad} "
                    "(a JSON \\uD800-\\uDFFF escape must be half of a surrogate pair)", _loc(path) if path else None)


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class _Body(_Base):
    """A whole request body: its strings are checked once (``check_text``) before validation."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_text(data)
        return data


class _Sampling(_Body):
    """Sampling fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=-_MAX_SEED - 1, le=_MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs_mode: LogprobsMode | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (a batch)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    model_config = ConfigDict(extra="allow", strict=True)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # checked by rollout.tool_calls (messages that name the field)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class ResponsesRequest(_Body):
    """``POST /v1/responses`` (translated by ``rollout.responses_api``; fields it ignores, such as
    ``store``, ``include`` or ``reasoning``, are accepted and dropped)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=-_MAX_SEED - 1, le=_MAX_SEED)] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class SGLangSamplingParams(_Base):
    """``sampling_params`` of SGLang's ``/generate``."""

    max_new_tokens: Annotated[int, Field(ge=0)] = 128
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1)] = 1
    seed: Annotated[int, Field(ge=-_MAX_SEED - 1, le=_MAX_SEED)] | None = None
    sampling_seed: Annotated[int, Field(ge=-_MAX_SEED - 1, le=_MAX_SEED)] | None = None
    skip_special_tokens: bool = True
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None


class GenerateRequest(_Body):
    """SGLang-style ``POST /generate``: ``text`` or ``input_ids`` (single or batched)."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Field(ge=0)] = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    logprobs_mode: LogprobsMode | None = None


class UpdateWeightsFromDiskRequest(_Body):
    """SGLang-style ``POST /update_weights_from_disk``."""

    model_path: str
    load_format: str | None = None
    weight_version: int | str | None = None


class PauseGenerationRequest(_Body):
    """SGLang-style ``POST /pause_generation``: ``abort`` ends every running and waiting request now
    (finish reason ``abort``, the tokens so far); ``in_place`` keeps them, with their KV, until
    ``/continue_generation``."""

    mode: Literal["abort", "in_place"] = "abort"
