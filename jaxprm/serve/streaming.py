"""Server-sent events for streamed generation: incremental text with stop strings, SSE framing.

``RowText`` turns one row's growing token list into text pieces that are safe to send: a piece is
never taken back, so text that might still become a stop string (the last ``max(len(stop)) - 1``
characters) or an incomplete UTF-8 character is held until the next tokens decide. When a stop
string appears, the row keeps the shortest token prefix whose text contains it and its text ends
before it (exactly what the non-streamed answer holds, ``Serving.cut_at_stop_strings``); the
concatenated pieces equal the non-streamed text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from jaxprm.serve.logprobs import select_logprobs
from jaxprm.serve.sampling import Completion

__all__ = ["RowText", "Piece", "pieces", "sse", "SSE_DONE", "SSE_HEADERS", "finish_of"]

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> str:
    """One ``data:`` event with ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class RowText:
    """Incremental text of one streamed row (see the module docstring).

    ``push(token_ids)`` returns ``(kept, piece)``: how many of the new tokens belong to the output
    (fewer once a stop string matched) and the new text to send. ``finish()`` returns the text
    still held back when the row ends. ``matched`` is the stop string that ended the row, if any.
    """

    def __init__(self, decode, stops: Sequence[str]):
        self._decode = decode
        self.stops = list(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def push(self, token_ids: Sequence[int]) -> tuple[int, str]:
        if self.done or not token_ids:
            return 0, ""
        start = len(self.tokens)
        self.tokens.extend(int(t) for t in token_ids)
        text = self._decode(self.tokens)
        if self.stops and any(s in text for s in self.stops):
            lo, hi = start + 1, len(self.tokens)  # smallest j whose text holds a stop string
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in self._decode(self.tokens[:mid]) for s in self.stops):
                    hi = mid
                else:
                    lo = mid + 1
            prefix = self._decode(self.tokens[:lo])
            cut, self.matched = min((prefix.find(s), s) for s in self.stops if s in prefix)
            del self.tokens[lo:]
            return lo - start, self._advance(prefix[:cut])
        safe = text[: len(text) - self._hold] if self._hold else text
        while safe.endswith("\ufffd"):
            safe = safe[:-1]
        return len(token_ids), self._advance(safe)

    def finish(self) -> str:
        if self.done:
            return ""
        return self._advance(self._decode(self.tokens), final=True)

    def _advance(self, text: str, final: bool = False) -> str:
        if not text.startswith(self.sent):  # earlier text re-decoded differently (rare): send the rest
            common = 0
            while common < min(len(text), len(self.sent)) and text[common] == self.sent[common]:
                common += 1
            text = self.sent + text[common:] if final else self.sent
        piece = text[len(self.sent):]
        self.sent = text if len(text) > len(self.sent) else self.sent
        return piece


def finish_of(completion: Completion | None, row: RowText, eos_ids: Sequence[int]) -> tuple[str, Any]:
    """``(finish_reason, stop_reason)`` of a streamed row, as ``build_choices`` reports them."""
    if row.matched is not None or completion is None:
        return "stop", row.matched
    if completion.finish_reason == "stop":
        sid = completion.stop_token_id
        return "stop", (None if sid in eos_ids else sid)
    return completion.finish_reason, None


@dataclasses.dataclass
class Piece:
    """What to send for one row after a delta: new text, the kept new tokens with their log-probs
    (requested mode) and versions; ``finish_reason`` / ``stop_reason`` on the row's last piece, with
    ``tokens`` (all kept tokens so far) and the engine's ``completion`` when it had finished."""

    row: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    versions: list[int]
    tokens: list[int]
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    completion: Completion | None = None


async def pieces(deltas: AsyncIterator, num_rows: int, decode, stops: Sequence[str], mode: str,
                 eos_ids: Sequence[int]) -> AsyncIterator[Piece]:
    """Turn the engine's row deltas into pieces to send (stop strings applied per row). Ends when
    every row has finished; a row ended by a stop string ignores its later tokens."""
    rows = [RowText(decode, stops) for _ in range(num_rows)]
    closed = [False] * num_rows
    async for d in deltas:
        if closed[d.row]:
            continue
        st = rows[d.row]
        kept, text = st.push(d.token_ids)
        ended = st.done or d.completion is not None
        if ended and not st.done:
            text += st.finish()
        lps, tops = select_logprobs(d.logprobs, d.sampling_logprobs, d.top_logprobs, mode, kept)
        piece = Piece(d.row, text, list(d.token_ids[:kept]), lps, tops, list(d.versions[:kept]), list(st.tokens),
                      d.cached_tokens)
        if ended:
            closed[d.row] = True
            piece.finish_reason, piece.stop_reason = finish_of(d.completion, st, eos_ids)
            piece.completion = d.completion
        yield piece
        if all(closed):
            break
