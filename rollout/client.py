"""Async token-in / token-out generation client (layer 4).

One request = one assistant turn: a prompt of token ids goes out, the sampled token ids and their
log-probs come back as a :class:`rollout.types.ModelResponse`, so training sees exactly what was
sampled. Two dialects:

* ``"vllm"`` -- ``POST {endpoint}/v1/completions`` with ``prompt`` = token ids, ``logprobs``,
  ``return_token_ids`` and ``return_tokens_as_token_ids`` (the fallback when a server predates
  ``return_token_ids``: ids are parsed from ``"token_id:N"`` logprob tokens). Also what the embedded
  jaxprm server speaks.
* ``"sglang"`` -- ``POST {endpoint}/generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob``; ids and log-probs come from ``meta_info.output_token_logprobs``
  (``[logprob, id, text]`` triples) or ``output_ids``.

With ``SamplingParams.top_logprobs = n > 0`` the request also asks for the top-``n`` alternatives of
every sampled token (vLLM ``logprobs: n``, whose ``choices[0].logprobs.top_logprobs`` holds one
``{token: logprob}`` dict per token; SGLang ``top_logprobs_num: n``, whose
``meta_info.output_top_logprobs`` holds one list of ``[logprob, id, text]`` per token), and
:attr:`Generated.entropies` carries each token's entropy of that top-``n`` distribution,
renormalised (what ARPO's entropy-adaptive branching reads).

The request bodies and the answers' parsing are ``rollout.dialects``. A server that answers with
text only raises :class:`TextOnlyResponseError` when
``require_tokens`` (the default; process-reward training needs token-backed turns).

Transport: aiohttp (its C HTTP parser keeps the client's CPU per request low), one keep-alive
``ClientSession`` per event loop for ``http://`` and ``https://`` endpoints alike, opened on the
loop's first request.

Reliability: every request has a timeout; connection errors, timeouts, 408, 429 and 5xx are retried
with bounded exponential backoff (full jitter); a request whose connection the server closed before
answering (an idle keep-alive connection dropped just as it was reused) is sent once more at once;
an ``asyncio.Semaphore`` bounds in-flight requests.
Several endpoints are load-balanced by least outstanding requests, with sticky routing per
``route_key`` (one tree = one key) so a server's prefix cache sees all siblings of a tree; a retry
after a failure goes to another endpoint (and re-pins the key there).

Server loss (``rollout.endpoints``): a request whose connection is lost (refused, reset, closed
before the answer) marks its endpoint down and is sent again, with the same body (so the same
per-request seed), to an endpoint still up; such a failover does not use up the request's retries.
A down endpoint is probed (``GET /health``) with exponential backoff; when it answers, the
``on_recover`` hook (the trainer: push the current weights, check ``/get_weight_version``) must
succeed before it gets requests again; the ``before_probe`` hook runs first (the trainer restarts its
embedded server there if it died). While every endpoint is down, requests wait for one to
recover; after ``unavailable_timeout_s`` they fail with :class:`ServersUnavailableError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from jaxprm.fields import require
from rollout.dialects import (DIALECTS, MAX_TOP_LOGPROBS, GenerationError, SamplingParams, TextOnlyResponseError,
                              parse_sglang, parse_vllm, request_body, top_entropies)
from rollout.endpoints import EndpointHealth
from rollout.types import ModelResponse

__all__ = [
    "ClientConfig",
    "SamplingParams",
    "GenerationClient",
    "GenerationError",
    "ServersUnavailableError",
    "TextOnlyResponseError",
    "Generated",
    "DIALECTS",
    "MAX_TOP_LOGPROBS",
    "top_entropies",
]

_JSON_HEADERS = {"Content-Type": "application/json"}
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ServersUnavailableError(GenerationError):
    """Every generation endpoint has been down for ``unavailable_timeout_s``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Where and how to call the generation server(s).

    Attributes:
      endpoints: base URLs, e.g. ``("http://127.0.0.1:8000",)``.
      dialect: ``"vllm"`` (``/v1/completions``) or ``"sglang"`` (``/generate``).
      model: the ``model`` field of vLLM requests (``None``: omitted, the server's only model).
      api_key: sent as ``Authorization: Bearer <api_key>`` when set.
      timeout_s: per-request timeout (connect + read), seconds.
      max_retries: retries after the first attempt for retryable failures.
      backoff_base_s / backoff_max_s: exponential backoff ``min(max, base * 2**attempt)``, full jitter.
      max_concurrency: requests in flight at once (all endpoints together), also the most
        connections open at once.
      require_tokens: fail with :class:`TextOnlyResponseError` on text-only responses.
      unavailable_timeout_s: how long requests wait while every endpoint is down before they fail
        with :class:`ServersUnavailableError`.
      probe_base_s / probe_max_s: a down endpoint is probed after ``base * 2**failed_probes``
        seconds, at most ``max``.
    """

    endpoints: tuple[str, ...]
    dialect: str = "vllm"
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 4
    backoff_base_s: float = 0.05
    backoff_max_s: float = 2.0
    max_concurrency: int = 64
    require_tokens: bool = True
    unavailable_timeout_s: float = 300.0
    probe_base_s: float = 0.5
    probe_max_s: float = 10.0

    def __post_init__(self) -> None:
        owner = type(self)
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", (self.endpoints,))
        object.__setattr__(self, "endpoints", tuple(e.rstrip("/") for e in self.endpoints))
        require(bool(self.endpoints), "endpoints", "is empty; give at least one base URL (http://host:port)", owner)
        for i, url in enumerate(self.endpoints):
            require(url.startswith(("http://", "https://")), f"endpoints[{i}]",
                    f"must start with http:// or https://, got {url!r}", owner)
        require(self.dialect in DIALECTS, "dialect", f"got {self.dialect!r}; allowed: {DIALECTS}", owner)
        for name in ("timeout_s", "backoff_base_s", "backoff_max_s", "unavailable_timeout_s", "probe_base_s",
                     "probe_max_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value > 0, name, f"must be > 0, got {value!r}", owner)
        require(self.max_retries >= 0, "max_retries", f"must be >= 0, got {self.max_retries}", owner)
        require(self.max_concurrency >= 1, "max_concurrency", f"must be >= 1, got {self.max_concurrency}", owner)


@dataclasses.dataclass(frozen=True)
class Generated:
    """A turn's result: the token-backed response plus the text and timing.

    ``entropies``: with ``SamplingParams.top_logprobs > 0`` and a server that returned the
    alternatives, one value per generated token: the entropy (nats) of the top-n distribution
    renormalised, ``p_i = exp(l_i) / sum_j exp(l_j)``, ``H = -sum_i p_i log p_i``, over the
    alternatives the server listed for that token (vLLM's dict also holds the sampled token, so it
    may have n + 1 entries); ``nan`` for a token without alternatives. ``None`` when not requested
    or when the answer carried none."""

    response: ModelResponse
    text: str | None
    endpoint: str
    attempts: int
    http_s: float  # wall time spent waiting on HTTP (all attempts, backoff excluded)
    client_s: float = 0.0  # synchronous client work: building the request and parsing the answer
    entropies: list[float] | None = None


class GenerationClient:
    """Async client; use ``async with GenerationClient(cfg) as c: await c.generate(ids, params)``.

    Counters (``stats()``): requests, retries, failures, prompt tokens sent, generated tokens.
    Counters and the routing table are the only state shared between concurrent callers; both are
    touched only from the event loop thread, between awaits. HTTP goes through one aiohttp
    ``ClientSession`` per event loop (opened by the loop's first request, all closed by
    :meth:`aclose`): at most ``max_concurrency`` keep-alive connections, ``timeout_s`` per request
    (connect, send and the whole answer), no cookies, redirects or proxy variables. Close the client
    on the loop that used it last: the connections of a loop that has already ended can no longer be
    closed cleanly (the garbage collector closes their sockets).
    """

    # Idle connections are closed after this many seconds: below uvicorn's default keep-alive (5 s,
    # also vLLM's and SGLang's), so that the client, not the server, closes an idle connection.
    KEEPALIVE_S = 4.0

    def __init__(self, config: ClientConfig, *, rng: random.Random | None = None):
        self.config = config
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._closed = False
        self._sem = asyncio.Semaphore(config.max_concurrency)
        self._outstanding = {e: 0 for e in config.endpoints}
        self._sticky: dict[str, str] = {}
        self._rng = rng or random.Random(0)
        self._stats = {"requests": 0, "retries": 0, "failovers": 0, "failures": 0, "prompt_tokens": 0,
                       "generated_tokens": 0}
        self.health = EndpointHealth(config.endpoints, probe_base_s=config.probe_base_s,
                                     probe_max_s=config.probe_max_s)
        # Awaited with a down endpoint that answers its health probe again; it must succeed (return)
        # for the endpoint to get requests again (the trainer pushes its weights and checks them).
        self.on_recover: Callable[[str], Awaitable[None]] | None = None
        # Awaited at the start of each probe of a down endpoint, before its health check: the owner of
        # an in-process server (the trainer's embedded one) restarts it there if it died.
        self.before_probe: Callable[[str], Awaitable[None]] | None = None
        self._probes: dict[str, asyncio.Task] = {}

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every session (their connections); later requests fail with :class:`GenerationError`."""
        self._closed = True
        probes, self._probes = list(self._probes.values()), {}
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`aclose` has run (every session closed)."""
        return self._closed

    def stats(self) -> dict[str, int]:
        """Request counters, plus the endpoints' (``marked_down``, ``recovered``, ``failed_probes``,
        ``down``: endpoints down now)."""
        return {**self._stats, **self.health.stats()}

    async def _session(self) -> aiohttp.ClientSession:
        """The running loop's session (opened on first use; sessions of closed loops are closed)."""
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is not None:
            return session
        for ended in [lp for lp in self._sessions if lp.is_closed()]:
            await self._sessions.pop(ended).close()
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=cfg.max_concurrency, keepalive_timeout=self.KEEPALIVE_S)
        session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                        headers=self._headers, cookie_jar=aiohttp.DummyCookieJar())
        self._sessions[loop] = session
        return session

    # ------------------------------------------------------------------ routing

    def pick_endpoint(self, route_key: str | None) -> str:
        """Sticky endpoint for ``route_key`` (while it is up); else the up endpoint with the fewest
        outstanding requests (every endpoint when none is up)."""
        sticky = self._sticky.get(route_key) if route_key is not None else None
        if sticky is not None and self.health.is_up(sticky):
            return sticky
        ep = self._least_loaded(self.health.up() or self.config.endpoints)
        if route_key is not None:
            self._sticky[route_key] = ep
        return ep

    def _least_loaded(self, candidates: Sequence[str]) -> str:
        return min(candidates, key=lambda e: (self._outstanding[e], self.config.endpoints.index(e)))

    def _failover(self, failed: str, route_key: str | None) -> str:
        """After a failed attempt, move to the least-loaded *other* up endpoint (re-pinning the key)."""
        others = [e for e in self.health.up() if e != failed]
        if not others:
            return failed
        ep = self._least_loaded(others)
        if route_key is not None:
            self._sticky[route_key] = ep
        return ep

    async def _route(self, route_key: str | None) -> str:
        """An up endpoint for a request (:meth:`pick_endpoint`), probing down endpoints that are due.
        While every endpoint is down, waits for one to recover; raises
        :class:`ServersUnavailableError` once they have all been down ``unavailable_timeout_s``."""
        while True:
            self._probe_due()
            if self.health.up():
                return self.pick_endpoint(route_key)
            down_for = self.health.all_down_for() or 0.0
            limit = self.config.unavailable_timeout_s
            if down_for >= limit:
                reasons = "; ".join(f"{e}: {r}" for e, r in self.health.down().items())
                self._stats["failures"] += 1
                raise ServersUnavailableError(
                    f"every generation server has been down for {down_for:.0f} s (unavailable_timeout_s={limit:g}; "
                    f"restart them and --resume): {reasons}")
            await asyncio.sleep(min(0.25, self.health.next_probe_in(), limit - down_for))

    def _probe_due(self) -> None:
        """Start a probe of each down endpoint whose backoff has passed."""
        for ep in self.health.due():
            self._start_probe(ep)

    def _start_probe(self, ep: str) -> None:
        """Probe ``ep`` in the background unless a probe of it is already running (one at a time)."""
        task = self._probes.get(ep)
        if task is None or task.done():
            self._probes[ep] = asyncio.ensure_future(self._probe(ep))

    async def _probe(self, ep: str) -> None:
        """One recovery attempt of a down endpoint: ``before_probe``, its health check, then
        ``on_recover``; it comes back up only if all succeed, else its next probe waits longer."""
        try:
            if self.before_probe is not None:
                await self.before_probe(ep)
            await self._health_check(ep, retries=0)
            if self.on_recover is not None:
                await self.on_recover(ep)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever the hook raised, the endpoint stays down
            self.health.probe_failed(ep, " ".join(f"{type(e).__name__}: {e}".split())[:300])
            return
        self.health.mark_up(ep)

    async def recover(self, wait_s: float = 5.0) -> list[str]:
        """Probe every down endpoint now (backoff aside) and wait up to ``wait_s`` for the probes (one
        that takes longer, e.g. a host that does not answer, goes on in the background); returns the
        endpoints still down. The trainer calls it between steps."""
        for ep in list(self.health.down()):
            self._start_probe(ep)
        pending = [t for e, t in list(self._probes.items()) if not self.health.is_up(e) and not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=wait_s)
        return list(self.health.down())

    def release(self, route_key: str) -> None:
        """Forget the sticky endpoint of a finished tree."""
        self._sticky.pop(route_key, None)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: Sequence[int], params: SamplingParams, *,
                       route_key: str | None = None) -> Generated:
        """Sample one turn for ``prompt`` (token ids). Retries transient failures; raises
        :class:`GenerationError` (or :class:`TextOnlyResponseError`) otherwise."""
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        t_build = time.perf_counter()
        path, body = request_body(self.config.dialect, self.config.model, prompt, params)
        try:
            payload = json.dumps(body, separators=(",", ":")).encode()
        except TypeError:  # e.g. numpy integers inside a list prompt
            path, body = request_body(self.config.dialect, self.config.model, [int(t) for t in prompt], params)
            payload = json.dumps(body, separators=(",", ":")).encode()
        client_s = time.perf_counter() - t_build
        cfg = self.config
        async with self._sem:
            data, ep, attempts, http_s = await self._send("POST", path, payload, route_key=route_key)
        t_parse = time.perf_counter()
        try:
            data = json.loads(data)
        except ValueError:
            self._stats["failures"] += 1
            raise GenerationError(f"{ep}{path} returned invalid JSON: {data[:200]!r}") from None
        parse = parse_vllm if cfg.dialect == "vllm" else parse_sglang
        out, lps, finish, text, wv, echoed, tops = parse(data, require_tokens=cfg.require_tokens,
                                                         top_n=params.top_logprobs)
        if echoed is not None and list(echoed) != list(prompt):
            raise GenerationError(f"{ep}{path}: the server's prompt_token_ids differ from the prompt sent")
        response = ModelResponse(input_tokens=list(prompt), output_tokens=out, output_logprobs=lps,
                                 stop_reason=finish, weight_version=wv)
        self._stats["prompt_tokens"] += len(prompt)
        self._stats["generated_tokens"] += len(out)
        entropies = None
        if tops is not None:
            if len(tops) != len(out):
                raise GenerationError(f"{ep}{path}: {len(tops)} top-logprob entries for {len(out)} tokens")
            try:
                entropies = top_entropies(tops)
            except (TypeError, ValueError) as e:
                raise GenerationError(f"{ep}{path}: malformed top logprobs: {e}") from None
        client_s += time.perf_counter() - t_parse
        return Generated(response=response, text=text, endpoint=ep, attempts=attempts, http_s=http_s,
                         client_s=client_s, entropies=entropies)

    async def _send(self, method: str, path: str, payload: bytes | None, *, route_key: str | None = None,
                    endpoint: str | None = None, retries: int | None = None) -> tuple[bytes, str, int, float]:
        """One request under the client's retry policy; returns ``(body, endpoint, attempts, http_s)``.

        Timeouts and the statuses in ``_RETRY_STATUS`` are retried up to ``max_retries`` times with
        full-jitter exponential backoff; other statuses fail at once. A lost connection marks the
        endpoint down. With ``endpoint`` the request stays there (a lost connection counts as a
        retry); otherwise the route key picks an up endpoint, a retry fails over to another one
        (re-pinning the key), and after a lost connection the request is sent again at once to an up
        endpoint -- waiting while none is (:meth:`_route`) -- without using up a retry (at most
        ``max_retries + len(endpoints)`` lost connections per request). Raises
        :class:`GenerationError`.
        """
        cfg = self.config
        max_retries = cfg.max_retries if retries is None else retries
        routed = endpoint is None
        if self._closed:
            raise GenerationError(f"{endpoint or cfg.endpoints[0]}{path}: the generation client is closed")
        ep = endpoint or await self._route(route_key)
        attempt = lost = 0
        http_s = 0.0
        last_err = ""
        session = await self._session()
        while True:
            self._outstanding[ep] = self._outstanding.get(ep, 0) + 1
            self._stats["requests"] += 1
            t0 = time.perf_counter()
            status = None
            connection_lost = False
            try:
                status, content = await self._exchange(session, method, ep + path, payload)
            except TimeoutError as e:  # aiohttp's timeouts are TimeoutErrors too
                last_err = f"ReadTimeout: no complete answer within {cfg.timeout_s} s{f' ({e})' if str(e) else ''}"
            except aiohttp.ClientConnectorError as e:
                last_err, connection_lost = f"ConnectError: {e}", True
            except aiohttp.ClientConnectionError as e:  # reset or closed before the answer
                last_err, connection_lost = f"{type(e).__name__}: {' '.join(str(e).split())}", True
            except aiohttp.ClientError as e:
                last_err = f"{type(e).__name__}: {' '.join(str(e).split())}"  # one line
            finally:
                http_s += time.perf_counter() - t0
                self._outstanding[ep] -= 1
            if status == 200:
                return content, ep, attempt + lost + 1, http_s
            if status is not None:
                last_err = f"HTTP {status}: {content[:300].decode('utf-8', 'replace')}"
                if status not in _RETRY_STATUS:
                    self._stats["failures"] += 1
                    raise GenerationError(f"{ep}{path} failed: {last_err}", status=status)
            if connection_lost:
                self.health.mark_down(ep, last_err)
                if routed and lost < cfg.max_retries + len(cfg.endpoints):
                    lost += 1
                    self._stats["failovers"] += 1
                    ep = await self._route(route_key)
                    continue
            if attempt >= max_retries:
                self._stats["failures"] += 1
                raise GenerationError(f"{ep}{path} failed after {attempt + lost + 1} attempts: {last_err}",
                                      status=status)
            self._stats["retries"] += 1
            delay = min(cfg.backoff_max_s, cfg.backoff_base_s * (2 ** attempt))
            await asyncio.sleep(self._rng.uniform(0, delay))
            attempt += 1
            if routed:
                ep = self._failover(ep, route_key)

    @staticmethod
    async def _exchange(session: aiohttp.ClientSession, method: str, url: str,
                        payload: bytes | None) -> tuple[int, bytes]:
        """One HTTP exchange: ``(status, body)``. A connection that closed before the answer's head
        arrived (the server dropped an idle keep-alive connection just as it was reused) gets the
        request once more, at once; aiohttp does that itself for idempotent methods only. A failure
        while the body is read (or a cancellation) closes that connection; nothing else is touched."""
        headers = _JSON_HEADERS if payload is not None else None
        try:
            resp = await session.request(method, url, data=payload, headers=headers, allow_redirects=False)
        except aiohttp.ClientConnectionError as e:
            if isinstance(e, (aiohttp.ClientConnectorError, TimeoutError)):
                raise
            resp = await session.request(method, url, data=payload, headers=headers, allow_redirects=False)
        try:
            return resp.status, await resp.read()  # read() hands the connection back to the pool
        except BaseException:
            resp.close()
            raise

    # ------------------------------------------------------------------ server control

    async def check_health(self) -> None:
        """Check that every endpoint answers (``GET /health``, else ``GET /v1/models`` for servers
        without it), under the retry policy, and put each back in rotation. Raises
        :class:`GenerationError` naming the endpoint."""
        for ep in self.config.endpoints:
            await self._health_check(ep)
            self.health.mark_up(ep)

    async def _health_check(self, ep: str, *, retries: int | None = None) -> None:
        try:
            await self._send("GET", "/health", None, endpoint=ep, retries=retries)
        except GenerationError as e:
            if e.status is None:
                raise GenerationError(f"generation server {ep} unreachable: {e}") from e
            if e.status != 404:
                raise GenerationError(f"generation server {ep} is not healthy: {e}", status=e.status) from e
            await self._send("GET", "/v1/models", None, endpoint=ep, retries=retries)

    async def probe_token_io(self, prompt: Sequence[int]) -> None:
        """Send one greedy one-token request with a token-id prompt to every endpoint, without
        retries, and check that the answer carries token ids and log-probs. Raises
        :class:`GenerationError` with one line that says what to use instead: a server that refuses
        token-id prompts (llama.cpp answers them with HTTP 500) would otherwise be retried as if the
        error were transient."""
        path, body = request_body(self.config.dialect, self.config.model, [int(t) for t in prompt],
                                  SamplingParams(max_tokens=1, temperature=0.0))
        payload = json.dumps(body).encode()
        parse = parse_vllm if self.config.dialect == "vllm" else parse_sglang
        for ep in self.config.endpoints:
            try:
                data, *_ = await self._send("POST", path, payload, endpoint=ep, retries=0)
                parse(json.loads(data), require_tokens=True)
            except (GenerationError, ValueError, KeyError, TypeError) as e:
                detail = " ".join(str(e).split())[:300]
                unanswered = isinstance(e, GenerationError) and not isinstance(e, TextOnlyResponseError)
                if unanswered and e.status is None:  # a timeout or a lost connection is not a refusal
                    raise GenerationError(f"the generation server {ep} did not answer a one-token token-id "
                                          f"request: {detail}") from e
                raise GenerationError(
                    f"the generation server {ep} does not accept token-in/token-out requests ({self.config.dialect} "
                    f"dialect: a prompt of token ids, token ids and log-probs in the answer): {detail}. Training "
                    "needs the sampled tokens: use vLLM >= 0.10.2 (server.dialect: vllm), SGLang's /generate "
                    "(server.dialect: sglang) or python -m jaxprm.serve") from e

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None,
                                       endpoints: Sequence[str] | None = None) -> list[str]:
        """``POST /update_weights_from_disk`` (SGLang's route, also the embedded server's) on
        ``endpoints`` (default: every endpoint up), under the retry policy; the server must answer 200
        with ``success`` true. An endpoint whose connection is lost is marked down and skipped (it
        gets the weights when it recovers); returns the endpoints updated."""
        body: dict[str, Any] = {"model_path": str(model_path)}
        if weight_version is not None:
            body["weight_version"] = int(weight_version)
        payload = json.dumps(body).encode()
        updated = []
        for ep in self.health.up() if endpoints is None else endpoints:
            try:
                data, *_ = await self._send("POST", "/update_weights_from_disk", payload, endpoint=ep)
            except GenerationError:
                if endpoints is None and not self.health.is_up(ep):
                    continue  # it died under the push: its recovery pushes again
                raise
            try:
                ok = json.loads(data).get("success", True)
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                raise GenerationError(f"{ep}/update_weights_from_disk refused {model_path}: {data[:300]!r}")
            updated.append(ep)
        return updated

    async def weight_version(self, ep: str) -> int:
        """``GET /get_weight_version`` of one endpoint (SGLang's route, also the embedded server's), no retries."""
        data, *_ = await self._send("GET", "/get_weight_version", None, endpoint=ep, retries=0)
        try:
            return int(json.loads(data)["weight_version"])
        except (ValueError, KeyError, TypeError):
            raise GenerationError(f"{ep}/get_weight_version answered {data[:200]!r}") from None
