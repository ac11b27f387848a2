"""The OpenAI / vLLM dialect: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

* ``/v1/completions``: text completions; prompt as text, token ids or a batch of either;
  ``return_token_ids`` adds ``choices[i].token_ids`` and ``choices[i].prompt_token_ids``.
* ``/v1/chat/completions``: the model's chat template renders ``messages``; logprobs in the OpenAI
  chat shape; ``return_token_ids`` adds ``choices[i].token_ids`` and top-level ``prompt_token_ids``.
  Function ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as ``rollout.tool_calls`` describes
  (the server's ``tool_call_parser``): calls come back in ``message.tool_calls`` with
  ``finish_reason: "tool_calls"``; streamed, the content before a call streams as it is generated
  and each call follows as one tool-call delta once the choice ends.

Every answer reports the ``weight_version`` that produced it (the oldest among its choices);
with ``return_token_ids`` each choice also has ``output_token_versions`` (per output token).
``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens served from the prefix cache
(of each prompt's first choice).

* ``/v1/responses``: the Responses API as a translation to a chat turn (``rollout.responses_api``):
  ``instructions`` and ``input`` items (messages, ``function_call``, ``function_call_output``),
  function tools, ``previous_response_id`` (the last 10,000 responses are kept); ``stream=true``
  answers with the API's event sequence once the turn is generated (not token by token).

``stream=true`` answers with server-sent events in the OpenAI chunk format (``text_completion`` /
``chat.completion.chunk`` objects, ``data: [DONE]`` at the end; ``stream_options.include_usage``
adds a last chunk with ``usage``); stop strings are applied while streaming (see
``jaxprm.serve.streaming``). A client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import StreamingResponse

from jaxprm.serve.errors import APIError
from jaxprm.serve.openapi import errors
from jaxprm.serve.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from jaxprm.serve.responses import EVENT_STREAM, ChatCompletionResponse, CompletionResponse, ModelList, ResponseBody
from jaxprm.serve.sampling import MAX_TOP_LOGPROBS
from jaxprm.serve.serving import Serving, build_choices, sampling_params
from jaxprm.serve.streaming import SSE_DONE, SSE_HEADERS, pieces, sse
from rollout.responses_api import ResponseEvents, conversation, pending_response, response_object, to_chat_body
from rollout.tool_calls import StreamSplitter, ToolRequest, check_tool_messages, parse_tool_request

__all__ = ["openai_router"]


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _completion_logprobs(srv: Serving, token_ids, logprobs, tops, top_n: int, tok_str, offset: int = 0
                         ) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, offsets);
    ``offset`` is the text offset of the first token (streaming)."""
    toks = [tok_str(t) for t in token_ids]
    offsets, pos = [], offset
    for t in token_ids:
        offsets.append(pos)
        pos += len(srv.token_text(t))
    top_dicts = []
    for j in range(len(token_ids)):
        d = {toks[j]: logprobs[j]}
        if tops is not None:
            for tid, lp in tops[j][:top_n]:
                d.setdefault(tok_str(tid), lp)
        top_dicts.append(d)
    return {"text_offset": offsets, "token_logprobs": list(logprobs), "tokens": toks, "top_logprobs": top_dicts}


def _chat_logprobs(token_ids, logprobs, tops, top_n: int, tok_str) -> dict[str, Any]:
    """The chat ``logprobs.content`` list (token, logprob, bytes, top_logprobs)."""
    content = []
    for j, t in enumerate(token_ids):
        tok = tok_str(t)
        alts = []
        if tops is not None:
            for tid, lp in tops[j][:top_n]:
                s = tok_str(tid)
                alts.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))})
        content.append({"token": tok, "logprob": logprobs[j], "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": alts})
    return {"content": content}


def _include_usage(req) -> bool:
    opts = req.stream_options or {}
    return bool(opts.get("include_usage", False))


