"""The lean HTTP/1.1 client (rollout.http1) against real sockets on 127.0.0.1: raw asyncio servers
that answer with Content-Length, chunked and read-until-close bodies, drop idle keep-alive
connections, answer late or with garbage; and against uvicorn (the scripted server)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from rollout.http1 import ConnectError, Http1Error, Http1Pool, ReadTimeout, supports
from rollout.testing import ScriptedServer, ServerScript, fixed_text_policy, make_test_tokenizer


@contextlib.asynccontextmanager
async def raw_server(handler):
    """``handler(head: bytes, body: bytes, writer, n)``: answer the ``n``-th request of a connection."""
    connections = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        connections.append(writer)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                keep = await handler(head, body, writer, n)
                await writer.drain()
                n += 1
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        for w in connections:
            w.close()
        await server.wait_closed()


def test_supports_plain_http_only():
    assert supports("http://127.0.0.1:8000") and supports("http://localhost/v1")
    assert not supports("https://example.org") and not supports("ftp://x") and not supports("http://h/?q=1")
    with pytest.raises(ValueError, match="plain http://"):
        Http1Pool("https://example.org")


def test_bodies_headers_keep_alive_and_one_write_per_request():
    seen = []

    async def handler(head, body, writer, n):
        seen.append((head, body))
        kind = body.decode()
        if kind == "length":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"a\": [1]}\n")
        elif kind == "chunked":
            writer.write(b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n3;ext=1\r\nefg\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)  # the rest arrives in another segment
            writer.write(b"0\r\nX-Trailer: t\r\n\r\n")
        elif kind == "interim":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n")
        elif kind == "close":
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            return False
        else:
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nup")
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            pool = Http1Pool(url + "/prefix", headers={"Authorization": "Bearer k"}, timeout_s=5)
            a = await pool.request("POST", "/x", b"length")
            b = await pool.request("POST", "/y", b"chunked")
            c = await pool.request("POST", "/z", b"interim")
            n_conns = len(conns)
            d = await pool.request("POST", "/w", b"close")
            e = await pool.request("GET", "/health")  # a fresh connection after the close
            await pool.aclose()
            return a, b, c, d, e, n_conns, len(conns)

    a, b, c, d, e, n_before_close, n_after = asyncio.run(go())
    assert (a.status, a.content, a.headers["content-type"]) == (200, b'{"a": [1]}\n', "application/json")
    assert (b.status, b.content) == (201, b"abcdefg")
    assert (c.status, c.content) == (204, b"")
    assert (d.status, d.text) == (200, "until the end") and (e.status, e.content) == (200, b"up")
    assert n_before_close == 1 and n_after == 2  # keep-alive: three requests on one connection
    head, body = seen[0]
    assert head.startswith(b"POST /prefix/x HTTP/1.1\r\n") and b"Authorization: Bearer k\r\n" in head
    assert b"Content-Length: 6\r\n" in head and body == b"length"
    assert seen[-1][0].startswith(b"GET /prefix/health HTTP/1.1\r\n") and b"Content-Length" not in seen[-1][0]


def test_a_dropped_idle_connection_is_replaced_and_a_mid_answer_close_is_an_error():
    async def handler(head, body, writer, n):
        if body == b"partial":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly a part")
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            pool = Http1Pool(url, timeout_s=5)
            assert (await pool.request("POST", "/", b"a")).content == b"ok"
            conns[0].transport.abort()  # the server drops the idle keep-alive connection ...
            await asyncio.sleep(0.05)
            again = await pool.request("POST", "/", b"b")  # ... the next request opens a new one
            conns[1].transport.abort()  # dropped just as it is reused (the client has not seen it yet):
            racing = await pool.request("POST", "/", b"c")  # sent once more, on a fresh connection
            with pytest.raises(Http1Error, match="closed before the answer was complete"):
                await pool.request("POST", "/", b"partial")
            await pool.aclose()
            return again, racing, len(conns)

    again, racing, n = asyncio.run(go())
    assert again.content == racing.content == b"ok" and n == 3


def test_timeouts_refusals_garbage_and_cancellation():
    async def handler(head, body, writer, n):
        if body == b"slow":
            await asyncio.sleep(1.0)
        elif body == b"garbage":
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    async def go():
        async with raw_server(handler) as (url, conns):
            pool = Http1Pool(url, timeout_s=0.2)
            with pytest.raises(ReadTimeout, match="within 0.2 s"):
                await pool.request("POST", "/", b"slow")
            with pytest.raises(Http1Error, match="not an HTTP/1.x status line"):
                await pool.request("POST", "/", b"garbage")
            pool.timeout_s = 5
            task = asyncio.create_task(pool.request("POST", "/", b"slow"))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            ok = await pool.request("POST", "/", b"fine")  # a cancelled request's connection is not reused
            open_conns = len(pool._open)
            await pool.aclose()
            with pytest.raises(Http1Error, match="closed"):
                await pool.request("GET", "/")
            return ok, open_conns, len(conns)

    ok, open_conns, n = asyncio.run(go())
    assert ok.content == b"ok" and open_conns == 1 and n == 4
    with pytest.raises(ConnectError, match="cannot connect"):
        asyncio.run(Http1Pool("http://127.0.0.1:1", timeout_s=2).request("GET", "/"))


def test_against_uvicorn_many_concurrent_requests():
    tok = make_test_tokenizer()

    async def go():
        with ScriptedServer(ServerScript(policy=fixed_text_policy(tok, "ok")), tok) as srv:
            pool = Http1Pool(srv.url, max_connections=4, timeout_s=30)
            body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": true}'
            out = await asyncio.gather(*(pool.request("POST", "/generate", body) for _ in range(32)))
            health = await pool.request("GET", "/health")
            idle = len(pool._idle)
            await pool.aclose()
            return out, health, idle

    out, health, idle = asyncio.run(go())
    assert all(r.status == 200 and b"meta_info" in r.content for r in out) and health.status == 200
    assert idle <= 4
