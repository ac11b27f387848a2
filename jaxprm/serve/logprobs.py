"""Which log-probabilities a response reports: the requested mode's values, always finite.

``"raw"`` is the model's log-softmax at temperature 1, ``"processed"`` the log-prob under the
distribution the token was sampled from (``jaxprm.serve.sampler``). Under top-k / top-p a top-n
alternative outside the kept set has processed log-prob ``-inf``, which JSON cannot carry; like
vLLM, every reported log-prob is floored at :data:`LOGPROB_FLOOR` (``-9999.0``). Values are kept
in ``[LOGPROB_FLOOR, 0]``: a NaN or a positive value (numerical breakdown, e.g. logits that
overflow) is reported as the floor or 0, never as a non-number.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["LOGPROB_FLOOR", "finite_logprob", "select_logprobs"]

LOGPROB_FLOOR = -9999.0


def finite_logprob(x: float) -> float:
    """``min(max(x, LOGPROB_FLOOR), 0)`` as a float; NaN gives the floor."""
    x = float(x)
    if not x >= LOGPROB_FLOOR:  # NaN compares False: the floor
        return LOGPROB_FLOOR
    return x if x <= 0.0 else 0.0


def select_logprobs(raw: Sequence[float], processed: Sequence[float],
                    top: Sequence[Sequence[tuple[int, float, float]]] | None, mode: str, n_keep: int
                    ) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """The first ``n_keep`` tokens' log-probs in ``mode`` and their top alternatives.

    Args:
      raw / processed: per-token log-probs ``[n]`` of the two modes.
      top: per token ``[(token_id, raw, processed), ...]`` or ``None`` (not requested).
      mode: ``"raw"`` or ``"processed"``.
    Returns ``(logprobs [n_keep], top [n_keep] of [(token_id, logprob)] or None)``, finite.
    """
    lps = [finite_logprob(x) for x in (raw if mode == "raw" else processed)[:n_keep]]
    if top is None:
        return lps, None
    col = 1 if mode == "raw" else 2
    return lps, [[(int(t[0]), finite_logprob(t[col])) for t in pos] for pos in top[:n_keep]]
