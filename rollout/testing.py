"""A scripted OpenAI-compatible generation server and a tiny real tokenizer, for tests and benchmarks.

The server speaks both dialects the client uses, with the response shapes of the real servers:

* vLLM ``POST /v1/completions`` with ``prompt`` as a list of token ids; ``choices[i]`` carries
  ``text``, ``token_ids`` / ``prompt_token_ids`` (when ``return_token_ids``), ``logprobs`` in the
  OpenAI completions layout (``tokens`` as ``"token_id:N"`` strings when
  ``return_tokens_as_token_ids``; ``top_logprobs`` one ``{token: logprob}`` dict of ``logprobs``
  alternatives per token), ``finish_reason`` and ``stop_reason``.
* SGLang ``POST /generate`` with ``input_ids`` / ``sampling_params`` / ``return_logprob``;
  the response carries ``text``, ``output_ids`` and ``meta_info`` with ``finish_reason``
  (``{"type": ..., "matched": ...}``), ``output_token_logprobs`` (``[logprob, id, None]``) and,
  with ``top_logprobs_num: n``, ``output_top_logprobs`` (per token, ``n`` such triples).
* OpenAI ``POST /v1/chat/completions`` (messages rendered with the chat template), so that an agent
  can call the server directly (the proxy benchmark's baseline).

What is generated is decided by a *policy* (a plain function of the prompt ids and the request's
seed), so a run against it is deterministic; so are the alternatives' log-probs (a hash of the
prompt, or :attr:`ServerScript.top_logprobs`, which lets a test set each token's entropy). Faults are scripted on :class:`ServerScript`:
text-only answers, a delay, and a queue of error statuses (500, 429 ...) served before real answers.
The server runs in a background thread (:class:`ScriptedServer`) or as a subprocess
(``python -m rollout.testing --port P``) so that its work does not share the client's GIL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxprm.inprocess import ThreadedServer
from rollout.chat import CHATML_TEMPLATE, TOOLS_TEMPLATE, JinjaChatTokenizer

__all__ = [
    "make_test_tokenizer",
    "ServerScript",
    "ScriptedServer",
    "fixed_text_policy",
    "make_tools_test_tokenizer",
    "tool_call_text",
    "turn_script_policy",
    "hashed_action_policy",
    "frozenlake_policy",
    "build_app",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "system user assistant You are an agent on a frozen lake. Reply with one action in a fenced block.",
    "```Left``` ```Right``` ```Up``` ```Down``` ```left``` ```right``` ```up``` ```down```",
    "P _ O G P_O_G _ _ _ _ O O G P\n_ _ _\nMove to the goal G without falling into a hole O.",
    "Invalid action. You moved. You fell into a hole. You reached the goal. Turn 1 2 3 4 5 6 7 8 9 10",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?()[]{}<>'\"-_=+*/\\|@#$%^&~`",
]


def make_test_tokenizer(vocab_size: int = 400, template: str = CHATML_TEMPLATE) -> JinjaChatTokenizer:
    """A small byte-level BPE (``tokenizers``) trained in-process, with a ChatML jinja template
    (``template``: e.g. ``rollout.chat.TOOLS_TEMPLATE`` for function tools).

    Byte-level, so every string encodes and decodes losslessly; ``<|im_start|>``, ``<|im_end|>``
    and ``<|endoftext|>`` are single special ids; ``eos_token_id`` is ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return JinjaChatTokenizer(tok, template, eos_token="<|im_end|>")


# ----------------------------------------------------------------------------------- policies

Policy = Callable[[list[int], dict[str, Any]], tuple[list[int], str]]
"""``policy(prompt_ids, request) -> (output_ids, finish_reason)``; ``request`` has ``seed``,
``max_tokens`` and ``temperature``. Logprobs are derived by the server from a hash."""

