"""A lean keep-alive HTTP/1.1 client for plain ``http://`` origins (layer 4, below the client).

``GenerationClient`` sends one small JSON request per assistant turn and reads one JSON answer.
Through httpx that costs about 0.5 ms of Python per request (request and response models, URL
parsing, header normalization, anyio streams, h11 state machines, headers and body written in two
``send`` calls, so the server wakes twice). This module does only what that traffic needs, on
``asyncio`` protocols: the request is written with one ``write`` (status line, headers and body
together), and the answer is parsed in ``data_received`` (status line, headers, then a
``Content-Length``, chunked, or read-until-close body).

:class:`Http1Pool` keeps idle connections per origin (most recently used first), opens a new one
when none is idle, and never holds more than ``max_connections`` idle ones. Failures raise
:class:`Http1Error` (a connection that closed or failed, a malformed answer; :class:`ConnectError`
when the origin cannot be reached, :class:`ReadTimeout` when the answer is late);
the caller's retry policy decides what to do. A request that finds its *reused* connection closed
before any byte of the answer arrived (the server dropped an idle keep-alive connection just as it
was reused) is sent once more on a fresh connection. Cancellation closes the connection it used.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from urllib.parse import urlsplit

__all__ = ["Http1Error", "ConnectError", "ReadTimeout", "Http1Pool", "Http1Response", "supports"]

_MAX_HEAD = 64 * 1024


class Http1Error(ConnectionError):
    """The connection failed or closed, or the server's answer was not valid HTTP/1.1."""


class ConnectError(Http1Error):
    """The origin could not be reached."""


class ReadTimeout(Http1Error, TimeoutError):
    """No complete answer within the pool's ``timeout_s``."""


class Http1Response:
    """``status`` (int), ``headers`` (lower-case names -> values) and ``content`` (bytes)."""

    __slots__ = ("status", "headers", "content")

    def __init__(self, status: int, headers: dict[str, str], content: bytes) -> None:
        self.status = status
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


def supports(url: str) -> bool:
    """Whether ``url`` is a plain ``http://`` origin this client can talk to."""
    parts = urlsplit(url)
    return parts.scheme == "http" and bool(parts.hostname) and not parts.query and not parts.fragment


