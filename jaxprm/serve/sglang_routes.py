"""The SGLang dialect: ``/generate`` and the RL control routes.

* ``/generate``: ``text`` or ``input_ids`` (one or a batch), ``sampling_params``, ``return_logprob``
  -> ``meta_info.output_token_logprobs`` as ``[logprob, token_id, text_or_null]``; the weight
  version in ``meta_info.weight_version`` (of the oldest token), per token in
  ``meta_info.output_token_versions``; prompt tokens served from the prefix cache in
  ``meta_info.cached_tokens``. ``stream=true``: server-sent events, each with the output so far
  (``index``, ``text``, ``output_ids``, ``meta_info``), then ``data: [DONE]``.
* ``/update_weights_from_disk``: load a saved checkpoint (``{"model_path": ...}``) from under the
  server's weights roots and swap it in (the guards are in ``jaxprm.serve.weights``); it applies
  between engine steps, running requests continue with the new weights.
* ``/pause_generation`` (``{"mode": "abort" | "in_place"}``), ``/continue_generation``,
  ``/flush_cache``: RL control (pause rollouts around a weight update, drop the prefix cache).
* ``/get_weight_version``, ``/get_model_info``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxprm.serve.errors import APIError, ErrorBody
from jaxprm.serve.openapi import errors
from jaxprm.serve.protocol import GenerateRequest, PauseGenerationRequest, UpdateWeightsFromDiskRequest
from jaxprm.serve.responses import (EVENT_STREAM, ContinueResult, FlushResult, GenerateOutput, ModelInfo, PauseResult,
                                    UpdateWeightsFailure, UpdateWeightsResult, WeightVersion)
from jaxprm.serve.sampling import MAX_TOP_LOGPROBS
from jaxprm.serve.serving import Serving, build_choices, sampling_params
from jaxprm.serve.threads import awaitable
from jaxprm.serve.weights import LOAD_FAILED, check_version_order, parse_version, weights_path
from jaxprm.serve.streaming import SSE_DONE, SSE_HEADERS, pieces, sse

__all__ = ["sglang_router"]

log = logging.getLogger(__name__)


def _finish(reason: str, stop_reason: Any, n: int) -> dict[str, Any]:
    if reason == "stop":
        return {"type": "stop", "matched": stop_reason}
    if reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": "length", "length": n}


def _meta(srv: Serving, req: GenerateRequest, rid: str, reason: str | None, stop_reason: Any, prompt_tokens: int,
          ids: list[int], logprobs: list[float], tops, versions: list[int], cached: int, top_n: int,
          latency: float) -> dict[str, Any]:
    """SGLang's ``meta_info`` of one output (``finish_reason`` ``None`` while streaming)."""
    meta: dict[str, Any] = {
        "id": rid, "finish_reason": None if reason is None else _finish(reason, stop_reason, len(ids)),
        "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "cached_tokens": cached,
        "weight_version": min(versions) if versions else srv.sampler.weight_version,
        "output_token_versions": versions, "e2e_latency": latency,
    }
    if req.return_logprob:
        txt = srv.token_text if req.return_text_in_logprobs else (lambda t: None)
        meta["output_token_logprobs"] = [[logprobs[j], t, txt(t)] for j, t in enumerate(ids)]
        meta["input_token_logprobs"] = []
        if top_n:
            meta["output_top_logprobs"] = [[[lp, tid, txt(tid)] for tid, lp in tops[j][:top_n]]
                                           for j in range(len(ids))]
    return meta


async def _generate_events(srv: Serving, req: GenerateRequest, deltas, rows, stops, top_n: int, rid_of, t0: float):
    """SSE chunks of a streamed ``/generate``: per output ``index``, the text, ids and meta so far
    (SGLang's cumulative form), then ``data: [DONE]``."""
    ids = [[] for _ in rows]
    lps = [[] for _ in rows]
    tops = [[] for _ in rows]
    versions = [[] for _ in rows]
    text = [""] * len(rows)
    async for p in pieces(deltas, len(rows), srv.decode, stops, srv.logprobs_mode(req), ()):
        i = p.row
        ids[i] += p.token_ids
        lps[i] += p.logprobs
        tops[i] += p.top_logprobs or [[] for _ in p.token_ids]
        versions[i] += p.versions
        text[i] += p.text
        meta = _meta(srv, req, rid_of(i), p.finish_reason, p.stop_reason, len(rows[i]), ids[i], lps[i], tops[i],
                     versions[i], p.cached_tokens, top_n, time.perf_counter() - t0)
        yield sse({"index": i, "text": text[i], "output_ids": ids[i], "meta_info": meta})
    yield SSE_DONE