TopLogprobs = Callable[[list[int], list[int], int], list[list[float]]]
"""``top_logprobs(prompt_ids, output_ids, n) -> per output token, the log-probs of its n listed
alternatives`` (the server labels them with distinct token ids, the sampled one first)."""


def _h(*parts: Any) -> int:
    m = hashlib.blake2b(digest_size=8)
    for p in parts:
        m.update(repr(p).encode())
        m.update(b"|")
    return int.from_bytes(m.digest(), "little")


def _finish(ids: list[int], eos: int, max_tokens: int) -> tuple[list[int], str]:
    ids = ids + [eos]
    if len(ids) > max_tokens:
        return ids[:max_tokens], "length"
    return ids, "stop"


def fixed_text_policy(tokenizer: JinjaChatTokenizer, text: str) -> Policy:
    """Always answer ``text`` followed by EOS."""
    ids = tokenizer.encode(text)

    def policy(prompt: list[int], req: dict[str, Any]) -> tuple[list[int], str]:
        return _finish(list(ids), tokenizer.eos_token_id, req["max_tokens"])

    return policy


def turn_script_policy(tokenizer: JinjaChatTokenizer, turns: Sequence[str]) -> Policy:
    """Answer ``turns[t]`` (then EOS) to a prompt with ``t`` earlier assistant turns (the last
    entry once the script runs out): a scripted agent conversation, e.g. tool calls then an answer."""
    encoded = [tokenizer.encode(t) for t in turns]

    def policy(prompt: list[int], req: dict[str, Any]) -> tuple[list[int], str]:
        text = tokenizer.tokenizer.decode(list(prompt), skip_special_tokens=False)
        t = text.count("<|im_start|>assistant") - 1  # the last one is the generation prompt
        return _finish(list(encoded[min(max(t, 0), len(encoded) - 1)]), tokenizer.eos_token_id, req["max_tokens"])

    return policy


ACTIONS = ("Left", "Down", "Right", "Up")


def make_tools_test_tokenizer() -> JinjaChatTokenizer:
    """:func:`make_test_tokenizer` with ``rollout.chat.TOOLS_TEMPLATE`` (Hermes-style function tools)."""
    return make_test_tokenizer(template=TOOLS_TEMPLATE)


def tool_call_text(action: str) -> str:
    """A whole Hermes ``move`` call (``rollout.envs.tool_moves``: its prefill, then its arguments)."""
    from rollout.envs.tool_moves import PREFILL, demo_text

    return PREFILL + demo_text(action)


def hashed_action_policy(tokenizer: JinjaChatTokenizer, *, p_invalid: float = 0.0, prose: bool = False,
                         answer: Callable[[str], str] | None = None) -> Policy:
    """An action chosen by a hash of (prompt, seed): deterministic, seed-dependent. ``answer(action)``
    is the text written for it (default: the fenced move; e.g. :func:`tool_call_text`, or
    ``rollout.envs.tool_moves.demo_text`` after a prefilled call)."""
    enc = {a: tokenizer.encode(answer(a) if answer is not None else f"```{a}```") for a in ACTIONS}
    bad = tokenizer.encode("I am not sure.")
    lead = tokenizer.encode("I will move. ")

    def policy(prompt: list[int], req: dict[str, Any]) -> tuple[list[int], str]:
        h = _h(tuple(prompt[-64:]), len(prompt), req.get("seed"))
        if (h % 1000) / 1000.0 < p_invalid:
            ids = list(bad)
        else:
            ids = (list(lead) if prose else []) + list(enc[ACTIONS[(h >> 12) % 4]])
        return _finish(ids, tokenizer.eos_token_id, req["max_tokens"])

    return policy


_ROW_RE = re.compile(r"^[PO_G](?: [PO_G])+$")


