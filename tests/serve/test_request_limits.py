"""Bounded work per request (issue 19, item 3): a long prompt is tokenized off the event loop
(other requests are answered meanwhile), and ``max_request_tokens`` caps rows x (prompt +
max_tokens) with a clear 400 (a request without ``max_tokens`` gets what fits)."""

from __future__ import annotations

import random
import threading

import httpx
import pytest

from jaxprm.serve import ServerHandle
from jaxprm.serve.serving import ServeConfig


def test_a_long_prompt_does_not_stall_other_requests(server):
    """A 1 MB prompt (its tokenization takes about a second) is answered with a 400 (too long for the
    context); while it is tokenized, /health keeps being answered: counted, not timed."""
    rng = random.Random(0)
    words = ["frozen", "lake", "hole", "goal", "left", "right", "up", "down"]
    text = " ".join(rng.choice(words) for _ in range(200_000))[:1_000_000]
    done = threading.Event()
    answers: list[int] = []

    def poll():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while not done.is_set():
                answers.append(c.get("/health").status_code)

    with httpx.Client(base_url=server.url, timeout=300) as c:
        assert c.get("/health").status_code == 200
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        finally:
            done.set()
            poller.join()
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    # on the event loop, tokenizing blocked every /health until it ended (one or two got through
    # while the body was read); off the loop they go on all the while
    assert answers.count(200) >= 20, len(answers)


@pytest.fixture(scope="module")
def limited(server, tiny):
    with ServerHandle.from_sampler(server.sampler, tiny[1], model_name="tiny", max_request_tokens=64) as h:
        with httpx.Client(base_url=h.url, timeout=120) as c:
            yield c


def test_work_beyond_max_request_tokens_is_a_clear_400(limited):
    ids = list(range(10, 20))  # 10 prompt tokens
    for path, body, param in (
        ("/v1/completions", {"prompt": ids, "n": 4, "max_tokens": 7}, "max_tokens"),  # 4 x (10 + 7) = 68
        ("/v1/completions", {"prompt": [ids, ids], "n": 2, "max_tokens": 7}, "max_tokens"),
        ("/generate", {"input_ids": ids, "sampling_params": {"n": 4, "max_new_tokens": 7}},
         "sampling_params.max_new_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 20}], "n": 2, "max_tokens": 8},
         "max_tokens"),
    ):
        r = limited.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "max_request_tokens" in err["message"] and "limit of 64" in err["message"] and err["param"] == param
    ok = limited.post("/v1/completions", json={"prompt": ids, "n": 4, "max_tokens": 6})  # 4 x 16 = 64
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_without_max_tokens_a_request_gets_what_fits(limited):
    ids = list(range(10, 20))
    r = limited.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                   "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = len(body["prompt_token_ids"])
    assert all(len(c["token_ids"]) == 64 // 2 - prompt for c in body["choices"])
    r = limited.post("/generate", json={"input_ids": ids, "sampling_params": {"n": 8, "max_new_tokens": 1}})
    assert r.status_code == 400  # 8 x (10 + 1) = 88: even one token each does not fit


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(prefill_chunk=128, max_prefill_tokens=64), "max_prefill_tokens: must be >= prefill_chunk (128), got 64"),
    (dict(window_factor=1.1), "window_factor: must be a number >= 1.25"),
    (dict(max_batch=0), "max_batch: must be >= 1"),
    (dict(collect_window_s=-0.001), "collect_window_s: must be >= 0"),
    (dict(kv_cache_tokens=8), "kv_cache_tokens: must be >= block_size (16)"),
    (dict(logprobs_mode="sampled"), "logprobs_mode: must be 'raw' or 'processed'"),
])
def test_serve_config_rejects_bad_values_by_name(kwargs, fragment):
    """The server's options validate themselves once, naming the field (the trainer's ``server``
    section relies on it, renaming the field to its own key)."""
    with pytest.raises(ValueError) as ei:
        ServeConfig(**kwargs)
    assert fragment in str(ei.value)
