"""The generation server over real HTTP on loopback: OpenAI SDK, vLLM / SGLang extension fields."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from jaxprm.serve.sampling import SamplingParams
from jaxprm.serve.static_sampler import StaticSampler

PROMPT = "You are walking on a frozen lake."


def test_models_and_health(client, http, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert http.get("/get_weight_version").json()["weight_version"] == server.weight_version


def test_completion_greedy_matches_the_sampler(client, http, server, tiny):
    _, tok = tiny
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and isinstance(ch.text, str)
    ids = tok.encode(PROMPT, add_special_tokens=True)
    direct = StaticSampler(server.sampler).generate([ids], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    assert ch.text == tok.decode(direct.token_ids)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(direct.token_ids)
    assert r.usage.total_tokens == len(ids) + len(direct.token_ids)


def test_completion_logprobs_n_and_seed(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, logprobs=2, seed=11,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(1 <= len(d) <= 3 for d in lp.top_logprobs)
        assert c.finish_reason == "length"
    texts = [c.logprobs.tokens for c in r.choices]
    assert texts[0] != texts[1] or texts[1] != texts[2]
    again = client.completions.create(**kw)
    assert [c.logprobs.tokens for c in again.choices] == texts
    np.testing.assert_allclose([c.logprobs.token_logprobs for c in again.choices],
                               [c.logprobs.token_logprobs for c in r.choices], atol=1e-5)


def test_chat_completion_with_logprobs(client, http, tiny):
    _, tok = tiny
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Which action?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.7, seed=3,
                                       logprobs=True, top_logprobs=2)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
    content = ch.logprobs.content
    assert 1 <= len(content) <= 8 and r.usage.completion_tokens == len(content)
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.bytes == list(item.token.encode())
    # vLLM extension fields through raw HTTP
    body = http.post("/v1/chat/completions", json=dict(model="tiny", messages=msgs, max_tokens=8, temperature=0.7,
                                                          seed=3, logprobs=True, return_token_ids=True)).json()
    expected_prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    assert body["prompt_token_ids"] == expected_prompt
    c = body["choices"][0]
    assert len(c["token_ids"]) == len(c["logprobs"]["content"])
    # the same tokens; log-probs equal to float rounding (the second request reuses cached KV)
    np.testing.assert_allclose([x["logprob"] for x in c["logprobs"]["content"]], [x.logprob for x in content],
                               atol=1e-5)
    assert body["weight_version"] == 0 or isinstance(body["weight_version"], int)


def test_completion_token_ids_in_and_out(http, tiny):
    _, tok = tiny
    ids = tok.encode(PROMPT)
    body = http.post("/v1/completions", json=dict(model="tiny", prompt=ids, max_tokens=8, temperature=0.9, seed=5,
                                                  logprobs=0, return_token_ids=True, ignore_eos=True)).json()
    c = body["choices"][0]
    assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 8
    assert c["text"] == tok.decode(c["token_ids"])
    assert len(c["logprobs"]["token_logprobs"]) == 8
    # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    body = http.post("/v1/completions", json=dict(prompt=ids, max_tokens=8, temperature=0.9, seed=5, logprobs=1,
                                                  return_tokens_as_token_ids=True, ignore_eos=True)).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    assert all(k.startswith("token_id:") for d in lp["top_logprobs"] for k in d)
    # batch of token-id prompts: choices ordered prompt-major
    body = http.post("/v1/completions", json=dict(prompt=[ids, ids[:3]], n=2, max_tokens=4, temperature=0,
                                                  return_token_ids=True)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [len(c["prompt_token_ids"]) for c in body["choices"]] == [len(ids), len(ids), 3, 3]
    assert body["choices"][0]["token_ids"] == body["choices"][1]["token_ids"]  # greedy


def test_logprobs_modes(http):
    def lps(mode, temperature):
        body = http.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=6, temperature=temperature, seed=9,
                                                      logprobs=0, logprobs_mode=mode, return_token_ids=True,
                                                      ignore_eos=True)).json()
        return body["choices"][0]["token_ids"], body["choices"][0]["logprobs"]["token_logprobs"]

    t_raw, raw = lps("raw", 0.5)
    t_proc, proc = lps("processed", 0.5)
    assert t_raw == t_proc and not np.allclose(raw, proc)
    t1_raw, raw1 = lps("raw", 1.0)
    _, proc1 = lps("processed", 1.0)
    np.testing.assert_allclose(raw1, proc1, atol=1e-6)


def test_generate_sglang_shapes(http, tiny, server):
    _, tok = tiny
    ids = tok.encode(PROMPT)
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.8,
                                                                         "top_k": 20, "ignore_eos": True, "seed": 1},
                                     "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert out["output_ids"] == [x[1] for x in meta["output_token_logprobs"]]
    assert all(len(x) == 3 and x[0] <= 0 and isinstance(x[2], str) for x in meta["output_token_logprobs"])
    assert len(meta["output_top_logprobs"]) == 6 and all(len(pos) == 2 for pos in meta["output_top_logprobs"])
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6
    assert meta["weight_version"] == server.weight_version
    assert out["text"] == tok.decode(out["output_ids"])
    # text input, batched input and n > 1 return lists
    single = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}).json()
    assert isinstance(single, dict) and "output_token_logprobs" not in single["meta_info"]
    batch = http.post("/generate", json={"input_ids": [ids, ids[:2]], "sampling_params": {"max_new_tokens": 4}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    many = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 3}}).json()
    assert isinstance(many, list) and len(many) == 3


def test_stop_strings_and_stop_token_ids(http, tiny):
    _, tok = tiny
    base = dict(prompt=PROMPT, max_tokens=32, temperature=1.0, seed=21, ignore_eos=True, return_token_ids=True)
    full = http.post("/v1/completions", json=base).json()["choices"][0]
    ids, text = full["token_ids"], full["text"]
    # a stop token id in the middle
    stop_id = ids[5]
    first = ids.index(stop_id)
    c = http.post("/v1/completions", json=dict(base, stop_token_ids=[stop_id])).json()["choices"][0]
    assert c["token_ids"] == ids[: first + 1] and c["finish_reason"] == "stop" and c["stop_reason"] == stop_id
    # a stop string taken from the middle of the text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "degenerate sample text"
    c = http.post("/v1/completions", json=dict(base, stop=[stop])).json()["choices"][0]
    assert c["text"] == text[: text.index(stop)] and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    assert stop in tok.decode(c["token_ids"]) and c["token_ids"] == ids[: len(c["token_ids"])]


def test_concurrent_requests_are_batched(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            reqs = [c.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=8, seed=i, ignore_eos=True))
                    for i in range(16)]
            return await asyncio.gather(*reqs)

    before = server.app.state.server.engine.stats.max_rows_in_batch
    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses)
    assert len({r.json()["choices"][0]["text"] for r in responses}) > 1
    stats = server.app.state.server.engine.stats
    assert max(before, stats.max_rows_in_batch) >= 4


def test_update_weights_in_process_and_from_disk(http, server, tiny, tmp_path):
    import jax
    from flax import nnx

    from jaxprm.models import save_pretrained
    from jaxprm.serve import ServerHandle

    model, tok = tiny
    req = dict(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
    before = http.post("/v1/completions", json=req).json()
    v0 = before["weight_version"]
    # a perturbed copy of the model saved as a Hugging Face checkpoint
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), state)
    save_pretrained(nnx.merge(graphdef, state), tok, tmp_path / "ckpt")
    # loading from disk needs a weights root (jaxprm.serve.weights): the same sampler, served with one
    with ServerHandle.from_sampler(server.sampler, tok, model_name="tiny", weights_roots=(str(tmp_path),)) as h:
        r = httpx.post(h.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "ckpt")}, timeout=120)
        assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == v0 + 1
        # a bad path keeps the weights and the version
        r = httpx.post(h.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")}, timeout=60)
        assert r.status_code == 400 and r.json()["success"] is False
    after = http.post("/v1/completions", json=req).json()
    assert after["weight_version"] == v0 + 1
    assert after["choices"][0]["logprobs"]["token_logprobs"] != before["choices"][0]["logprobs"]["token_logprobs"]
    assert http.get("/get_weight_version").json()["weight_version"] == v0 + 1
    # in-process swap back to the original
    assert server.update_weights(model) == v0 + 2
    restored = http.post("/v1/completions", json=req).json()
    assert restored["weight_version"] == v0 + 2
    np.testing.assert_allclose(restored["choices"][0]["logprobs"]["token_logprobs"],
                               before["choices"][0]["logprobs"]["token_logprobs"], atol=1e-6)


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/v1/completions", b"{not json", 400, "malformed JSON"),
        ("/v1/completions", b"[1, 2]", 400, ""),
        ("/v1/completions", {"model": "gpt-17", "prompt": "hi"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "out of vocabulary"),
        ("/v1/completions", {"prompt": [-1, 2]}, 400, "out of vocabulary"),
        ("/v1/completions", {"prompt": []}, 400, "empty"),
        ("/v1/completions", {"prompt": [5] * 2100}, 400, "context length"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "context length"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n must be"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7]}, 400, "stop token"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(100))}, 400, "at most 32 stop token ids"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "logprobs"),
        ("/generate", {"sampling_params": {"max_new_tokens": 3}}, 400, "text"),
        ("/generate", {"text": "hi", "input_ids": [1], "sampling_params": {}}, 400, "exactly one"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}}, 400, "context"),
        ("/update_weights_from_disk", {}, 400, "model_path"),
    ],
)
def test_bad_requests_get_clear_4xx(http, path, body, status, needle):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status
    assert http.get("/health").status_code == 200


def test_body_size_limit_and_unknown_routes(http):
    r = http.post("/v1/completions", content=b"{" + b" " * (5 * 1024 * 1024) + b"}",
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while the body streams in
        yield b'{"prompt": "'
        for _ in range(60):
            yield b"x" * (100 * 1024)
        yield b'"}'

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert http.get("/v1/nothing").status_code == 404
    assert http.get("/v1/completions").status_code == 405
    assert http.get("/health").status_code == 200


def test_api_key(server, tiny):
    import openai

    from jaxprm.serve import ServerHandle

    _, tok = tiny
    with ServerHandle.from_sampler(server.sampler, tok, model_name="tiny", api_key="s3cret") as guarded:
        with httpx.Client(base_url=guarded.url, timeout=60) as h:
            assert h.get("/health").status_code == 200
            assert h.get("/v1/models").status_code == 401
            r = h.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        ok = openai.OpenAI(base_url=guarded.base_url, api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None
        bad = openai.OpenAI(base_url=guarded.base_url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