@dataclasses.dataclass
class _Rows:
    """A parsed ``/generate`` request: one row per (prompt, choice), the rows' sampling options, each
    row's choice index, the stop strings, the top logprobs asked for, whether the input was a batch,
    and the request ids given (a list per prompt, one id, or none)."""

    rows: list[list[int]]
    params: list[Any]
    choices: list[int]
    stops: list[str]
    top_n: int
    batched: bool
    n: int
    rid: Any

    def rid_of(self, i: int) -> str:
        """The request id of row ``i``: its prompt's, the request's, or a fresh one."""
        row = i // self.n
        if isinstance(self.rid, list):
            return self.rid[row] if row < len(self.rid) else uuid.uuid4().hex
        return self.rid if isinstance(self.rid, str) else uuid.uuid4().hex


async def _parse_generate(srv: Serving, req: GenerateRequest) -> _Rows:
    """Validate a ``/generate`` request and tokenize its text(s)."""
    spp = req.sampling_params
    srv.check_unsupported(spp)
    if (req.text is None) == (req.input_ids is None):
        raise APIError("exactly one of 'text' or 'input_ids' must be given", param="text")
    if req.top_logprobs_num > MAX_TOP_LOGPROBS:
        raise APIError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if batched else [req.text]
        ids_list = None
    else:
        batched = len(req.input_ids) > 0 and isinstance(req.input_ids[0], list)
        texts, ids_list = None, [list(x) for x in req.input_ids] if batched else [list(req.input_ids)]
    num_prompts = len(texts) if texts is not None else len(ids_list)
    if batched and not num_prompts:
        raise APIError("empty batch", param="input_ids" if req.input_ids is not None else "text")
    srv.check_n(spp.n, num_prompts)
    if ids_list is None:
        ids_list = await srv.encode_async(texts, add_special_tokens=True, param="text")
    for ids in ids_list:
        srv.check_prompt_ids(ids, param="input_ids" if req.input_ids is not None else "text")
    max_new = srv.resolve_max_tokens(spp.max_new_tokens, [len(x) for x in ids_list],
                                     param="sampling_params.max_new_tokens", copies=spp.n)
    stops = srv.check_stop_strings(spp.stop)
    seed = spp.sampling_seed if spp.sampling_seed is not None else spp.seed
    top_n = req.top_logprobs_num if req.return_logprob else 0
    sp = sampling_params(max_tokens=max_new, temperature=spp.temperature, top_p=spp.top_p, top_k=spp.top_k,
                         seed=seed, stop_token_ids=srv.check_stop_token_ids(spp.stop_token_ids,
                                                                            param="sampling_params.stop_token_ids"),
                         ignore_eos=spp.ignore_eos, top_logprobs=top_n)
    rows = [ids for ids in ids_list for _ in range(spp.n)]
    return _Rows(rows=rows, params=[sp] * len(rows), choices=[j for _ in ids_list for j in range(spp.n)], stops=stops,
                 top_n=top_n, batched=batched, n=spp.n, rid=req.rid)


def _generate_body(srv: Serving, req: GenerateRequest, job: _Rows, results, *, latency: float):
    """The ``/generate`` answer from the rows' results: one output, or a list (a batch or ``n > 1``)."""
    outs = []
    for ch in build_choices(srv, results, job.stops, srv.logprobs_mode(req), eos_ids=()):
        c, ids = ch.completion, ch.token_ids
        meta = _meta(srv, req, job.rid_of(ch.index), ch.finish_reason, ch.stop_reason, len(c.prompt_ids), ids,
                     ch.logprobs, ch.top_logprobs, c.output_token_versions[: len(ids)], c.cached_tokens, job.top_n,
                     latency)
        outs.append({"text": ch.text, "output_ids": ids, "meta_info": meta})
    return outs if (job.batched or job.n > 1) else outs[0]