def frozenlake_policy(tokenizer: JinjaChatTokenizer, *, p_good: float = 0.7) -> Policy:
    """A noisy navigator: reads the last grid in the prompt (rows of ``P _ O G`` letters), takes a
    shortest-path step with probability ``p_good`` and a uniformly random action otherwise
    (decided by a hash of the prompt and the seed, so it is deterministic)."""
    from rollout.envs.frozenlake import bfs_distances

    enc = {a: tokenizer.encode(f"```{a}```") for a in ACTIONS}
    moves = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}

    def policy(prompt: list[int], req: dict[str, Any]) -> tuple[list[int], str]:
        h = _h(tuple(prompt[-64:]), len(prompt), req.get("seed"))
        action = ACTIONS[(h >> 12) % 4]
        text = tokenizer.decode(prompt[-400:])
        rows: list[str] = []
        if "Map:\n" in text:
            for line in text.rsplit("Map:\n", 1)[1].split("\n"):
                if not _ROW_RE.match(line):
                    break
                rows.append(line.replace(" ", ""))
        if rows and (h % 1000) / 1000.0 < p_good:
            if any("P" in r for r in rows) and any("G" in r for r in rows):
                desc = ["".join("G" if ch == "G" else ("H" if ch == "O" else "F") for ch in r) for r in rows]
                pos = next((i, r.index("P")) for i, r in enumerate(rows) if "P" in r)
                dist = bfs_distances(desc)
                best = None
                for a, (dr, dc) in moves.items():
                    r, c = pos[0] + dr, pos[1] + dc
                    if 0 <= r < len(rows) and 0 <= c < len(rows[0]) and dist[r][c] >= 0:
                        if best is None or dist[r][c] < best[0]:
                            best = (dist[r][c], a)
                if best is not None:
                    action = best[1]
        return _finish(list(enc[action]), tokenizer.eos_token_id, req["max_tokens"])

    return policy


# ------------------------------------------------------------------------------------ server


@dataclasses.dataclass
class ServerScript:
    """Mutable behaviour of the scripted server (tests flip these between requests).

    Attributes:
      policy: what to generate.
      delay_s: sleep before answering each request.
      fail_statuses: statuses to answer (one per request, in order) before answering normally.
      text_only: answer with text only (no token ids, no logprobs), like a plain OpenAI server.
      weight_version: reported by ``/generate`` in ``meta_info``.
      delay_queue: per-request delays consumed in order (then ``delay_s``).
      vllm_token_ids: honour ``return_token_ids`` (False mimics an older vLLM: ids only through
        ``return_tokens_as_token_ids``).
      max_inflight: the most requests seen in flight at once.
      top_logprobs: the alternatives' log-probs answered when a request asks for them (vLLM
        ``logprobs: n``, SGLang ``top_logprobs_num: n``); ``None``: a hash of prompt and output.
    """

    policy: Policy
    delay_s: float = 0.0
    fail_statuses: list[int] = dataclasses.field(default_factory=list)
    text_only: bool = False
    weight_version: str | None = None
    delay_queue: list[float] = dataclasses.field(default_factory=list)
    vllm_token_ids: bool = True
    top_logprobs: TopLogprobs | None = None
    requests: int = 0
    inflight: int = 0
    max_inflight: int = 0
    prompts: list[list[int]] = dataclasses.field(default_factory=list)
    record_prompts: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def next_fault(self) -> tuple[int | None, float]:
        with self._lock:
            self.requests += 1
            fault = self.fail_statuses.pop(0) if self.fail_statuses else None
            delay = self.delay_queue.pop(0) if self.delay_queue else self.delay_s
            return fault, delay


def _logprobs_for(prompt: Sequence[int], out: Sequence[int]) -> list[float]:
    base = _h(len(prompt), tuple(prompt[-8:]))
    return [-((_h(base, i, t) % 4000) / 1000.0 + 0.001) for i, t in enumerate(out)]


