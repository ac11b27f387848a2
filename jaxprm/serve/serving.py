"""Request handling shared by the server's dialects (OpenAI / vLLM and SGLang).

``Serving`` holds the sampler, tokenizer, batching engine and config, validates what every dialect
validates (model name, prompt ids, ``max_tokens``, stops, ``n``), runs generation and applies stop
strings. ``build_choices`` turns the engine's completions into dialect-neutral :class:`Choice`
records (kept tokens, text, finish reason, log-probs in the requested mode) that each router
formats in its own shape.

Which log-probability is reported is chosen by ``logprobs_mode`` (server default
``ServeConfig.logprobs_mode``, per-request field ``logprobs_mode``): ``"processed"`` is the
log-prob under the distribution the token was sampled from (temperature, top-k, top-p applied),
``"raw"`` the model's own log-softmax at temperature 1 (see ``jaxprm.serve.sampler``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.requests import Request

from jaxprm.fields import require
from jaxprm.serve.engine import DEFAULT_KV_CACHE_BYTES, MIN_WINDOW_FACTOR, Engine, EngineFuture, RowDelta
from jaxprm.serve.errors import APIError
from jaxprm.serve.logprobs import select_logprobs
from jaxprm.serve.metrics import EngineMetrics
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.sampling import MAX_STOP_TOKEN_IDS, Completion, SamplingParams
from jaxprm.serve.threads import awaitable, post
from jaxprm.serve.weights import resolve_roots
from rollout.responses_api import ResponseStore
from rollout.tool_calls import TOOL_CALL_PARSERS, get_parser, template_renders_tools

__all__ = ["ServeConfig", "Serving", "Choice", "build_choices", "sampling_params", "MAX_TOP_K", "GREEDY_BELOW"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Server options.

    Attributes:
      model_name: the name served in ``/v1/models`` and accepted in ``model`` (also ``None``/absent).
      api_key: if set, every endpoint but ``/health`` requires ``Authorization: Bearer <api_key>``.
      max_body_bytes: larger request bodies get 413.
      max_n: largest ``n`` per prompt; ``max_rows_per_request`` caps ``n * number of prompts``.
      max_request_tokens: most tokens of work per request, summed over its rows: ``prompt tokens +
        max_tokens`` per row (``None``: no limit). A request beyond it is a 400; one without
        ``max_tokens`` gets at most what fits. It bounds how long one request holds decode rows
        that later requests wait for (admission is first come, first served).
      default_max_tokens: chat / default cap when the request gives none (``None``: rest of context).
      logprobs_mode: ``"processed"`` (sampling distribution) or ``"raw"`` (temperature-1 policy).
      request_timeout_s: a request waiting longer for generation gets 504.
      max_batch: most sequences decoding at once (default: the sampler's ``max_batch``).
      collect_window_s / max_collect_s: an idle engine waits for a burst of arrivals: until none came
        for ``collect_window_s``, at most ``max_collect_s`` after the first.
      max_stop_strings: most ``stop`` strings per request.
      weights_roots: directories ``/update_weights_from_disk`` may load from (resolved; each must
        exist); empty: loading from disk is refused (see ``jaxprm.serve.weights``).
      block_size: tokens per KV block (the prefix cache shares whole blocks).
      kv_cache_bytes / kv_cache_tokens: the KV pool's memory budget (``kv_cache_tokens`` wins if
        set); a request that can never fit gets 400, one that does not fit now waits.
      decode_steps: decode steps per compiled decode call (continuous batching admits and retires
        sequences between calls); ``None``: chosen by model size (see ``Engine``).
      prefill_chunk / max_prefill_tokens: chunked prefill: prompt tokens per sequence / per call.
      enable_prefix_cache: reuse the KV of cached prompt prefixes (radix tree over blocks).
      window_factor: ratio of successive KV window buckets (see ``Engine``; ``None``: by model size).
      shared_prefix_attention: decode rows' common cached prefix gathered once per batch (see
        ``Engine``; ``None``: by model size).
      tool_call_parser: how tool calls are read out of chat answers to requests with ``tools``
        (``rollout.tool_calls``: ``hermes`` for Qwen2.5/3 and Hermes templates, ``llama3_json``).
      warmup: compile, from start and in the background, the decode and prefill programs requests
        of up to ``warmup_max_len`` positions (prompt + output; ``None``: the server's longest) can
        meet (``jaxprm.serve.warmup``), so that compiles leave the requests' latency.
    """

    model_name: str = "jaxprm"
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 64
    max_rows_per_request: int = 256
    max_request_tokens: int | None = 32768
    default_max_tokens: int | None = None
    logprobs_mode: str = "processed"
    request_timeout_s: float = 600.0
    collect_window_s: float = 0.005
    max_collect_s: float = 0.05
    max_batch: int | None = None
    max_stop_strings: int = 16
    weights_roots: tuple[str, ...] = ()
    block_size: int = 16
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    kv_cache_tokens: int | None = None
    decode_steps: int | None = None
    prefill_chunk: int = 256
    max_prefill_tokens: int = 1024
    enable_prefix_cache: bool = True
    window_factor: float | None = None
    shared_prefix_attention: bool | None = None
    tool_call_parser: str = "hermes"
    warmup: bool = False
    warmup_max_len: int | None = None

    def __post_init__(self):
        owner = type(self)
        require(self.tool_call_parser in TOOL_CALL_PARSERS, "tool_call_parser",
                f"must be one of {sorted(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}", owner)
        require(self.logprobs_mode in ("raw", "processed"), "logprobs_mode",
                f"must be 'raw' or 'processed', got {self.logprobs_mode!r}", owner)
        require(self.api_key is None or bool(self.api_key.strip()), "api_key",
                "must not be empty (None serves without a key)", owner)
        object.__setattr__(self, "weights_roots", resolve_roots(self.weights_roots))
        for key in ("block_size", "decode_steps", "prefill_chunk", "max_prefill_tokens", "kv_cache_bytes",
                    "max_request_tokens", "max_batch", "warmup_max_len"):
            value = getattr(self, key)
            require(value is None or int(value) >= 1, key, f"must be >= 1, got {value}", owner)
        require(self.max_prefill_tokens >= self.prefill_chunk, "max_prefill_tokens",
                f"must be >= prefill_chunk ({self.prefill_chunk}), got {self.max_prefill_tokens}", owner)
        require(self.kv_cache_tokens is None or int(self.kv_cache_tokens) >= self.block_size, "kv_cache_tokens",
                f"must be >= block_size ({self.block_size}), got {self.kv_cache_tokens}", owner)
        require(self.window_factor is None or (not isinstance(self.window_factor, bool)
                                               and self.window_factor >= MIN_WINDOW_FACTOR),
                "window_factor", f"must be a number >= {MIN_WINDOW_FACTOR}, got {self.window_factor!r}", owner)
        for key in ("collect_window_s", "max_collect_s", "request_timeout_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, key, f"must be >= 0, got {value!r}", owner)

    def engine_kwargs(self) -> dict[str, Any]:
        """The ``Engine`` options of this config."""
        return dict(max_batch=self.max_batch, block_size=self.block_size, kv_cache_bytes=self.kv_cache_bytes,
                    kv_cache_tokens=self.kv_cache_tokens, decode_steps=self.decode_steps,
                    prefill_chunk=self.prefill_chunk, max_prefill_tokens=self.max_prefill_tokens,
                    enable_prefix_cache=self.enable_prefix_cache, collect_window_s=self.collect_window_s,
                    max_collect_s=self.max_collect_s, window_factor=self.window_factor,
                    shared_prefix_attention=self.shared_prefix_attention)


class Serving:
    """Everything a request handler needs, shared by the dialects: sampler, tokenizer, engine,
    metrics, config, a token-text cache, request validation, generation (whole or streamed) and
    stop-string cuts."""

    def __init__(self, sampler: Sampler, tokenizer, config: ServeConfig, load_fn: Callable | None):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.config = config
        self.load_fn = load_fn
        self.metrics = EngineMetrics(config.model_name)
        self.engine = Engine(sampler, metrics=self.metrics, **config.engine_kwargs())
        self.created = int(time.time())
        self.swap_lock = asyncio.Lock()
        self._token_text: dict[int, str] = {}
        self.tool_parser = get_parser(config.tool_call_parser)
        self.responses = ResponseStore()  # previous_response_id -> conversation (the last 10,000)
        self.warmup = None  # the BackgroundWarmup while ``config.warmup`` (started with the app)
        self._renders_tools: bool | None = None

    def check_renders_tools(self) -> None:
        """A 400 naming the model unless its chat template shows ``tools`` (probed once)."""
        if self._renders_tools is None:
            def render(messages, tools):
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                          tools=tools)
            self._renders_tools = template_renders_tools(render)
        if not self._renders_tools:
            raise APIError(f"tools: the chat template of model {self.config.model_name!r} does not render tools "
                           "(it ignores the 'tools' variable); serve a model whose template supports them, "
                           "e.g. Qwen2.5/3 or Llama 3.1+", param="tools")

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

    def encode_many(self, texts: Sequence[str], *, add_special_tokens: bool, param: str = "prompt") -> list[list[int]]:
        """Token ids of each text; a text too long for the context is a 400 (``check_prompt_length``)
        before its ids are turned into Python ints. With a Hugging Face ``tokenizers`` backend
        (``jaxprm.models.Tokenizer.backend``) the batch call releases the GIL while it works."""
        backend = getattr(self.tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "encode_batch"):
            out = [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]
            for ids in out:
                self.check_prompt_length(len(ids), param=param)
            return out
        encodings = backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        for enc in encodings:
            self.check_prompt_length(len(enc), param=param)
        return [list(enc.ids) for enc in encodings]

    async def encode_async(self, texts: Sequence[str], *, add_special_tokens: bool, param: str = "prompt"
                           ) -> list[list[int]]:
        """``encode_many`` in a worker thread: a long prompt (megabytes of text) is tokenized off the
        event loop, so other requests (``/health``) are answered meanwhile."""
        return await asyncio.to_thread(self.encode_many, texts, add_special_tokens=add_special_tokens, param=param)

    # validation --------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            shown = name if len(name) <= 200 else name[:200] + "..."
            raise APIError(f"The model `{shown}` does not exist. Served: `{self.config.model_name}`.",
                           status=404, param="model", type="NotFoundError")

    def check_prompt_length(self, n: int, *, param: str) -> None:
        """A 400 when a prompt of ``n`` tokens leaves no room to generate."""
        ctx = self.sampler.max_context
        if n >= ctx:
            raise APIError(f"This model's maximum context length is {ctx} tokens; the prompt has {n} "
                           f"tokens, which leaves no room to generate.", param=param)

    def check_prompt_ids(self, ids: Sequence[int], *, param: str) -> None:
        if len(ids) == 0:
            raise APIError("prompt is empty", param=param)
        self.check_prompt_length(len(ids), param=param)  # before the vocabulary scan: a huge prompt is refused at once
        V = self.sampler.vocab_size
        bad = [t for t in ids if not (0 <= int(t) < V)]
        if bad:
            raise APIError(f"token ids out of vocabulary [0, {V}): {bad[:8]}", param=param)

    def resolve_max_tokens(self, requested: int | None, prompt_lens: Sequence[int], *, param: str,
                           copies: int = 1) -> int:
        """The output cap of every row: ``requested``, or when ``None`` the most that fits (context,
        ``default_max_tokens``, ``max_request_tokens``); a 400 when it does not fit. The request's
        rows are ``copies`` (``n``) of each prompt of ``prompt_lens``."""
        ctx = self.sampler.max_context
        room = ctx - max(prompt_lens)
        cap = min(room, self.sampler.new_token_buckets[-1])
        rows = copies * len(prompt_lens)
        limit = self.config.max_request_tokens
        if requested is None:
            value = cap if self.config.default_max_tokens is None else min(cap, self.config.default_max_tokens)
            if limit is not None:
                value = min(value, (limit - copies * sum(prompt_lens)) // rows)
            requested = max(1, value)
        elif requested < 1:
            raise APIError(f"{param} must be at least 1, got {requested}", param=param)
        elif requested > cap:
            raise APIError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{requested} output tokens and your prompt contains {max(prompt_lens)} tokens, "
                f"for a total of {requested + max(prompt_lens)} tokens (at most {cap} output tokens "
                f"fit). Please reduce the length of the prompt or {param}.",
                param=param,
            )
        work = copies * sum(prompt_lens) + rows * requested
        if limit is not None and work > limit:
            raise APIError(
                f"This request asks for {work} tokens of work ({rows} rows x (prompt tokens + {param}={requested})), "
                f"more than this server's per-request limit of {limit} (max_request_tokens); send fewer rows "
                f"(n, prompts) or fewer tokens, in several requests if need be.", param=param)
        return int(requested)

    def check_stop_token_ids(self, ids: Sequence[int] | None, *, param: str = "stop_token_ids") -> tuple[int, ...]:
        ids = tuple(int(t) for t in (ids or ()))
        if len(set(ids)) > MAX_STOP_TOKEN_IDS:  # (with the EOS ids the engine checks the total again)
            raise APIError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(set(ids))}", param=param)
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
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(req, name, None)
            if value is not None and value != neutral:
                raise APIError(f"{name} is not supported (only the neutral value {neutral})", param=name)

    def logprobs_mode(self, req) -> str:
        return getattr(req, "logprobs_mode", None) or self.config.logprobs_mode

    # generation --------------------------------------------------------------------------
    def submit(self, prompts, params, choices, *, on_delta=None) -> EngineFuture:
        """Queue rows in the engine; bad rows (limits, KV pool size) give a 400 here, before
        anything runs or streams."""
        if not self.engine.running:
            raise APIError("generation engine is not running", status=503)
        try:
            return self.engine.submit(prompts, params, choices, on_delta=on_delta)
        except ValueError as exc:
            raise APIError(str(exc)) from exc
        except RuntimeError as exc:
            raise APIError(str(exc), status=503) from exc

    async def run(self, prompts, params, choices, *, request: Request | None = None) -> list[Completion]:
        """Generate and wait; the request is cancelled in the engine (its KV blocks freed) when the
        client disconnects (``request`` given), on timeout (504) or when the handler is cancelled."""
        fut = self.submit(prompts, params, choices)
        result = awaitable(fut)
        watch = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            done, _ = await asyncio.wait({result} | ({watch} if watch else set()),
                                         timeout=self.config.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if result in done:
                return result.result()
            fut.cancel()
            if watch is not None and watch in done:
                raise APIError("client disconnected", status=499)
            raise APIError(f"generation timed out after {self.config.request_timeout_s} s", status=504)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        finally:
            if watch is not None:
                watch.cancel()

    def stream(self, prompts, params, choices) -> AsyncIterator[RowDelta]:
        """Submit now (errors are raised here) and return an async iterator over row deltas; it
        ends when every row finished. Closing it early (client gone) cancels the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def on_delta(delta: RowDelta) -> None:
            post(loop, q.put_nowait, delta)

        fut = self.submit(prompts, params, choices, on_delta=on_delta)
        fut.add_done_callback(lambda f: post(loop, q.put_nowait, None))
        timeout = self.config.request_timeout_s

        async def deltas():
            left = len(prompts)
            try:
                while left:
                    item = await asyncio.wait_for(q.get(), timeout)
                    if item is None:
                        if fut.cancelled() or fut.exception() is not None:
                            raise RuntimeError(f"generation failed: {fut.exception()!r}")
                        continue
                    if item.completion is not None:
                        left -= 1
                    yield item
            finally:
                if not fut.done():
                    fut.cancel()

        return deltas()

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


async def _disconnected(request: Request) -> None:
    """Return when the client of ``request`` disconnects (its body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


#: Largest ``top_k`` passed on: any ``top_k`` at or above the vocabulary size keeps every token, so
#: larger values (which do not fit the sampler's int32 arrays) mean the same and are clamped.
MAX_TOP_K = 2**31 - 1
#: Temperatures below this are greedy (as in vLLM): ``logits / T`` overflows float32 long before
#: ``T`` reaches 0, and the limit of the sampling distribution is the argmax anyway.
GREEDY_BELOW = 1e-5


def sampling_params(*, max_tokens: int, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, top_logprobs) -> SamplingParams:
    """The engine's ``SamplingParams`` of a request's fields (``None``: the neutral value; ``top_k``
    below 1 disables it, above :data:`MAX_TOP_K` is clamped; a temperature below
    :data:`GREEDY_BELOW` is greedy)."""
    temperature = 1.0 if temperature is None else float(temperature)
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if top_p is None else float(top_p),
        top_k=0 if top_k is None or top_k < 0 else min(int(top_k), MAX_TOP_K),
        seed=seed,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=bool(ignore_eos),
        top_logprobs=int(top_logprobs),
    )


def _finish_reason(c: Completion, matched: str | None, n_keep: int, eos_ids: Sequence[int]) -> tuple[str, Any]:
    if matched is not None:
        return "stop", matched
    if c.finish_reason == "stop" and n_keep == len(c.token_ids):
        sid = c.stop_token_id
        return "stop", (None if sid in eos_ids else sid)
    return c.finish_reason, None



@dataclasses.dataclass
class Choice:
    """One generated choice after stop strings, in dialect-neutral form.

    ``token_ids`` are the kept output tokens; ``logprobs`` their log-probs in the requested mode and
    ``top_logprobs`` per kept token ``[(token_id, logprob), ...]`` (``None`` when not requested);
    ``finish_reason`` is ``"stop"`` or ``"length"`` and ``stop_reason`` the matched stop string or
    stop token id (``None`` for EOS among ``eos_ids``).
    """

    index: int
    completion: Completion
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: Any
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


def build_choices(srv: Serving, results: Sequence[Completion], stops: Sequence[str], mode: str, *,
                  eos_ids: Sequence[int] | None = None) -> list[Choice]:
    """Apply stop strings and pick log-probs for every completion; ``eos_ids`` default to the
    sampler's (their stop reason is reported as ``None``)."""
    eos = srv.sampler.eos_token_ids if eos_ids is None else tuple(eos_ids)
    out = []
    for idx, c in enumerate(results):
        n_keep, text, matched = srv.cut_at_stop_strings(c, stops)
        reason, stop_reason = _finish_reason(c, matched, n_keep, eos)
        lps, tops = select_logprobs(c.logprobs, c.sampling_logprobs, c.top_logprobs, mode, n_keep)
        out.append(Choice(index=idx, completion=c, token_ids=c.token_ids[:n_keep], text=text, finish_reason=reason,
                          stop_reason=stop_reason, logprobs=lps, top_logprobs=tops))
    return out
