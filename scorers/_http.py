"""A small async JSON-over-HTTP helper for scorers: bounded timeout, bounded retries.

Each attempt is bounded as a whole by ``asyncio.timeout`` (connect, send and the full body read).
Retried: transport errors, timeouts, HTTP 429 and 5xx, and responses whose body is not the JSON the
caller's ``parse`` expects (``parse`` raises ``ValueError``/``KeyError``/``TypeError``/``IndexError``).
Not retried: other 4xx. Backoff doubles from ``backoff_s`` up to ``max_backoff_s``.
Cancellation propagates at any point. A circuit breaker per server (``scorers.breaker``) opens
after ``breaker_failures`` consecutive calls failed for good: calls then fail at once
(``ScorerUnavailable``) until a probe every ``breaker_probe_s`` (doubling) finds the server again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import httpx

from scorers.base import BaseScorer
from scorers.breaker import CircuitBreaker

__all__ = ["HTTPOptions", "HTTPJsonClient", "HTTPScorer", "ScorerHTTPError"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ScorerHTTPError(RuntimeError):
    """A scorer's HTTP call failed for good; ``attempts`` lists what happened on each try."""

    def __init__(self, message: str, attempts: list[str], *, refused: bool = False) -> None:
        super().__init__(f"{message}; attempts: {attempts}")
        self.attempts = attempts
        self.refused = refused  # the server answered with a 4xx (it is up)


def _check_pos(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class HTTPOptions:
    """How a scorer talks to its server: the options every HTTP-backed scorer shares.

    Attributes:
      api_key: sent as ``Authorization: Bearer <key>`` when given.
      timeout_s: bound on one whole attempt (> 0).
      max_retries: extra attempts after the first (>= 0).
      backoff_s: first retry delay (>= 0), doubling, capped at ``max_backoff_s``.
      max_concurrency: requests in flight at once from one scorer (> 0).
      breaker_failures: consecutive calls failed for good (after their retries) that open the
        circuit breaker (>= 1); breaker_probe_s: the wait before its first probe (> 0).
    """

    api_key: str | None = None
    timeout_s: float = 30.0
    max_retries: int = 2
    backoff_s: float = 0.5
    max_backoff_s: float = 4.0
    max_concurrency: int = 16
    breaker_failures: int = 5
    breaker_probe_s: float = 5.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_s", _check_pos("timeout_s", self.timeout_s))
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        object.__setattr__(self, "backoff_s", _check_pos("backoff_s", self.backoff_s, allow_zero=True))
        object.__setattr__(self, "max_backoff_s", _check_pos("max_backoff_s", self.max_backoff_s, allow_zero=True))
        mc = self.max_concurrency
        if isinstance(mc, bool) or not isinstance(mc, int) or mc < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {mc!r}")
        CircuitBreaker("check", failures=self.breaker_failures, probe_s=self.breaker_probe_s)  # validates both


class HTTPJsonClient:
    """Lazily created ``httpx.AsyncClient`` (one per event loop) with retrying JSON POSTs to
    ``base_url`` (e.g. ``http://127.0.0.1:8000``), as :class:`HTTPOptions` say."""

    def __init__(self, base_url: str, options: HTTPOptions = HTTPOptions()) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.options = options
        self.timeout_s = options.timeout_s
        self.max_retries = options.max_retries
        self.backoff_s = options.backoff_s
        self.max_backoff_s = options.max_backoff_s
        self.max_concurrency = options.max_concurrency
        self._headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.breaker = CircuitBreaker(self.base_url, failures=options.breaker_failures, probe_s=options.breaker_probe_s)

    def _ensure(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            if self._client is not None:
                logger.warning("scorer HTTP client reused from another event loop: creating a new one")
            self._client = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=self.max_concurrency),
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        assert self._sem is not None
        return self._client, self._sem

    async def post_json(self, path: str, payload: Mapping[str, Any] | Callable[[int], Mapping[str, Any]],
                        parse: Callable[[Any], T]) -> T:
        """POST ``payload`` to ``path`` and return ``parse(response_json)``, retrying as documented.

        ``payload`` may be a function of the attempt number (0 first), e.g. to vary the sampling of a
        retry after a malformed answer from a deterministic server.
        """
        probe = self.breaker.before()  # ScorerUnavailable at once while the server is known down
        answered = False
        try:
            out = await self._post(path, payload, parse)
            answered = True
            self.breaker.success(probe)
            return out
        except ScorerHTTPError as err:
            answered = True
            if err.refused:  # the server answered (a 4xx): it is up
                self.breaker.success(probe)
            else:
                self.breaker.failure(probe)
            raise
        finally:
            if not answered:
                self.breaker.abandon(probe)

    async def _post(self, path: str, payload, parse: Callable[[Any], T]) -> T:
        client, sem = self._ensure()
        attempts: list[str] = []
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            body = payload(attempt) if callable(payload) else payload
            try:
                async with sem, asyncio.timeout(self.timeout_s):
                    resp = await client.post(path, json=body)
            except TimeoutError:
                attempts.append(f"timeout after {self.timeout_s}s")
                continue
            except httpx.TransportError as err:
                attempts.append(f"{type(err).__name__}: {err}")
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                attempts.append(f"HTTP {resp.status_code}: {_reason(resp)}")
                continue
            if resp.status_code >= 400:
                attempts.append(f"HTTP {resp.status_code}: {_reason(resp)}")
                raise ScorerHTTPError(f"POST {self.base_url}{path} was refused (not retried)", attempts, refused=True)
            try:
                return parse(resp.json())
            except (ValueError, KeyError, TypeError, IndexError) as err:
                attempts.append(f"malformed response ({type(err).__name__}: {err}): {resp.text[:200]!r}")
                continue
        raise ScorerHTTPError(f"POST {self.base_url}{path} failed after {self.max_retries + 1} attempt(s)", attempts)

    async def aclose(self) -> None:
        """Close the HTTP client. A client made on another (possibly closed) event loop cannot be
        closed from this one: its connections are dropped instead of raising."""
        client, loop = self._client, self._loop
        self._client, self._sem, self._loop = None, None, None
        if client is None:
            return
        if loop is not asyncio.get_running_loop():
            logger.debug("scorer HTTP client of another event loop dropped without an orderly close")
            return
        await client.aclose()


def _reason(resp: httpx.Response) -> str:
    """The server's reason for an error status: the OpenAI-style ``error.message`` or ``detail`` if
    the body is JSON, else its first 200 characters."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:200] or resp.reason_phrase
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping) and err.get("message"):
            return str(err["message"])[:200]
        for key in ("detail", "message", "error"):
            if data.get(key):
                return str(data[key])[:200]
    return resp.text[:200]


class HTTPScorer(BaseScorer):
    """Base of the scorers that call a server (``LLMJudgeScorer``, ``PRMModelScorer``): takes
    ``base_url`` and the :class:`HTTPOptions` fields as keyword arguments, owns the
    :class:`HTTPJsonClient` (``self.http``) and closes it in ``aclose``."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 30.0, max_retries: int = 2,
                 backoff_s: float = 0.5, max_concurrency: int = 16, breaker_failures: int = 5,
                 breaker_probe_s: float = 5.0, **kwargs: Any) -> None:
        options = HTTPOptions(api_key=api_key, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                              max_concurrency=max_concurrency, breaker_failures=breaker_failures,
                              breaker_probe_s=breaker_probe_s)
        self.http = HTTPJsonClient(base_url, options)
        super().__init__(**kwargs)

    async def aclose(self) -> None:
        await self.http.aclose()