def _hashed_top_logprobs(prompt: Sequence[int], out: Sequence[int], n: int) -> list[list[float]]:
    """Default alternatives: per token, ``n`` descending log-probs derived from a hash."""
    base = _h(len(prompt), tuple(prompt[-8:]), "top")
    return [sorted((-((_h(base, i, t, j) % 6000) / 1000.0 + 0.001) for j in range(n)), reverse=True)
            for i, t in enumerate(out)]


def _alternatives(script: ServerScript, prompt: list[int], out: list[int], n: int,
                  vocab: int) -> list[list[tuple[int, float]]]:
    """Per output token, ``(token id, logprob)`` of its ``n`` alternatives (distinct ids, the sampled first)."""
    fn = script.top_logprobs or _hashed_top_logprobs
    rows = fn(list(prompt), list(out), n)
    if len(rows) != len(out):
        raise ValueError(f"top_logprobs gave {len(rows)} rows for {len(out)} tokens")
    return [[((t + j) % vocab, float(lp)) for j, lp in enumerate(row)] for t, row in zip(out, rows)]


def build_app(script: ServerScript, tokenizer: JinjaChatTokenizer):
    """The Starlette app implementing ``/v1/completions``, ``/generate``, ``/v1/chat/completions``,
    ``/health`` and ``/script`` (set the delay)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    vocab = tokenizer.tokenizer.get_vocab_size()

    async def _common(prompt: Any, req: dict[str, Any]):
        fault, delay = script.next_fault()
        script.inflight += 1
        script.max_inflight = max(script.max_inflight, script.inflight)
        try:
            if delay:
                await asyncio.sleep(delay)
        finally:
            script.inflight -= 1
        if fault is not None:
            return None, JSONResponse({"object": "error", "message": f"scripted {fault}", "code": fault}, status_code=fault)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return None, JSONResponse({"object": "error", "message": "prompt must be token ids", "code": 400}, status_code=400)
        if script.record_prompts:
            with script._lock:
                script.prompts.append(list(prompt))
        out, finish = script.policy(prompt, req)
        return (out, finish, _logprobs_for(prompt, out)), None

    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        req = {"seed": body.get("seed"), "max_tokens": int(body.get("max_tokens") or 16),
               "temperature": body.get("temperature", 1.0)}
        res, err = await _common(prompt, req)
        if err is not None:
            return err
        out, finish, lps = res
        text = tokenizer.decode(out)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                  "stop_reason": None, "prompt_logprobs": None}
        if not script.text_only:
            if body.get("return_token_ids") and script.vllm_token_ids:
                choice["token_ids"] = out
                choice["prompt_token_ids"] = prompt
            if body.get("logprobs") is not None:
                if body.get("return_tokens_as_token_ids"):
                    toks = [f"token_id:{t}" for t in out]
                else:
                    toks = [tokenizer.tokenizer.id_to_token(t) or "" for t in out]
                n = int(body["logprobs"])
                tops = None
                if n > 0:
                    label = ((lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids")
                             else (lambda t: tokenizer.tokenizer.id_to_token(t) or f"<{t}>"))
                    tops = [{label(t): lp for t, lp in row} for row in _alternatives(script, prompt, out, n, vocab)]
                choice["logprobs"] = {"text_offset": list(range(len(out))), "token_logprobs": lps,
                                      "tokens": toks, "top_logprobs": tops}
        return JSONResponse({
            "id": f"cmpl-{script.requests}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model", "scripted"), "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                      "total_tokens": len(prompt) + len(out)},
        })

    async def generate(request: Request):
        body = await request.json()
        sp = body.get("sampling_params") or {}
        req = {"seed": sp.get("sampling_seed"), "max_tokens": int(sp.get("max_new_tokens") or 128),
               "temperature": sp.get("temperature", 1.0)}
        res, err = await _common(body.get("input_ids"), req)
        if err is not None:
            return err
        out, finish, lps = res
        prompt = body["input_ids"]
        text = tokenizer.decode(out)
        fr: dict[str, Any] = {"type": finish}
        if finish == "stop":
            fr["matched"] = out[-1]
        else:
            fr["length"] = len(out)
        if script.text_only:
            return JSONResponse({"text": text, "meta_info": {"id": "x", "finish_reason": fr,
                                                             "prompt_tokens": len(prompt)}})
        meta: dict[str, Any] = {"id": f"req-{script.requests}", "finish_reason": fr, "prompt_tokens": len(prompt),
                                "completion_tokens": len(out), "cached_tokens": 0,
                                "weight_version": script.weight_version or "default"}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out)]
            meta["input_token_logprobs"] = []
            n = int(body.get("top_logprobs_num") or 0)
            if n > 0:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row]
                                               for row in _alternatives(script, prompt, out, n, vocab)]
        return JSONResponse({"text": text, "output_ids": out, "meta_info": meta})

    async def chat(request: Request):
        body = await request.json()
        prompt = tokenizer.encode(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True))
        req = {"seed": body.get("seed"), "max_tokens": int(body.get("max_tokens") or 16),
               "temperature": body.get("temperature", 1.0)}
        res, err = await _common(prompt, req)
        if err is not None:
            return err
        out, finish, _ = res
        return JSONResponse({
            "id": f"chatcmpl-{script.requests}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "scripted"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": tokenizer.decode(out)},
                         "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                      "total_tokens": len(prompt) + len(out)},
        })

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def control(request: Request):
        """``POST /script {"delay_s": x}``: change the answer delay of a running server (benchmarks)."""
        body = await request.json()
        script.delay_s = float(body["delay_s"])
        return JSONResponse({"delay_s": script.delay_s})

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/script", control, methods=["POST"]),
    ])


class ScriptedServer:
    """Run :func:`build_app` with uvicorn on ``127.0.0.1`` (free port) in a daemon thread.

    Use as a context manager; ``url`` is the base URL. ``stop()`` shuts it down. ``port``: serve on
    that port (a server restarted where another died) instead of a free one.
    """

    def __init__(self, script: ServerScript, tokenizer: JinjaChatTokenizer, *, port: int = 0):
        self.script = script
        self.app = build_app(script, tokenizer)
        self._http: ThreadedServer | None = None
        self.port: int | None = port or None
        self.url: str | None = None

    def start(self) -> ScriptedServer:
        self._http = ThreadedServer(self.app, port=self.port or 0, name="scripted", startup_timeout_s=10,
                                    log_level="error",
                                    timeout_keep_alive=30, timeout_graceful_shutdown=0.05)
        self.port, self.url = self._http.port, self._http.url
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.stop(10, force=True)

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m rollout.testing --port P [--policy frozenlake|hashed|tools|judge] [--delay S]``: serve
    until killed (``tools``: hashed ``move`` tool calls with the tools template; ``judge``: an LLM
    judge's ``{"score": x}`` answers, x hashed from the prompt)."""
    import argparse

    import uvicorn

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--policy", choices=["frozenlake", "hashed", "tools", "judge"], default="frozenlake")
    ap.add_argument("--p-good", type=float, default=0.7)
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args(argv)
    tok = make_tools_test_tokenizer() if args.policy == "tools" else make_test_tokenizer()
    if args.policy == "frozenlake":
        pol = frozenlake_policy(tok, p_good=args.p_good)
    elif args.policy == "judge":  # an LLM judge's answer: a score that hashes the prompt
        pol = hashed_action_policy(tok, answer=lambda a: '{"score": %.2f}' % ((ACTIONS.index(a) + 0.5) / 4))
    else:
        pol = hashed_action_policy(tok, answer=tool_call_text if args.policy == "tools" else None)
    script = ServerScript(policy=pol, delay_s=args.delay)
    uvicorn.run(build_app(script, tok), host="127.0.0.1", port=args.port, log_level="error", lifespan="off",
                timeout_keep_alive=75)


if __name__ == "__main__":
    main()