async def _completion_events(srv: Serving, req: CompletionRequest, deltas, rows: list[list[int]], texts,
                             stops: list[str], prompt_tokens: int):
    """SSE chunks of a streamed ``/v1/completions`` (``text_completion`` objects, then usage)."""
    rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), srv.config.model_name
    tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
    offsets = [0] * len(rows)
    started = [False] * len(rows)
    done: dict[int, Any] = {}
    async for p in pieces(deltas, len(rows), srv.decode, stops, srv.logprobs_mode(req), srv.sampler.eos_token_ids):
        text = p.text
        if req.echo and not started[p.row]:
            text = (texts[p.row // req.n] if texts is not None else srv.decode(rows[p.row])) + text
        started[p.row] = True
        choice: dict[str, Any] = {"index": p.row, "text": text, "logprobs": None, "finish_reason": p.finish_reason,
                                  "stop_reason": p.stop_reason}
        if req.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(srv, p.token_ids, p.logprobs, p.top_logprobs, req.logprobs,
                                                      tok_str, offsets[p.row])
            offsets[p.row] += sum(len(srv.token_text(t)) for t in p.token_ids)
        if req.return_token_ids:
            choice["token_ids"] = p.token_ids
            choice["output_token_versions"] = p.versions
            if p.finish_reason is not None:
                choice["prompt_token_ids"] = rows[p.row]
        if p.finish_reason is not None:
            done[p.row] = p
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                   "choices": [choice], "usage": None})
    if _include_usage(req):
        completion_tokens = sum(len(p.tokens) for p in done.values())
        cached = sum(p.cached_tokens for r, p in done.items() if r % req.n == 0)
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": name, "choices": [],
                   "usage": _usage(prompt_tokens, completion_tokens, cached)})
    yield SSE_DONE


def _count_tools(srv: Serving, parsed) -> None:
    srv.metrics.tool_calls.inc(len(parsed.calls))
    if parsed.failed:
        srv.metrics.tool_call_parse_failures.inc()


async def _chat_events(srv: Serving, req: ChatCompletionRequest, deltas, n: int, prompt_ids: list[int],
                       stops: list[str], top_n: int, tools: ToolRequest | None):
    """SSE chunks of a streamed ``/v1/chat/completions`` (``chat.completion.chunk`` objects)."""
    rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), srv.config.model_name
    tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text

    def chunk(choices, usage=None):
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": choices, "usage": usage})

    for i in range(n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    done: dict[int, Any] = {}
    splitters = [StreamSplitter(tools, srv.tool_parser) for _ in range(n)] if tools is not None else None
    async for p in pieces(deltas, n, srv.decode, stops, srv.logprobs_mode(req), srv.sampler.eos_token_ids):
        text = splitters[p.row].feed(p.text) if splitters is not None else p.text
        ends_with_tools = splitters is not None and p.finish_reason is not None
        choice: dict[str, Any] = {"index": p.row, "delta": {"content": text} if text else {}, "logprobs": None,
                                  "finish_reason": None if ends_with_tools else p.finish_reason,
                                  "stop_reason": None if ends_with_tools else p.stop_reason}
        if req.logprobs:
            choice["logprobs"] = _chat_logprobs(p.token_ids, p.logprobs, p.top_logprobs, top_n, tok_str)
        if req.return_token_ids:
            choice["token_ids"] = p.token_ids
            choice["output_token_versions"] = p.versions
        if p.finish_reason is not None:
            done[p.row] = p
        yield chunk([choice])
        if ends_with_tools:  # the rest of the content, each call whole, then the finish
            rest, parsed = splitters[p.row].finish()
            _count_tools(srv, parsed)
            if rest:
                yield chunk([{"index": p.row, "delta": {"content": rest}, "logprobs": None, "finish_reason": None}])
            for i, call in enumerate(parsed.calls):
                yield chunk([{"index": p.row, "delta": {"tool_calls": [{"index": i, **call.to_openai()}]},
                              "logprobs": None, "finish_reason": None}])
            yield chunk([{"index": p.row, "delta": {}, "logprobs": None,
                          "finish_reason": "tool_calls" if parsed.calls else p.finish_reason,
                          "stop_reason": None if parsed.calls else p.stop_reason}])
    if _include_usage(req):
        completion_tokens = sum(len(p.tokens) for p in done.values())
        cached = done[0].cached_tokens if 0 in done else 0
        yield chunk([], _usage(len(prompt_ids), completion_tokens, cached))
    yield SSE_DONE


async def _response_events(srv: Serving, req, body: dict[str, Any], chat: dict[str, Any],
                           creq: ChatCompletionRequest, job, deltas):
    """SSE events of a streamed ``/v1/responses``: its text as it is generated (tool-call markup held
    back and given as ``function_call`` items at the end), then the final response object."""
    rid, created = f"resp_{uuid.uuid4().hex}", time.time()
    events = ResponseEvents()
    empty = {"role": "assistant", "content": ""}
    pending = pending_response(response_object(rid, srv.config.model_name, empty, body, input_tokens=0,
                                               output_tokens=0, created_at=created))
    for e in events.start(pending):
        yield e
    splitter = StreamSplitter(job.tools, srv.tool_parser) if job.tools is not None else None
    last = None
    async for p in pieces(deltas, 1, srv.decode, job.stops, srv.logprobs_mode(creq), srv.sampler.eos_token_ids):
        for e in events.text(splitter.feed(p.text) if splitter is not None else p.text):
            yield e
        last = p
    message: dict[str, Any] = {"role": "assistant", "content": events.text_so_far}
    if splitter is not None:
        rest, parsed = splitter.finish()
        _count_tools(srv, parsed)
        message["content"] = events.text_so_far + rest
        if parsed.calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.calls]
    srv.responses.put(rid, conversation(chat["messages"], message, req.instructions))
    version = last.completion.weight_version if last is not None and last.completion is not None else None
    obj = response_object(rid, srv.config.model_name, message, body, input_tokens=len(job.rows[0]),
                          output_tokens=len(last.tokens) if last is not None else 0,
                          cached_tokens=last.cached_tokens if last is not None else 0,
                          truncated=last is not None and last.finish_reason == "length" and not message.get("tool_calls"),
                          created_at=created,
                          extra={"weight_version": srv.sampler.weight_version if version is None else version})
    for e in events.finish(obj):
        yield e


