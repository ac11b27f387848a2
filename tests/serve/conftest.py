"""A real generation server (tiny model) on 127.0.0.1, shared by the server tests of this folder
(one server for the session: its engine compiles a handful of programs once)."""

from __future__ import annotations

import httpx
import openai
import pytest

from jaxprm.models import load_model
from jaxprm.serve import ServerHandle

# Few shapes: every test request stays within these buckets, so the server compiles a handful of
# programs once.
SAMPLER_KW = dict(batch_buckets=(1, 4, 16), prompt_buckets=(32, 128), new_token_buckets=(8, 32))


@pytest.fixture(scope="session")
def sampler_kw():
    return dict(SAMPLER_KW)


@pytest.fixture(scope="session")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="session")
def server(tiny):
    model, tok = tiny
    handle = ServerHandle.start(model, tok, host="127.0.0.1", port=0, model_name="tiny", sampler_kwargs=SAMPLER_KW)
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
