"""No 5xx on any input (issue 19, item 1), over real HTTP on loopback: ``top_k`` beyond int32,
top-k / top-p together with top log-probs (alternatives outside the kept set have processed
log-prob -inf), temperatures that overflow ``logits / T``, lone surrogates anywhere in a body; and
an unexpected error is a 500 that keeps the kept-alive connection."""

from __future__ import annotations

import json
import math
import socket

import numpy as np
import pytest
from fastapi import FastAPI

from jaxprm.inprocess import ThreadedServer
from jaxprm.serve.errors import CatchAllMiddleware, install_error_handlers
from jaxprm.serve.logprobs import LOGPROB_FLOOR

CHAT = [{"role": "user", "content": "Which action?"}]


def _all_logprobs(path: str, body) -> list[float]:
    """Every log-prob number of an answer (main and alternatives)."""
    if path == "/v1/completions":
        return [x for c in body["choices"] for x in c["logprobs"]["token_logprobs"]] + \
               [x for c in body["choices"] for d in c["logprobs"]["top_logprobs"] for x in d.values()]
    if path == "/v1/chat/completions":
        return [x for c in body["choices"] for t in c["logprobs"]["content"]
                for x in [t["logprob"], *(a["logprob"] for a in t["top_logprobs"])]]
    meta = body["meta_info"]
    return [e[0] for e in meta["output_token_logprobs"]] + [e[0] for pos in meta["output_top_logprobs"] for e in pos]


def _request(path: str, **sampling):
    if path == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 4, "logprobs": 5, "ignore_eos": True, **sampling}
    if path == "/v1/chat/completions":
        return {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 5, "ignore_eos": True, **sampling}
    return {"text": "hi", "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, **sampling}}


PATHS = ["/v1/completions", "/v1/chat/completions", "/generate"]


def _not_json(constant: str):
    """``json.loads`` accepts ``-Infinity`` / ``NaN``; JSON does not."""
    raise AssertionError(f"{constant} is not JSON")


@pytest.mark.parametrize("path", PATHS)
def test_top_k_beyond_int32_means_no_top_k(http, path):
    outs = []
    for top_k in (2**31, 2**63 + 5, -1):
        r = http.post(path, json=_request(path, top_k=top_k, temperature=1.0, seed=3))
        assert r.status_code == 200, r.text
        outs.append(r.json())
    tokens = [json.dumps(o["choices"][0].get("text") if "choices" in o else o["output_ids"]) for o in outs]
    assert tokens[0] == tokens[1] == tokens[2]  # any top_k >= the vocabulary keeps every token


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_top_k_top_p_with_top_logprobs_are_finite(http, path, stream):
    for sampling in ({"top_k": 1}, {"top_p": 0.05}, {"top_k": 2, "top_p": 0.5}):
        body = _request(path, temperature=1.0, seed=1, **sampling)
        body["stream"] = stream
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e, parse_constant=_not_json) for e in events[:-1]]
            assert chunks
            continue
        values = _all_logprobs(path, r.json())
        assert values and all(math.isfinite(v) and LOGPROB_FLOOR <= v <= 0 for v in values)
        if sampling == {"top_k": 1}:  # alternatives outside the kept token sit at the floor
            assert LOGPROB_FLOOR in values


@pytest.mark.parametrize("path", PATHS)
def test_tiny_temperatures_are_greedy(http, path):
    greedy = http.post(path, json=_request(path, temperature=0.0)).json()
    for t in (1e-30, 1e-45, 1e-6):
        r = http.post(path, json=_request(path, temperature=t, top_p=0.5))
        assert r.status_code == 200, r.text
        values = _all_logprobs(path, r.json())
        assert all(isinstance(v, float) and math.isfinite(v) for v in values)
        np.testing.assert_allclose(values[:4], _all_logprobs(path, greedy)[:4], atol=1e-4)


def _raw_exchange(sock: socket.socket, path: str, body: bytes) -> tuple[int, bytes]:
    """One HTTP/1.1 request on an open socket; returns (status, body) and leaves the socket open."""
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed by the server"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    headers = {k.strip().lower(): v.strip() for k, v in
               (line.split(b":", 1) for line in head.split(b"\r\n")[1:])}
    assert headers.get(b"connection", b"").lower() != b"close"
    n = int(headers[b"content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed by the server"
        rest += chunk
    return int(head.split()[1]), rest[:n]


SURROGATES = [
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud83d", "max_tokens": 2}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop.0"),
    ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1, "max_tokens": 2}', "\\ud800"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages.0.role"),
    ("/generate", b'{"text": "hi", "rid": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "rid"),
    ("/generate", b'{"text": ["\\ud800"], "sampling_params": {"max_new_tokens": 2}}', "text.0"),
    ("/update_weights_from_disk", b'{"model_path": "/tmp/\\ud800"}', "model_path"),
]


def test_lone_surrogates_are_400_and_the_connection_survives(server):
    with socket.create_connection((server.host, server.port), timeout=120) as sock:
        for path, body, param in SURROGATES:
            status, answer = _raw_exchange(sock, path, body)
            assert status == 400, (path, body, answer)
            err = json.loads(answer)["error"]
            assert err["param"] == param and "lone surrogate" in err["message"], err
        # a surrogate pair is valid text; the same connection still serves
        status, answer = _raw_exchange(sock, "/v1/completions", b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}')
        assert status == 200, answer


def test_an_unexpected_error_is_a_500_that_keeps_the_connection():
    """The catch-all answers in the error shape and the HTTP server keeps the connection (a real
    uvicorn on loopback; the route is a stand-in for a server bug)."""
    app = FastAPI()
    app.add_middleware(CatchAllMiddleware)
    install_error_handlers(app)

    @app.post("/boom")
    async def boom():
        raise RuntimeError("a bug")

    @app.post("/ok")
    async def ok():
        return {"ok": True}

    server = ThreadedServer(app, log_level="critical", startup_timeout_s=30)
    try:
        with socket.create_connection((server.host, server.port), timeout=30) as c:
            for _ in range(2):
                status, answer = _raw_exchange(c, "/boom", b"{}")
                err = json.loads(answer)["error"]
                assert status == 500 and err["code"] == 500 and "RuntimeError: a bug" in err["message"]
            assert _raw_exchange(c, "/ok", b"{}") == (200, b'{"ok":true}')
    finally:
        server.stop(force=True)