def _stream_response(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _render_chat(srv: Serving, req: ChatCompletionRequest, tools: ToolRequest | None) -> list[int]:
    """The prompt token ids of a chat request (chat template, tools, ``continue_final_message``, the
    prefill of ``tool_choice`` required / named); runs in a worker thread (long content is rendered
    and tokenized off the event loop)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            try:
                content = "".join(part["text"] for part in content if part.get("type", "text") == "text")
            except (KeyError, TypeError, AttributeError):
                raise APIError("content parts must be {'type': 'text', 'text': ...}",
                               param=f"messages.{i}.content") from None
        msg = m.model_dump(exclude_none=True)
        msg["content"] = content if content is not None else ""
        messages.append(msg)
    template_vars = dict(req.chat_template_kwargs or {})
    if tools is not None:
        template_vars["tools"] = list(tools.tools)
    try:
        if req.continue_final_message:
            rendered = srv.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False,
                                                         **template_vars)
            last = messages[-1]["content"]
            cut = rendered.rfind(last)
            rendered = rendered[: cut + len(last)] if cut >= 0 else rendered
        else:
            rendered = srv.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=False, **template_vars)
    except Exception as exc:  # template errors are the request's fault
        raise APIError(f"chat template failed: {type(exc).__name__}: {exc}", param="messages") from exc
    if tools is not None:
        rendered += tools.prefill(srv.tool_parser)
    return srv.encode_many([rendered], add_special_tokens=False, param="messages")[0]


@dataclasses.dataclass
class _Rows:
    """A parsed generation request: one row per (prompt, choice), the rows' sampling options, each
    row's choice index (mixed into its seed), the prompts' token count, stop strings and, for a
    text prompt, the texts."""

    rows: list[list[int]]
    params: list[Any]
    choices: list[int]
    prompt_tokens: int
    stops: list[str]
    texts: list[str] | None = None
    tools: ToolRequest | None = None


async def _parse_completion(srv: Serving, req: CompletionRequest) -> _Rows:
    """Validate a ``/v1/completions`` request and tokenize its prompt(s)."""
    srv.check_model(req.model)
    srv.check_unsupported(req)
    if req.best_of is not None and req.best_of != req.n:
        raise APIError("best_of is not supported (it must equal n)", param="best_of")
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError("echo together with logprobs (prompt logprobs) is not supported", param="echo")
    if req.logprobs is not None and req.logprobs > MAX_TOP_LOGPROBS:
        raise APIError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", param="logprobs")
    p = req.prompt
    if isinstance(p, str):
        texts, ids_list = [p], None
    elif len(p) == 0:
        raise APIError("prompt is empty", param="prompt")
    elif all(isinstance(x, int) for x in p):
        texts, ids_list = None, [list(p)]
    elif all(isinstance(x, str) for x in p):
        texts, ids_list = list(p), None
    else:
        texts, ids_list = None, [list(x) for x in p]
    srv.check_n(req.n, len(ids_list) if ids_list is not None else len(texts))
    if ids_list is None:
        ids_list = await srv.encode_async(texts, add_special_tokens=True)
    for ids in ids_list:
        srv.check_prompt_ids(ids, param="prompt")
    max_tokens = srv.resolve_max_tokens(req.max_tokens, [len(x) for x in ids_list], param="max_tokens", copies=req.n)
    stops = srv.check_stop_strings(req.stop)
    sp = sampling_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         seed=req.seed, stop_token_ids=srv.check_stop_token_ids(req.stop_token_ids),
                         ignore_eos=req.ignore_eos, top_logprobs=req.logprobs or 0)
    rows = [ids for ids in ids_list for _ in range(req.n)]
    return _Rows(rows=rows, params=[sp] * len(rows), choices=[j for _ in ids_list for j in range(req.n)],
                 prompt_tokens=sum(len(x) for x in ids_list), stops=stops, texts=texts)


def _completion_body(srv: Serving, req: CompletionRequest, job: _Rows, results) -> dict[str, Any]:
    """The ``text_completion`` answer to ``req`` from its rows' results."""
    built = build_choices(srv, results, job.stops, srv.logprobs_mode(req))
    tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
    choices = []
    for ch in built:
        text = ch.text
        if req.echo:
            prompt = job.texts[ch.index // req.n] if job.texts is not None else srv.decode(ch.completion.prompt_ids)
            text = prompt + text
        choice: dict[str, Any] = {"index": ch.index, "text": text, "logprobs": None,
                                  "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
        if req.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(srv, ch.token_ids, ch.logprobs, ch.top_logprobs,
                                                      req.logprobs, tok_str)
        if req.return_token_ids:
            choice["token_ids"] = ch.token_ids
            choice["prompt_token_ids"] = ch.completion.prompt_ids
            choice["output_token_versions"] = ch.completion.output_token_versions[: len(ch.token_ids)]
        choices.append(choice)
    completion_tokens = sum(len(ch.token_ids) for ch in built)
    cached = sum(c.cached_tokens for c in results[:: req.n])
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": srv.config.model_name, "choices": choices,
        "usage": _usage(job.prompt_tokens, completion_tokens, cached),
        "weight_version": min(c.weight_version for c in results),
    }


async def _parse_chat(srv: Serving, req: ChatCompletionRequest) -> _Rows:
    """Validate a ``/v1/chat/completions`` request and render its messages with the chat template."""
    srv.check_model(req.model)
    srv.check_unsupported(req)
    if not req.messages:
        raise APIError("messages must be a non-empty list", param="messages")
    top_n = req.top_logprobs or 0
    if top_n > MAX_TOP_LOGPROBS:
        raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}", param="top_logprobs")
    if top_n and not req.logprobs:
        raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
    srv.check_n(req.n, 1)

    def error(message: str, param: str) -> APIError:
        return APIError(message, param=param)

    tools = parse_tool_request(req.tools, req.tool_choice, req.parallel_tool_calls, error)
    check_tool_messages([m.model_dump(exclude_none=True) for m in req.messages], error)
    if tools is not None:
        srv.check_renders_tools()
        if req.continue_final_message and tools.prefill(srv.tool_parser):
            raise APIError("tool_choice 'required' or a named function cannot continue the final message "
                           "(both would write the start of the answer)", param="tool_choice")
    prompt_ids = await asyncio.to_thread(_render_chat, srv, req, tools)
    srv.check_prompt_ids(prompt_ids, param="messages")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = srv.resolve_max_tokens(requested, [len(prompt_ids)], param=param, copies=req.n)
    stops = srv.check_stop_strings(req.stop)
    sp = sampling_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                         seed=req.seed, stop_token_ids=srv.check_stop_token_ids(req.stop_token_ids),
                         ignore_eos=req.ignore_eos, top_logprobs=top_n)
    return _Rows(rows=[prompt_ids] * req.n, params=[sp] * req.n, choices=list(range(req.n)),
                 prompt_tokens=len(prompt_ids), stops=stops, tools=tools)