class _Conn(asyncio.Protocol):
    """One connection; at most one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.keep_alive = True
        self._buf = bytearray()
        self._waiter: asyncio.Future | None = None
        self._head: tuple[int, dict[str, str]] | None = None
        self._length: int | None = None  # remaining body bytes (Content-Length)
        self._chunked = False
        self._until_close = False
        self._body = bytearray()
        self.received = False

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.closed = True  # bytes nobody asked for: the connection cannot be trusted any more
            if self.transport is not None:
                self.transport.close()
            return
        self.received = True
        self._buf += data
        try:
            self._parse()
        except Http1Error as e:
            self._fail(e)

    def eof_received(self) -> bool | None:
        self.keep_alive = False
        return None  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._until_close and self._head is not None and exc is None:
                self._done()
            else:
                self._fail(Http1Error(f"connection closed before the answer was complete"
                                      f"{f': {exc!r}' if exc else ''}"))

    # -- request / response
    def send(self, data: bytes) -> asyncio.Future:
        assert self.transport is not None and (self._waiter is None or self._waiter.done())
        self._waiter = asyncio.get_running_loop().create_future()
        self._buf.clear()
        self._body = bytearray()
        self._head = None
        self._length = None
        self._chunked = self._until_close = False
        self.received = False
        self.transport.write(data)
        return self._waiter

    def _fail(self, exc: BaseException) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _done(self) -> None:
        status, headers = self._head
        self._waiter.set_result(Http1Response(status, headers, bytes(self._body)))

    def _parse(self) -> None:
        buf = self._buf
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise Http1Error("response headers are too large")
                return
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            del buf[:end + 4]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise Http1Error(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
            status = int(code)
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    raise Http1Error(f"malformed header line {line[:100]!r}")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
                self._parse()
                return
            self._head = (status, headers)
            conn = headers.get("connection", "").lower()
            if "close" in conn or (version == "HTTP/1.0" and "keep-alive" not in conn):
                self.keep_alive = False
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._chunked = True
            elif "content-length" in headers:
                try:
                    self._length = int(headers["content-length"])
                except ValueError:
                    raise Http1Error(f"bad Content-Length {headers['content-length']!r}") from None
            elif status in (204, 304):
                self._length = 0
            else:
                self._until_close = True
                self.keep_alive = False
        if self._chunked:
            self._parse_chunks()
        elif self._length is not None:
            take = min(len(buf), self._length)
            self._body += buf[:take]
            del buf[:take]
            self._length -= take
            if self._length == 0:
                if buf:
                    raise Http1Error("the server sent more bytes than its Content-Length")
                self._done()
        else:  # until close
            self._body += buf
            buf.clear()

    def _parse_chunks(self) -> None:
        buf = self._buf
        while True:
            if self._length:  # inside a chunk: its data plus the CRLF after it
                if len(buf) < self._length + 2:
                    return
                self._body += buf[:self._length]
                del buf[:self._length + 2]
                self._length = 0
            end = buf.find(b"\r\n")
            if end < 0:
                return
            size_text = bytes(buf[:end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise Http1Error(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:  # the last chunk, then optional trailer lines and an empty line
                rest = buf[end + 2:]
                if not (rest.startswith(b"\r\n") or b"\r\n\r\n" in rest):
                    return
                buf.clear()
                self._done()
                return
            del buf[:end + 2]
            self._length = size


class Http1Pool:
    """Keep-alive connections to one ``http://host:port`` origin (see the module docstring).

    Args:
      base_url: ``http://host[:port][/prefix]``; request paths are appended to the prefix.
      max_connections: idle connections kept for reuse (more may be open while requests wait).
      headers: sent with every request (e.g. ``Authorization``).
      timeout_s: connect + send + answer, per request.
    """

    def __init__(self, base_url: str, *, max_connections: int = 64, headers: Mapping[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        if not supports(base_url):
            raise ValueError(f"{base_url!r}: Http1Pool talks to plain http:// origins only")
        parts = urlsplit(base_url)
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        host_header = f"[{self.host}]" if ":" in self.host else self.host
        if parts.port:
            host_header += f":{parts.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._fixed = f"Host: {host_header}\r\nUser-Agent: jaxprm\r\nAccept: */*\r\n{extra}".encode("latin-1")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._idle: collections.deque[_Conn] = collections.deque()
        self._open: set[_Conn] = set()
        self.is_closed = False

    def _encode(self, method: str, path: str, body: bytes | None, content_type: str | None) -> bytes:
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode("latin-1") + self._fixed
        if body is not None:
            head += f"Content-Type: {content_type or 'application/json'}\r\nContent-Length: {len(body)}\r\n".encode()
            return head + b"\r\n" + body
        return head + b"\r\n"

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Conn, self.host, self.port)
        except OSError as e:
            raise ConnectError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        self._open.add(conn)
        return conn

    def _checkout(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
            self._open.discard(conn)
        return None

    def _checkin(self, conn: _Conn) -> None:
        if self.is_closed or conn.closed or not conn.keep_alive or len(self._idle) >= self.max_connections:
            self._drop(conn)
        else:
            self._idle.append(conn)

    def _drop(self, conn: _Conn) -> None:
        conn.closed = True
        if conn.transport is not None:
            conn.transport.close()
        self._open.discard(conn)

    async def request(self, method: str, path: str, body: bytes | None = None, *,
                      content_type: str | None = None) -> Http1Response:
        """Send one request and read the whole answer (``TimeoutError`` after ``timeout_s``)."""
        if self.is_closed:
            raise Http1Error("the connection pool is closed")
        data = self._encode(method, path, body, content_type)
        try:
            return await self._request(data)
        except TimeoutError as e:
            if isinstance(e, ReadTimeout):
                raise
            raise ReadTimeout(f"no complete answer from {self.host}:{self.port} within {self.timeout_s} s") from None

    async def _request(self, data: bytes) -> Http1Response:
        async with asyncio.timeout(self.timeout_s):
            conn = self._checkout()
            reused = conn is not None
            while True:
                if conn is None:
                    conn = await self._connect()
                try:
                    resp = await conn.send(data)
                except Http1Error:
                    self._drop(conn)
                    if reused and not conn.received:  # a stale keep-alive connection: once more, fresh
                        conn, reused = None, False
                        continue
                    raise
                except BaseException:  # cancelled or timed out mid-request: the connection is unusable
                    self._drop(conn)
                    raise
                self._checkin(conn)
                return resp

    async def aclose(self) -> None:
        self.is_closed = True
        for conn in list(self._open):
            self._drop(conn)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports close
