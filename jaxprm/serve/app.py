"""The FastAPI application: OpenAI / vLLM / SGLang compatible endpoints over a ``BatchingEngine``.

Endpoints (``/health`` and ``/v1/models`` aside, all are POST with a JSON body):

* ``/v1/completions``: vLLM-compatible text completions; prompt as text, token ids or a batch of
  either; ``return_token_ids`` adds ``choices[i].token_ids`` and ``choices[i].prompt_token_ids``.
* ``/v1/chat/completions``: the model's chat template renders ``messages``; logprobs in the OpenAI
  chat shape; ``return_token_ids`` adds ``choices[i].token_ids`` and top-level ``prompt_token_ids``.
* ``/generate``: SGLang-style (``text`` or ``input_ids``, ``sampling_params``, ``return_logprob`` ->
  ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text_or_null]``).
* ``/update_weights_from_disk``: load a saved checkpoint (``{"model_path": ...}``) and swap it in.
* ``/get_weight_version``, ``/health``, ``/v1/models``.

Every generation response reports the ``weight_version`` that produced it (top level for the OpenAI
endpoints, ``meta_info.weight_version`` for ``/generate``).

Which log-probability is reported is chosen by ``logprobs_mode`` (server default
``ServeConfig.logprobs_mode``, per-request override field ``logprobs_mode``): ``"processed"`` is the
log-prob under the distribution the token was sampled from (temperature, top-k, top-p applied),
``"raw"`` the model's own log-softmax at temperature 1 (see ``jaxprm.sampler``).

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for bad
input (400 validation / malformed JSON, 401 API key, 404 unknown model, 413 body too large) and never
take the server down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxprm.sampler import MAX_TOP_LOGPROBS, Completion, Sampler, SamplingParams
from jaxprm.serve.engine import BatchingEngine
from jaxprm.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    UpdateWeightsFromDiskRequest,
)

__all__ = ["ServeConfig", "APIError", "create_app"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ServeConfig:
    """Server options.

    Attributes:
      model_name: the name served in ``/v1/models`` and accepted in ``model`` (also ``None``/absent).
      api_key: if set, every endpoint but ``/health`` requires ``Authorization: Bearer <api_key>``.
      max_body_bytes: larger request bodies get 413.
      max_n: largest ``n`` per prompt; ``max_rows_per_request`` caps ``n * number of prompts``.
      default_max_tokens: chat / default cap when the request gives none (``None``: rest of context).
      logprobs_mode: ``"processed"`` (sampling distribution) or ``"raw"`` (temperature-1 policy).
      request_timeout_s: a request waiting longer for generation gets 504.
      collect_window_s / max_collect_s / max_batch: dynamic batching: a batch closes when no request
        arrived for ``collect_window_s``, ``max_collect_s`` after its first request, or at
        ``max_batch`` rows (see ``BatchingEngine``).
      max_stop_strings: most ``stop`` strings per request.
    """

    model_name: str = "jaxprm"
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 64
    max_rows_per_request: int = 256
    default_max_tokens: int | None = None
    logprobs_mode: str = "processed"
    request_timeout_s: float = 600.0
    collect_window_s: float = 0.005
    max_collect_s: float = 0.05
    max_batch: int | None = None
    max_stop_strings: int = 16

    def __post_init__(self):
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")


class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                             413: "RequestTooLargeError", 503: "ServiceUnavailableError",
                             504: "TimeoutError"}.get(status, "InternalServerError")


def _error_response(status: int, message: str, *, param: str | None = None, type: str | None = None) -> JSONResponse:
    err = APIError(message, status=status, param=param, type=type)
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": status}}
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------------------------
# ASGI middleware: request size limit and API key


class _TooLarge(Exception):
    """Raised from ``receive`` when a streamed request body passes the size limit."""


class _LimitsMiddleware:
    """Reject bodies over ``max_body_bytes`` (413) and, if configured, missing/wrong API keys (401)."""

    def __init__(self, app, *, max_body_bytes: int, api_key: str | None, open_paths: Sequence[str] = ("/health",)):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.open_paths = set(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in self.open_paths:
            auth = headers.get("authorization", "")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                resp = _error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
                return await resp(scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                return await _error_response(400, "invalid Content-Length header")(scope, receive, send)
            if too_big:
                msg = f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} bytes"
                return await _error_response(413, msg)(scope, receive, send)
        received = 0
        limit = self.max_body_bytes
        too_large = False
        started = False
        msg = f"request body exceeds the limit of {self.max_body_bytes} bytes"

        async def limited_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    too_large = True
                    raise _TooLarge
            return message

        async def guarded_send(message):
            # A streamed body over the limit: whatever the app answers (it may catch the error while
            # parsing and reply 400), the client gets a 413.
            nonlocal started
            if too_large:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await _error_response(413, msg)(scope, receive, send)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _TooLarge:
            if not started:
                await _error_response(413, msg)(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# the server state and helpers


class _Server:
    """Everything a request handler needs: sampler, tokenizer, engine, config, token-text cache."""

    def __init__(self, sampler: Sampler, tokenizer, config: ServeConfig, load_fn: Callable | None):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        self.load_fn = load_fn
        self.engine = BatchingEngine(sampler, max_batch=config.max_batch, collect_window_s=config.collect_window_s,
                                     max_collect_s=config.max_collect_s)
        self.created = int(time.time())
        self._swap_lock = asyncio.Lock()
        self._token_text: dict[int, str] = {}

    # tokens <-> text ---------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """The text of one token (special tokens included), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = text
        return text

    @staticmethod
    def token_label(token_id: int) -> str:
        """vLLM's ``return_tokens_as_token_ids`` form of a token: ``"token_id:<id>"``."""
        return f"token_id:{token_id}"

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # validation --------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise APIError(f"The model `{name}` does not exist. Served: `{self.config.model_name}`.",
                           status=404, param="model", type="NotFoundError")

    def check_prompt_ids(self, ids: Sequence[int], *, param: str) -> None:
        if len(ids) == 0:
            raise APIError("prompt is empty", param=param)
        V = self.sampler.vocab_size
        bad = [t for t in ids if not (0 <= int(t) < V)]
        if bad:
            raise APIError(f"token ids out of vocabulary [0, {V}): {bad[:8]}", param=param)
        ctx = self.sampler.max_context
        if len(ids) >= ctx:
            raise APIError(f"This model's maximum context length is {ctx} tokens; the prompt has {len(ids)} "
                           f"tokens, which leaves no room to generate.", param=param)

    def resolve_max_tokens(self, requested: int | None, prompt_lens: Sequence[int], *, param: str) -> int:
        ctx = self.sampler.max_context
        room = ctx - max(prompt_lens)
        cap = min(room, self.sampler.new_token_buckets[-1])
        if requested is None:
            value = cap if self.config.default_max_tokens is None else min(cap, self.config.default_max_tokens)
            return max(1, value)
        if requested < 1:
            raise APIError(f"{param} must be at least 1, got {requested}", param=param)
        if requested > cap:
            raise APIError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{requested} output tokens and your prompt contains {max(prompt_lens)} tokens, "
                f"for a total of {requested + max(prompt_lens)} tokens (at most {cap} output tokens "
                f"fit). Please reduce the length of the prompt or {param}.",
                param=param,
            )
        return int(requested)

    def check_stop_token_ids(self, ids: Sequence[int] | None, *, param: str = "stop_token_ids") -> tuple[int, ...]:
        ids = tuple(int(t) for t in (ids or ()))
        V = self.sampler.vocab_size
        bad = [t for t in ids if not (0 <= t < V)]
        if bad:
            raise APIError(f"stop token ids out of vocabulary [0, {V}): {bad[:8]}", param=param)
        return ids

    def check_stop_strings(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.config.max_stop_strings:
            raise APIError(f"at most {self.config.max_stop_strings} stop strings, got {len(stops)}", param="stop")
        if any(s == "" for s in stops):
            raise APIError("stop strings must be non-empty", param="stop")
        return stops

    def check_n(self, n: int, num_prompts: int) -> None:
        if n > self.config.max_n:
            raise APIError(f"n must be in [1, {self.config.max_n}], got {n}", param="n")
        if n * num_prompts > self.config.max_rows_per_request:
            raise APIError(f"n * number of prompts = {n * num_prompts} exceeds {self.config.max_rows_per_request}",
                           param="n")

    @staticmethod
    def check_unsupported(req) -> None:
        if getattr(req, "stream", False):
            raise APIError("streaming is not supported by this server; send stream=false", param="stream")
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(req, name, None)
            if value is not None and value != neutral:
                raise APIError(f"{name} is not supported (only the neutral value {neutral})", param=name)

    def logprobs_mode(self, req) -> str:
        return getattr(req, "logprobs_mode", None) or self.config.logprobs_mode

    # generation --------------------------------------------------------------------------
    async def run(self, prompts, params, choices) -> list[Completion]:
        if not self.engine.running:
            raise APIError("generation engine is not running", status=503)
        for p, sp in zip(prompts, params):  # reject here rather than fail a whole batch later
            try:
                self.sampler.check_request(p, sp)
            except ValueError as exc:
                raise APIError(str(exc)) from exc
        try:
            return await self.engine.generate(prompts, params, choices, timeout=self.config.request_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(f"generation timed out after {self.config.request_timeout_s} s", status=504) from None
        except ValueError as exc:  # the sampler's own checks
            raise APIError(str(exc)) from exc

    def cut_at_stop_strings(self, c: Completion, stops: Sequence[str]) -> tuple[int, str, str | None]:
        """Return (tokens kept, text, matched stop string) after applying stop strings (post hoc).

        Generation stops on tokens only; a stop string is applied afterwards: the output keeps the
        shortest token prefix whose text contains a stop string, and the text is cut before it.
        """
        n = len(c.token_ids)
        text = self.decode(c.token_ids)
        if not stops or not any(s in text for s in stops):
            return n, text, None
        lo, hi = 1, n  # smallest j with a stop string inside decode(tokens[:j])
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.decode(c.token_ids[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        prefix = self.decode(c.token_ids[:lo])
        cut, matched = min((prefix.find(s), s) for s in stops if s in prefix)
        return lo, prefix[:cut], matched


def _sampling_params(*, max_tokens: int, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, top_logprobs) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=0 if top_k is None or top_k < 0 else int(top_k),
        seed=seed,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=bool(ignore_eos),
        top_logprobs=int(top_logprobs),
    )


def _choice_logprob_arrays(c: Completion, n_keep: int, mode: str):
    lps = (c.logprobs if mode == "raw" else c.sampling_logprobs)[:n_keep]
    col = 1 if mode == "raw" else 2
    tops = None if c.top_logprobs is None else [[(t[0], t[col]) for t in pos] for pos in c.top_logprobs[:n_keep]]
    return lps, tops


def _finish(c: Completion, matched: str | None, n_keep: int, eos_ids: Sequence[int]) -> tuple[str, Any]:
    if matched is not None:
        return "stop", matched
    if c.finish_reason == "stop" and n_keep == len(c.token_ids):
        sid = c.stop_token_id
        return "stop", (None if sid in eos_ids else sid)
    return c.finish_reason, None


# ---------------------------------------------------------------------------------------------
# app factory


def create_app(
    sampler: Sampler,
    tokenizer,
    config: ServeConfig | None = None,
    *,
    load_fn: Callable[[str], tuple[Any, Any]] | None = None,
) -> FastAPI:
    """Build the FastAPI app; the batching engine starts and stops with the app's lifespan.

    Args:
      sampler: the ``jaxprm.sampler.Sampler`` holding the weights.
      tokenizer: a ``jaxprm.models.Tokenizer`` (encode, decode, apply_chat_template).
      config: ``ServeConfig`` (defaults).
      load_fn: ``path -> (model, tokenizer)`` for ``/update_weights_from_disk`` (default
        ``jaxprm.models.load_model``).
    """
    config = config or ServeConfig()
    srv = _Server(sampler, tokenizer, config, load_fn)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.engine.start()
        try:
            yield
        finally:
            srv.engine.stop()

    app = FastAPI(title="jaxprm generation server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv
    app.add_middleware(_LimitsMiddleware, max_body_bytes=config.max_body_bytes, api_key=config.api_key)

    # error handlers ----------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc.status, exc.message, param=exc.param, type=exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            if e.get("type") == "json_invalid":
                parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            else:
                parts.append(f"{loc or 'body'}: {e.get('msg')}")
        param = None
        errs = exc.errors()
        if errs:
            loc = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
            param = ".".join(loc) or None
        return _error_response(400, "; ".join(parts) or "invalid request", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return _error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    # simple endpoints --------------------------------------------------------------------
    @app.get("/health")
    async def health():
        ok = srv.engine.running
        return JSONResponse({"status": "ok" if ok else "engine stopped", "weight_version": srv.sampler.weight_version},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": srv.created, "owned_by": "jaxprm",
            "root": config.model_name, "max_model_len": srv.sampler.max_context,
            "weight_version": srv.sampler.weight_version,
        }]}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": srv.sampler.weight_version}

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": config.model_name, "is_generation": True, "max_context": srv.sampler.max_context,
                "vocab_size": srv.sampler.vocab_size, "weight_version": srv.sampler.weight_version}

    # /v1/completions ---------------------------------------------------------------------
    @app.post("/v1/completions")
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
        for i, ids in enumerate(ids_list):
            srv.check_prompt_ids(ids, param="prompt")
        srv.check_n(req.n, len(ids_list))
        max_tokens = srv.resolve_max_tokens(req.max_tokens, [len(x) for x in ids_list], param="max_tokens")
        stops = srv.check_stop_strings(req.stop)
        sp = _sampling_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, stop_token_ids=srv.check_stop_token_ids(req.stop_token_ids),
                              ignore_eos=req.ignore_eos, top_logprobs=req.logprobs or 0)
        rows = [ids for ids in ids_list for _ in range(req.n)]
        choices_idx = [j for _ in ids_list for j in range(req.n)]
        results = await srv.run(rows, [sp] * len(rows), choices_idx)
        mode = srv.logprobs_mode(req)
        choices = []
        completion_tokens = 0
        for idx, c in enumerate(results):
            n_keep, text, matched = srv.cut_at_stop_strings(c, stops)
            reason, stop_reason = _finish(c, matched, n_keep, srv.sampler.eos_token_ids)
            ids = c.token_ids[:n_keep]
            completion_tokens += len(ids)
            if req.echo:
                prompt_text = texts[idx // req.n] if texts is not None else srv.decode(c.prompt_ids)
                text = prompt_text + text
            choice: dict[str, Any] = {"index": idx, "text": text, "logprobs": None, "finish_reason": reason,
                                      "stop_reason": stop_reason}
            tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
            if req.logprobs is not None:
                lps, tops = _choice_logprob_arrays(c, n_keep, mode)
                toks = [tok_str(t) for t in ids]
                offsets, pos = [], 0
                for t in ids:
                    offsets.append(pos)
                    pos += len(srv.token_text(t))
                top_dicts = []
                for j, t in enumerate(ids):
                    d = {toks[j]: lps[j]}
                    if tops is not None:
                        for tid, lp in tops[j][: req.logprobs]:
                            d.setdefault(tok_str(tid), lp)
                    top_dicts.append(d)
                choice["logprobs"] = {"text_offset": offsets, "token_logprobs": lps, "tokens": toks,
                                      "top_logprobs": top_dicts}
            if req.return_token_ids:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = c.prompt_ids
            choices.append(choice)
        prompt_tokens = sum(len(x) for x in ids_list)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": config.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "weight_version": min(c.weight_version for c in results),
        }

    # /v1/chat/completions ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
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
        prompt_ids = srv.encode(rendered, add_special_tokens=False)
        srv.check_prompt_ids(prompt_ids, param="messages")
        srv.check_n(req.n, 1)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = srv.resolve_max_tokens(requested, [len(prompt_ids)], param=param)
        stops = srv.check_stop_strings(req.stop)
        sp = _sampling_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, stop_token_ids=srv.check_stop_token_ids(req.stop_token_ids),
                              ignore_eos=req.ignore_eos, top_logprobs=top_n)
        results = await srv.run([prompt_ids] * req.n, [sp] * req.n, list(range(req.n)))
        mode = srv.logprobs_mode(req)
        choices = []
        completion_tokens = 0
        for idx, c in enumerate(results):
            n_keep, text, matched = srv.cut_at_stop_strings(c, stops)
            reason, stop_reason = _finish(c, matched, n_keep, srv.sampler.eos_token_ids)
            ids = c.token_ids[:n_keep]
            completion_tokens += len(ids)
            choice: dict[str, Any] = {"index": idx, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": reason, "stop_reason": stop_reason}
            if req.logprobs:
                tok_str = srv.token_label if req.return_tokens_as_token_ids else srv.token_text
                lps, tops = _choice_logprob_arrays(c, n_keep, mode)
                content = []
                for j, t in enumerate(ids):
                    tok = tok_str(t)
                    alts = []
                    if tops is not None:
                        for tid, lp in tops[j][:top_n]:
                            s = tok_str(tid)
                            alts.append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))})
                    content.append({"token": tok, "logprob": lps[j], "bytes": list(tok.encode("utf-8")),
                                    "top_logprobs": alts})
                choice["logprobs"] = {"content": content}
            if req.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        body: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": config.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "weight_version": min(c.weight_version for c in results),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return body

    # /generate (SGLang) ------------------------------------------------------------------
    @app.post("/generate")
    async def generate(req: GenerateRequest):
        if req.stream:
            raise APIError("streaming is not supported by this server; send stream=false", param="stream")
        spp = req.sampling_params
        srv.check_unsupported(spp)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("exactly one of 'text' or 'input_ids' must be given", param="text")
        if req.top_logprobs_num > MAX_TOP_LOGPROBS:
            raise APIError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
        if req.text is not None:
            batched = isinstance(req.text, list)
            texts = req.text if batched else [req.text]
            ids_list = [srv.encode(t, add_special_tokens=True) for t in texts]
        else:
            batched = len(req.input_ids) > 0 and isinstance(req.input_ids[0], list)
            ids_list = [list(x) for x in req.input_ids] if batched else [list(req.input_ids)]
        if batched and not ids_list:
            raise APIError("empty batch", param="input_ids" if req.input_ids is not None else "text")
        for ids in ids_list:
            srv.check_prompt_ids(ids, param="input_ids" if req.input_ids is not None else "text")
        srv.check_n(spp.n, len(ids_list))
        max_new = srv.resolve_max_tokens(spp.max_new_tokens, [len(x) for x in ids_list],
                                         param="sampling_params.max_new_tokens")
        stops = srv.check_stop_strings(spp.stop)
        seed = spp.sampling_seed if spp.sampling_seed is not None else spp.seed
        top_n = req.top_logprobs_num if req.return_logprob else 0
        sp = _sampling_params(max_tokens=max_new, temperature=spp.temperature, top_p=spp.top_p, top_k=spp.top_k,
                              seed=seed, stop_token_ids=srv.check_stop_token_ids(spp.stop_token_ids,
                                                                                 param="sampling_params.stop_token_ids"),
                              ignore_eos=spp.ignore_eos, top_logprobs=top_n)
        rows = [ids for ids in ids_list for _ in range(spp.n)]
        choices_idx = [j for _ in ids_list for j in range(spp.n)]
        t0 = time.perf_counter()
        results = await srv.run(rows, [sp] * len(rows), choices_idx)
        latency = time.perf_counter() - t0
        mode = srv.logprobs_mode(req)
        rids = req.rid if isinstance(req.rid, list) else None
        outs = []
        for idx, c in enumerate(results):
            n_keep, text, matched = srv.cut_at_stop_strings(c, stops)
            reason, stop_reason = _finish(c, matched, n_keep, ())
            ids = c.token_ids[:n_keep]
            if reason == "stop":
                finish = {"type": "stop", "matched": stop_reason}
            else:
                finish = {"type": "length", "length": len(ids)}
            rid = rids[idx // spp.n] if rids and idx // spp.n < len(rids) else (req.rid if isinstance(req.rid, str) else uuid.uuid4().hex)
            meta: dict[str, Any] = {
                "id": rid, "finish_reason": finish, "prompt_tokens": len(c.prompt_ids),
                "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": c.weight_version,
                "e2e_latency": latency,
            }
            if req.return_logprob:
                lps, tops = _choice_logprob_arrays(c, n_keep, mode)
                txt = (lambda t: srv.token_text(t)) if req.return_text_in_logprobs else (lambda t: None)
                meta["output_token_logprobs"] = [[lps[j], t, txt(t)] for j, t in enumerate(ids)]
                meta["input_token_logprobs"] = []
                if top_n:
                    meta["output_top_logprobs"] = [[[lp, tid, txt(tid)] for tid, lp in tops[j][:top_n]]
                                                   for j in range(len(ids))]
            outs.append({"text": text, "output_ids": ids, "meta_info": meta})
        return outs if (batched or spp.n > 1) else outs[0]

    # /update_weights_from_disk -----------------------------------------------------------
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest):
        version = None
        if req.weight_version is not None:
            try:
                version = int(req.weight_version)
            except (TypeError, ValueError):
                raise APIError("weight_version must be an integer", param="weight_version") from None
        load = srv.load_fn
        if load is None:
            from jaxprm.models import load_model as load
        async with srv._swap_lock:
            try:
                model, _ = await asyncio.to_thread(load, req.model_path)
                new_version = await asyncio.to_thread(srv.sampler.update_params, model, version=version)
            except Exception as exc:  # a bad path or checkpoint is reported, the old weights stay
                return JSONResponse({"success": False, "message": f"{type(exc).__name__}: {exc}",
                                     "weight_version": srv.sampler.weight_version}, status_code=400)
        return {"success": True, "message": f"loaded weights from {req.model_path}",
                "weight_version": new_version, "num_paused_requests": 0}

    return app