def _chat_body(srv: Serving, req: ChatCompletionRequest, job: _Rows, results) -> dict[str, Any]:
    """The ``chat.completion`` answer to ``req`` from its rows' results."""
    built = build_choices(srv, results, job.stops, srv.logprobs_mode(req))
    tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
    choices = []
    for ch in built:
        message: dict[str, Any] = {"role": "assistant", "content": ch.text}
        finish, stop_reason = ch.finish_reason, ch.stop_reason
        if job.tools is not None:
            parsed = job.tools.finish(srv.tool_parser, ch.text)
            _count_tools(srv, parsed)
            message["content"] = parsed.content
            if parsed.calls:
                message["tool_calls"] = [c.to_openai() for c in parsed.calls]
                finish, stop_reason = "tool_calls", None
        choice: dict[str, Any] = {"index": ch.index, "message": message,
                                  "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason}
        if req.logprobs:
            choice["logprobs"] = _chat_logprobs(ch.token_ids, ch.logprobs, ch.top_logprobs, req.top_logprobs or 0,
                                                tok_str)
        if req.return_token_ids:
            choice["token_ids"] = ch.token_ids
            choice["output_token_versions"] = ch.completion.output_token_versions[: len(ch.token_ids)]
        choices.append(choice)
    usage = _usage(job.prompt_tokens, sum(len(ch.token_ids) for ch in built), results[0].cached_tokens)
    body: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": srv.config.model_name, "choices": choices, "usage": usage,
        "weight_version": min(c.weight_version for c in results),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = job.rows[0]
    return body


def openai_router(srv: Serving) -> APIRouter:
    """The OpenAI-dialect routes over ``srv``: each parses, serves (whole or streamed) and answers."""
    router = APIRouter()
    config = srv.config

    @router.get("/v1/models", response_model=ModelList, responses=errors(500))
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": srv.created, "owned_by": "jaxprm",
            "root": config.model_name, "max_model_len": srv.sampler.max_context,
            "weight_version": srv.sampler.weight_version,
        }]}

    generation_errors = errors(400, 404, 413, 500, 503, 504)

    @router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_unset=True,
                 responses={200: {"content": EVENT_STREAM, "description": "a completion (stream: events)"},
                            **generation_errors})
    async def completions(req: CompletionRequest, raw: Request):
        job = await _parse_completion(srv, req)
        if req.stream:
            deltas = srv.stream(job.rows, job.params, job.choices)
            return _stream_response(_completion_events(srv, req, deltas, job.rows, job.texts, job.stops,
                                                       job.prompt_tokens))
        results = await srv.run(job.rows, job.params, job.choices, request=raw)
        return _completion_body(srv, req, job, results)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_unset=True,
                 responses={200: {"content": EVENT_STREAM, "description": "a chat completion (stream: events)"},
                            **generation_errors})
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        job = await _parse_chat(srv, req)
        if req.stream:
            deltas = srv.stream(job.rows, job.params, job.choices)
            return _stream_response(_chat_events(srv, req, deltas, req.n, job.rows[0], job.stops,
                                                 req.top_logprobs or 0, job.tools))
        results = await srv.run(job.rows, job.params, job.choices, request=raw)
        return _chat_body(srv, req, job, results)

    @router.post("/v1/responses", response_model=ResponseBody, response_model_exclude_unset=True,
                 responses={200: {"content": EVENT_STREAM, "description": "a response (stream: events)"},
                            **generation_errors})
    async def responses(req: ResponsesRequest, raw: Request):
        def error(message: str, param: str) -> APIError:
            return APIError(message, param=param)

        body = req.model_dump(exclude_none=True)
        prev = req.previous_response_id
        history = srv.responses.get(prev, error) if prev is not None else None
        chat = to_chat_body(body, history, error)
        chat["stream"] = False
        try:
            creq = ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:  # the translated input: a 400 like any request body
            raise RequestValidationError(exc.errors()) from None
        job = await _parse_chat(srv, creq)
        if req.stream:
            deltas = srv.stream(job.rows, job.params, job.choices)
            return _stream_response(_response_events(srv, req, body, chat, creq, job, deltas))
        results = await srv.run(job.rows, job.params, job.choices, request=raw)
        answer = _chat_body(srv, creq, job, results)
        choice = answer["choices"][0]
        rid = f"resp_{uuid.uuid4().hex}"
        srv.responses.put(rid, conversation(chat["messages"], choice["message"], req.instructions))
        obj = response_object(rid, config.model_name, choice["message"], body,
                              input_tokens=answer["usage"]["prompt_tokens"],
                              output_tokens=answer["usage"]["completion_tokens"],
                              cached_tokens=answer["usage"]["prompt_tokens_details"]["cached_tokens"],
                              truncated=choice["finish_reason"] == "length",
                              extra={"weight_version": answer["weight_version"]})
        return obj

    return router