def _engine_call(fn, *args):
    try:
        return fn(*args)
    except (RuntimeError, ValueError) as exc:
        raise APIError(str(exc), status=503 if isinstance(exc, RuntimeError) else 400) from exc


def sglang_router(srv: Serving) -> APIRouter:
    """The SGLang-dialect routes over ``srv``: a generation parses, serves (whole or streamed) and answers."""
    router = APIRouter()
    config = srv.config

    @router.get("/get_weight_version", response_model=WeightVersion, responses=errors(500))
    async def get_weight_version():
        return {"weight_version": srv.sampler.weight_version}

    @router.get("/get_model_info", response_model=ModelInfo, responses=errors(500))
    async def get_model_info():
        return {"model_path": config.model_name, "is_generation": True, "max_context": srv.sampler.max_context,
                "vocab_size": srv.sampler.vocab_size, "weight_version": srv.sampler.weight_version}

    @router.post("/generate", response_model=GenerateOutput | list[GenerateOutput], response_model_exclude_unset=True,
                 responses={200: {"content": EVENT_STREAM, "description": "one output, or a list (a batch or n > 1; "
                                  "stream: events)"}, **errors(400, 413, 500, 503, 504)})
    async def generate(req: GenerateRequest, raw: Request):
        job = await _parse_generate(srv, req)
        t0 = time.perf_counter()
        if req.stream:
            deltas = srv.stream(job.rows, job.params, job.choices)
            events = _generate_events(srv, req, deltas, job.rows, job.stops, job.top_n, job.rid_of, t0)
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        results = await srv.run(job.rows, job.params, job.choices, request=raw)
        return _generate_body(srv, req, job, results, latency=time.perf_counter() - t0)

    control_errors = errors(400, 413, 500, 503)

    @router.post("/pause_generation", response_model=PauseResult, responses=control_errors)
    async def pause_generation(req: PauseGenerationRequest | None = None):
        req = req or PauseGenerationRequest()
        n = await awaitable(_engine_call(srv.engine.pause, req.mode))
        return {"success": True, "mode": req.mode, "num_aborted_requests": n}

    @router.post("/continue_generation", response_model=ContinueResult, responses=control_errors)
    async def continue_generation():
        await awaitable(_engine_call(srv.engine.resume))
        return {"success": True}

    @router.api_route("/flush_cache", methods=["GET", "POST"], response_model=FlushResult, responses=control_errors)
    async def flush_cache():
        n = await awaitable(_engine_call(srv.engine.flush_cache))
        return {"success": True, "num_flushed_blocks": n}

    @router.post("/update_weights_from_disk", response_model=UpdateWeightsResult,
                 responses=errors(400, 403, 409, 413, 500, s400=ErrorBody | UpdateWeightsFailure))
    async def update_weights_from_disk(req: UpdateWeightsFromDiskRequest):
        version = parse_version(req.weight_version)  # the guards: jaxprm.serve.weights
        path = weights_path(req.model_path, config.weights_roots)
        load = srv.load_fn
        if load is None:
            from jaxprm.models import load_model as load
        async with srv.swap_lock:
            check_version_order(version, srv.sampler.weight_version)
            try:
                model, _ = await asyncio.to_thread(load, str(path))
                new_version = await asyncio.to_thread(srv.sampler.update_params, model, version=version)
            except Exception as exc:  # the old weights stay; the cause is logged, not returned (no path probing)
                log.warning("update_weights_from_disk %s failed: %s: %s", path, type(exc).__name__, exc)
                return JSONResponse({"success": False, "message": LOAD_FAILED,
                                     "weight_version": srv.sampler.weight_version}, status_code=400)
        return {"success": True, "message": "weights loaded", "weight_version": new_version,
                "num_paused_requests": 0}

    return router
