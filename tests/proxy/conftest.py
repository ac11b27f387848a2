"""Fixtures for the proxy tests: the embedded jaxprm server (tiny model) as the upstream, on
127.0.0.1, shared by the whole session; helpers that start a proxy in the test's event loop."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

models = pytest.importorskip("jaxprm.models")
serve = pytest.importorskip("jaxprm.serve")

from rollout.client import ClientConfig  # noqa: E402
from rollout.proxy import ProxyConfig, ProxyServer  # noqa: E402

ADMIN = "admin-test-key"


@pytest.fixture(scope="session")
def upstream():
    """``(ServerHandle, tokenizer)``: the tiny model served in a background thread."""
    from jaxprm.serve.sampler import Sampler

    model, tok = models.load_model("tiny")
    sampler = Sampler(model, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                      batch_buckets=(1, 8), prompt_buckets=(512, 1024), new_token_buckets=(8,))
    with serve.ServerHandle.from_sampler(sampler, tok) as handle:
        yield handle, tok


def proxy_config(url: str, **kw: Any) -> ProxyConfig:
    kw.setdefault("default_max_tokens", 8)
    return ProxyConfig(upstream=ClientConfig(endpoints=(url,), timeout_s=120, max_retries=1), admin_key=ADMIN, **kw)


@contextlib.asynccontextmanager
async def running_proxy(upstream, *, scorers=None, **kw: Any):
    """A ``ProxyServer`` on a free loopback port in the current event loop (stopped on exit)."""
    handle, tok = upstream
    srv = await ProxyServer.start(proxy_config(handle.url, **kw), tok, scorers=scorers)
    try:
        yield srv
    finally:
        await srv.stop()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def key_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
