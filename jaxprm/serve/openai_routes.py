"""The OpenAI / vLLM dialect: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

* ``/v1/completions``: text completions; prompt as text, token ids or a batch of either;
  ``return_token_ids`` adds ``choices[i].token_ids`` and ``choices[i].prompt_token_ids``.
* ``/v1/chat/completions``: the model's chat template renders ``messages``; logprobs in the OpenAI
  chat shape; ``return_token_ids`` adds ``choices[i].token_ids`` and top-level ``prompt_token_ids``.

Every answer reports the ``weight_version`` that produced it (the oldest among its choices).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter

from jaxprm.serve.errors import APIError
from jaxprm.serve.protocol import ChatCompletionRequest, CompletionRequest
from jaxprm.serve.sampler import MAX_TOP_LOGPROBS
from jaxprm.serve.serving import Choice, Serving, build_choices, sampling_params

__all__ = ["openai_router"]


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion_tokens = sum(len(ch.token_ids) for ch in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _completion_logprobs(srv: Serving, ch: Choice, top_n: int, tok_str) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, offsets)."""
    toks = [tok_str(t) for t in ch.token_ids]
    offsets, pos = [], 0
    for t in ch.token_ids:
        offsets.append(pos)
        pos += len(srv.token_text(t))
    top_dicts = []
    for j in range(len(ch.token_ids)):
        d = {toks[j]: ch.logprobs[j]}
        if ch.top_logprobs is not None:
            for tid, lp in ch.top_logprobs[j][:top_n]:
                d.setdefault(tok_str(tid), lp)
        top_dicts.append(d)
    return {"text_offset": offsets, "token_logprobs": ch.logprobs, "tokens": toks, "top_logprobs": top_dicts}


def _chat_logprobs(ch: Choice, top_n: int, tok_str) -> dict[str, Any]:
    """The chat ``logprobs.content`` list (token, logprob, bytes, top_logprobs)."""
    content = []
    for j, t in enumerate(ch.token_ids):
        tok = tok_str(t)
        alts = []
        if ch.top_logprobs is not None:
            for tid, lp in ch.top_logprobs[j][:top_n]:
                s = tok_str(tid)
                alts.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))})
        content.append({"token": tok, "logprob": ch.logprobs[j], "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": alts})
    return {"content": content}


def _render_chat(srv: Serving, req: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of a chat request (chat template, tools, ``continue_final_message``)."""
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
    if req.tools:
        template_vars["tools"] = req.tools
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
    return srv.encode(rendered, add_special_tokens=False)


def openai_router(srv: Serving) -> APIRouter:
    """The OpenAI-dialect routes over ``srv``."""
    router = APIRouter()
    config = srv.config

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": srv.created, "owned_by": "jaxprm",
            "root": config.model_name, "max_model_len": srv.sampler.max_context,
            "weight_version": srv.sampler.weight_version,
        }]}

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest):
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
        if ids_list is None:
            ids_list = [srv.encode(t, add_special_tokens=True) for t in texts]
        for ids in ids_list:
            srv.check_prompt_ids(ids, param="prompt")
        srv.check_n(req.n, len(ids_list))
        max_tokens = srv.resolve_max_tokens(req.max_tokens, [len(x) for x in ids_list], param="max_tokens")
        stops = srv.check_stop_strings(req.stop)
        sp = sampling_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             seed=req.seed, stop_token_ids=srv.check_stop_token_ids(req.stop_token_ids),
                             ignore_eos=req.ignore_eos, top_logprobs=req.logprobs or 0)
        rows = [ids for ids in ids_list for _ in range(req.n)]
        choices_idx = [j for _ in ids_list for j in range(req.n)]
        results = await srv.run(rows, [sp] * len(rows), choices_idx)
        built = build_choices(srv, results, stops, srv.logprobs_mode(req))
        tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
        choices = []
        for ch in built:
            text = ch.text
            if req.echo:
                prompt_text = texts[ch.index // req.n] if texts is not None else srv.decode(ch.completion.prompt_ids)
                text = prompt_text + text
            choice: dict[str, Any] = {"index": ch.index, "text": text, "logprobs": None,
                                      "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
            if req.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(srv, ch, req.logprobs, tok_str)
            if req.return_token_ids:
                choice["token_ids"] = ch.token_ids
                choice["prompt_token_ids"] = ch.completion.prompt_ids
            choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": config.model_name, "choices": choices,
            "usage": _usage(sum(len(x) for x in ids_list), built),
            "weight_version": min(c.weight_version for c in results),
        }

    @router.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        srv.check_model(req.model)
        srv.check_unsupported(req)
        if not req.messages:
            raise APIError("messages must be a non-empty list", param="messages")
        top_n = req.top_logprobs or 0
        if top_n > MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}", param="top_logprobs")
        if top_n and not req.logprobs:
            raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
        prompt_ids = _render_chat(srv, req)
        srv.check_prompt_ids(prompt_ids, param="messages")
        srv.check_n(req.n, 1)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = srv.resolve_max_tokens(requested, [len(prompt_ids)], param=param)
        stops = srv.check_stop_strings(req.stop)
        sp = sampling_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             seed=req.seed, stop_token_ids=srv.check_stop_token_ids(req.stop_token_ids),
                             ignore_eos=req.ignore_eos, top_logprobs=top_n)
        results = await srv.run([prompt_ids] * req.n, [sp] * req.n, list(range(req.n)))
        built = build_choices(srv, results, stops, srv.logprobs_mode(req))
        tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
        choices = []
        for ch in built:
            choice: dict[str, Any] = {"index": ch.index, "message": {"role": "assistant", "content": ch.text},
                                      "logprobs": None, "finish_reason": ch.finish_reason,
                                      "stop_reason": ch.stop_reason}
            if req.logprobs:
                choice["logprobs"] = _chat_logprobs(ch, top_n, tok_str)
            if req.return_token_ids:
                choice["token_ids"] = ch.token_ids
            choices.append(choice)
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": config.model_name, "choices": choices, "usage": _usage(len(prompt_ids), built),
            "weight_version": min(c.weight_version for c in results),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    return router
