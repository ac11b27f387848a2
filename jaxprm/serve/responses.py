"""Response bodies of the generation server (pydantic): what every route answers on success.

The routes declare these as their response models, so the OpenAPI document describes each
success body exactly (clients can validate answers) and FastAPI checks every answer against it
before it is sent (serialized in pydantic's core). Fields that only some requests get (``token_ids``
with ``return_token_ids``, SGLang's log-prob lists with ``return_logprob``) are optional and absent
otherwise, never ``null``: the routes serialize with ``response_model_exclude_unset``, and such a
field is documented without a default (:class:`_Out`). Unknown fields are an error, so a field a
route adds must be declared here first.

Streamed answers (``stream=true``) are ``text/event-stream`` and documented as such
(:data:`EVENT_STREAM`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EVENT_STREAM", "Usage", "CompletionLogprobs", "CompletionChoice", "CompletionResponse", "ChatTopLogprob",
    "ChatTokenLogprob", "ChatLogprobs", "ChatMessageOut", "ChatChoice", "ChatCompletionResponse", "ModelCard",
    "ModelList", "Health", "FinishStop", "FinishLength", "FinishAbort", "GenerateMeta", "GenerateOutput",
    "WeightVersion", "ModelInfo", "PauseResult", "ContinueResult", "FlushResult", "UpdateWeightsResult",
    "UpdateWeightsFailure", "ToolCallOut", "ResponseBody",
]

#: The OpenAPI ``content`` entry of a streamed answer: the schema is that of each server-sent event
#: (as OpenAPI 3.2's ``itemSchema``): its ``data`` is one JSON chunk, or ``[DONE]`` at the end.
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk; the last event is `[DONE]`"}},
    "description": "one server-sent event (`data: ...`)"}}}


def _no_null_defaults(schema: dict[str, Any]) -> None:
    """Drop ``"default": null`` of optional fields that are never null (absent instead)."""
    for prop in schema.get("properties", {}).values():
        if prop.get("default", 0) is None and "anyOf" not in prop:
            del prop["default"]


class _Out(BaseModel):
    """Response bodies: unknown fields are an error; ``x: T = None`` means "absent unless asked"."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), json_schema_extra=_no_null_defaults)


StopReason = str | int | None
FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# /v1/completions -------------------------------------------------------------------------------

class CompletionLogprobs(_Out):
    """The legacy completions ``logprobs`` object (per generated token)."""

    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: StopReason = Field(description="the matched stop string or stop token id; null for EOS")
    token_ids: list[int] = Field(None, description="with return_token_ids")
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")
    output_token_versions: list[int] = Field(None, description="with return_token_ids: weight version per token")


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    weight_version: int = Field(description="the oldest weight version among the choices' tokens")


# /v1/chat/completions --------------------------------------------------------------------------

class ChatTopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class ToolCallFunction(_Out):
    name: str
    arguments: str = Field(description="the call's arguments: a JSON object, as a string")


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessageOut(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls only")
    tool_calls: list[ToolCallOut] = Field(None, description="with tools: the calls parsed out of the answer")


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | Literal["tool_calls"]
    stop_reason: StopReason
    token_ids: list[int] = Field(None, description="with return_token_ids")
    output_token_versions: list[int] = Field(None, description="with return_token_ids: weight version per token")


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    weight_version: int
    prompt_token_ids: list[int] = Field(None, description="with return_token_ids")


# /v1/responses ---------------------------------------------------------------------------------

class ResponseOutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseMessageItem(_Out):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseFunctionCallItem(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="a JSON object, as a string")
    status: Literal["completed"]


class ResponseUsage(_Out):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class ResponseBody(_Out):
    """A ``response`` object (``rollout.responses_api.response_object``)."""

    id: str
    object: Literal["response"]
    created_at: float
    model: str
    status: Literal["completed", "incomplete"]
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    output: list[Annotated[ResponseMessageItem | ResponseFunctionCallItem, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[Any]
    text: dict[str, Any]
    truncation: str
    metadata: dict[str, Any]
    usage: ResponseUsage
    weight_version: int


# /v1/models, /health ---------------------------------------------------------------------------

class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    weight_version: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: str = Field(description="'ok' (200), or why not (503)")
    weight_version: int
    warmup_programs: list[int] | None = Field(
        None, description="[compiled, planned] programs of the background warm-up (absent when off)")


# /generate (SGLang) ----------------------------------------------------------------------------

class FinishStop(_Out):
    type: Literal["stop"]
    matched: StopReason


class FinishLength(_Out):
    type: Literal["length"]
    length: int


class FinishAbort(_Out):
    type: Literal["abort"]
    message: str


LogprobEntry = tuple[float, int, str | None]


class GenerateMeta(_Out):
    id: str
    finish_reason: Annotated[FinishStop | FinishLength | FinishAbort, Field(discriminator="type")]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: int
    output_token_versions: list[int]
    e2e_latency: float
    output_token_logprobs: list[LogprobEntry] = Field(None, description="with return_logprob: [logprob, id, text]")
    input_token_logprobs: list[LogprobEntry] = Field(None, description="with return_logprob (always empty)")
    output_top_logprobs: list[list[LogprobEntry]] = Field(None, description="with top_logprobs_num")


class GenerateOutput(_Out):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


# RL control and weights ------------------------------------------------------------------------

class WeightVersion(_Out):
    weight_version: int


class ModelInfo(_Out):
    model_path: str
    is_generation: bool
    max_context: int
    vocab_size: int
    weight_version: int


class PauseResult(_Out):
    success: bool
    mode: Literal["abort", "in_place"]
    num_aborted_requests: int


class ContinueResult(_Out):
    success: bool


class FlushResult(_Out):
    success: bool
    num_flushed_blocks: int


class UpdateWeightsResult(_Out):
    success: Literal[True]
    message: str
    weight_version: int
    num_paused_requests: int


class UpdateWeightsFailure(_Out):
    """SGLang's answer (400) when the weights under ``model_path`` could not be loaded."""

    success: Literal[False]
    message: str
    weight_version: int
