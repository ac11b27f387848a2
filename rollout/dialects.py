"""The two generation dialects on the wire (layer 4): what a turn's request body is and how an
answer parses, for vLLM's ``/v1/completions`` and SGLang's ``/generate`` (see ``rollout.client``
for the transport). Also the per-request sampling options and the errors a bad answer raises."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DIALECTS",
    "MAX_TOP_LOGPROBS",
    "GenerationError",
    "TextOnlyResponseError",
    "SamplingParams",
    "request_body",
    "parse_vllm",
    "parse_sglang",
    "top_entropies",
]

DIALECTS = ("vllm", "sglang")
MAX_TOP_LOGPROBS = 20
_FINISH = {"stop": "stop", "eos": "stop", "length": "length", "abort": "abort"}


class GenerationError(RuntimeError):
    """A request failed for good (non-retryable status, bad response, or retries exhausted);
    ``status`` is the last HTTP status, if the server answered. The message names the last failure:
    ``HTTP <status>: <body>``, ``ConnectError: ...`` (the endpoint could not be reached),
    ``ReadTimeout: ...`` (no complete answer within ``timeout_s``) or the transport's error."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TextOnlyResponseError(GenerationError):
    """The server answered without token ids / logprobs but token-backed turns are required."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options (``seed`` makes a deterministic server reproducible).

    ``top_logprobs``: 0 (default) or the number of alternatives per sampled token to ask for (at
    most 20, the limit of vLLM and the embedded server); with it, :attr:`Generated.entropies`."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}; must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}; must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}; must be in (0, 1]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs={self.top_logprobs}; must be in [0, {MAX_TOP_LOGPROBS}]")


def request_body(dialect: str, model: str | None, prompt: Sequence[int], p: SamplingParams) -> tuple[str, dict[str, Any]]:
    """``(path, JSON body)`` of one turn's request in ``dialect`` (``model``: vLLM's ``model`` field,
    omitted when ``None``)."""
    ids = prompt if type(prompt) is list else [int(t) for t in prompt]
    options: dict[str, Any] = {}  # the sampling options both dialects name alike (the seed's key differs)
    if p.top_k > 0:
        options["top_k"] = p.top_k
    if p.stop_token_ids:
        options["stop_token_ids"] = list(p.stop_token_ids)
    seed = {} if p.seed is None else {"seed" if dialect == "vllm" else "sampling_seed": int(p.seed)}
    if dialect == "vllm":
        body: dict[str, Any] = {
            "prompt": ids, "max_tokens": p.max_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "n": 1, "stream": False,
            "logprobs": p.top_logprobs or 1, "return_token_ids": True, "return_tokens_as_token_ids": True,
            **options, **seed,
        }
        if model is not None:
            body["model"] = model
        return "/v1/completions", body
    sp = {"max_new_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p, **options, **seed}
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "stream": False}
    if p.top_logprobs > 0:
        body["top_logprobs_num"] = p.top_logprobs
    return "/generate", body


# ---------------------------------------------------------------------- response parsing


def top_entropies(tops: Sequence[Sequence[float | None] | None]) -> list[float]:
    """Per token, the entropy (nats) of its listed alternatives' log-probs ``l`` renormalised:
    ``p = exp(l) / sum(exp(l))``, ``H = -sum(p log p)`` (float64, stable for ``-inf`` entries).
    A token with no finite alternative (``None``, empty) gets ``nan``."""
    width = max((len(t) for t in tops if t), default=0)
    if width == 0:
        return [float("nan")] * len(tops)
    mat = np.full((len(tops), width), -np.inf)
    for i, row in enumerate(tops):
        if row:
            mat[i, : len(row)] = [-np.inf if v is None else float(v) for v in row]
    peak = mat.max(axis=1)
    ok = np.isfinite(peak)
    h = np.full(len(tops), np.nan)
    if ok.any():
        shifted = mat[ok] - peak[ok, None]  # -inf entries stay -inf and weigh 0
        w = np.exp(shifted)
        z = w.sum(axis=1, keepdims=True)
        logp = np.where(w > 0, shifted - np.log(z), 0.0)
        h[ok] = 0.0 - (w / z * logp).sum(axis=1)  # (0.0 - turns -0.0 into 0.0)
    return h.tolist()


def _vllm_tops(lp: dict[str, Any]) -> list[list[float | None] | None] | None:
    """The alternatives' log-probs per token from ``logprobs.top_logprobs`` (dicts token -> logprob)."""
    tops = lp.get("top_logprobs")
    if tops is None:
        return None
    return [list(d.values()) if isinstance(d, dict) else None for d in tops]


def _sglang_tops(meta: dict[str, Any]) -> list[list[float | None] | None] | None:
    """The alternatives' log-probs per token from ``meta_info.output_top_logprobs`` (``[logprob, id, text]``)."""
    tops = meta.get("output_top_logprobs")
    if tops is None:
        return None
    return [[t[0] for t in row if t] if row else None for row in tops]


def _finish_reason(raw: Any) -> str:
    if isinstance(raw, dict):
        raw = raw.get("type")
    if raw is None:
        raise GenerationError("response has no finish_reason (streaming or unfinished request?)")
    try:
        return _FINISH[str(raw)]
    except KeyError:
        raise GenerationError(f"unknown finish_reason {raw!r}; expected one of {sorted(_FINISH)}") from None


def _text_only(dialect: str) -> TextOnlyResponseError:
    hint = ("ask a vLLM >= 0.10.2 server (return_token_ids) or one that honours return_tokens_as_token_ids"
            if dialect == "vllm" else "use SGLang's native /generate with return_logprob")
    return TextOnlyResponseError(
        f"the {dialect} server returned text without token ids/logprobs; token-backed interactions are "
        f"required (process rewards and the learner need the sampled tokens): {hint}"
    )


def parse_vllm(data: dict[str, Any], *, require_tokens: bool, top_n: int = 0):
    """``(ids, logprobs, finish, text, weight_version, echoed prompt ids, tops)`` of a completions
    answer; ``tops`` (alternatives' log-probs per token) only when ``top_n > 0`` and present."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise GenerationError(f"vLLM response has no choices: {str(data)[:300]}") from None
    finish = _finish_reason(choice.get("finish_reason"))
    text = choice.get("text")
    lp = choice.get("logprobs") or {}
    token_lps = lp.get("token_logprobs")
    ids = choice.get("token_ids")
    if ids is None and lp.get("tokens"):
        toks = lp["tokens"]
        if all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
            ids = [int(t.split(":", 1)[1]) for t in toks]
    if ids is None or token_lps is None:
        if require_tokens:
            raise _text_only("vllm")
        return [], [], finish, text, None, None, None
    if len(token_lps) != len(ids):
        raise GenerationError(f"vLLM response has {len(ids)} token ids but {len(token_lps)} logprobs")
    if any(v is None for v in token_lps):
        raise GenerationError("vLLM response has a null logprob for a sampled token")
    wv_raw = data.get("weight_version")  # reported by the embedded jaxprm server (and SGLang's OpenAI routes)
    wv = int(wv_raw) if isinstance(wv_raw, (int, str)) and str(wv_raw).isdigit() else None
    return ids, token_lps, finish, text, wv, choice.get("prompt_token_ids"), _vllm_tops(lp) if top_n > 0 else None


def parse_sglang(data: Any, *, require_tokens: bool, top_n: int = 0):
    """As :func:`parse_vllm`, for a ``/generate`` answer (no echoed prompt ids)."""
    if isinstance(data, list):
        data = data[0] if data else {}
    if not isinstance(data, dict) or "meta_info" not in data:
        raise GenerationError(f"SGLang response has no meta_info: {str(data)[:300]}")
    meta = data["meta_info"]
    finish = _finish_reason(meta.get("finish_reason"))
    text = data.get("text")
    triples = meta.get("output_token_logprobs")
    ids = data.get("output_ids")
    wv_raw = meta.get("weight_version")
    wv = int(wv_raw) if isinstance(wv_raw, (int, str)) and str(wv_raw).isdigit() else None
    if triples is None:
        if require_tokens:
            raise _text_only("sglang")
        return [], [], finish, text, wv, None, None
    lps = [float(t[0]) for t in triples]
    tids = [int(t[1]) for t in triples]
    if ids is not None and list(ids) != tids:
        raise GenerationError("SGLang output_ids disagree with the ids in output_token_logprobs")
    return tids, lps, finish, text, wv, None, _sglang_tops(meta) if top_n > 0 else None
