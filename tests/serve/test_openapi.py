"""A true OpenAPI document (issue 19, item 2): the error status the server uses (400, never 422)
in the OpenAI error shape, 405 with ``Allow``, a response model for every route, strict request
types; and schemathesis over the served ``/openapi.json`` finds no server error and no answer
that breaks the document (a bounded number of examples; ``python -m benchmarks.fuzz_server`` is
the long run)."""

from __future__ import annotations

import pytest

from jaxprm.serve import ServerHandle

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def doc(http):
    return http.get("/openapi.json").json()


def _operations(doc):
    return [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()]


def test_errors_are_documented_as_answered(doc):
    ops = _operations(doc)
    assert len(ops) == 14
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, method, op in ops:
        responses = op["responses"]
        assert "422" not in responses, (path, method)
        assert responses["500"]["content"]["application/json"]["schema"] == error_ref
        if "requestBody" in op:
            bad = responses["400"]["content"]["application/json"]["schema"]
            assert bad == error_ref or error_ref in bad["anyOf"], (path, method)
            assert "413" in responses
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert sorted(detail["required"]) == ["code", "message", "param", "type"]


def test_every_success_body_has_a_schema(doc):
    for path, method, op in _operations(doc):
        content = op["responses"]["200"]["content"]
        if path == "/metrics":
            assert list(content) == ["text/plain"]
            continue
        schema = content["application/json"]["schema"]
        assert schema != {} and ("$ref" in schema or "anyOf" in schema), (path, method, schema)
        if method == "post" and path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            assert "text/event-stream" in content
    schemas = doc["components"]["schemas"]
    choice = schemas["CompletionChoice"]
    assert choice["additionalProperties"] is False and "token_ids" not in choice["required"]
    assert choice["properties"]["token_ids"]["type"] == "array"  # absent unless asked, never null
    assert schemas["GenerateMeta"]["properties"]["finish_reason"]["discriminator"]["propertyName"] == "type"


def test_405_names_the_allowed_methods(http):
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("DELETE", "/flush_cache", "GET, POST"),
                                  ("PUT", "/health", "GET"), ("GET", "/generate", "POST")):
        r = http.request(method, path)
        assert r.status_code == 405 and r.headers["allow"] == allowed
        err = r.json()["error"]
        assert err["code"] == 405 and err["type"] == "MethodNotAllowedError" and allowed in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [True, 2]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 1.0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": "1"}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": 1, "content": "hi"}]}, "messages.0.role"),
    ("/generate", {"input_ids": [1.0, 2.0]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": True}, "weight_version"),
    ("/pause_generation", {"mode": 1}, "mode"),
])
def test_types_are_strict(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and err["code"] == 400


def test_integers_are_numbers(http):
    """A JSON integer is a valid number (``temperature: 1``), as the document says."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 1})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------
# schemathesis over the served document


@pytest.fixture(scope="module")
def fuzz_server(server, tiny):
    """A server of its own (the session server's sampler, its own engine and a small KV pool), so
    that fuzzed control calls (pause, flush) touch nobody else."""
    with ServerHandle.from_sampler(server.sampler, tiny[1], model_name="tiny", kv_cache_tokens=8192,
                                   request_timeout_s=120) as h:
        yield h


RICH = [  # every optional part of the answers: token ids, log-probs, alternatives, batches, streams
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2, "logprobs": 3, "return_token_ids": True,
                         "top_k": 2, "stop": ["x"], "echo": False, "seed": 1}),
    ("/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 2, "return_tokens_as_token_ids": True,
                         "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                              "return_token_ids": True, "top_p": 0.5}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2, "stream": True, "logprobs": True,
                              "stream_options": {"include_usage": True}}),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
                   "sampling_params": {"max_new_tokens": 3, "top_k": 1, "stop": "z"}}),
    ("/generate", {"input_ids": [[5, 6], [7]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"text": "hi", "stream": True, "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/responses", {"instructions": "be brief", "max_output_tokens": 3, "input": [  # (tools: too long a prompt)
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}),
]


def test_rich_answers_conform_to_the_document(fuzz_server):
    """Answers with every optional field conform (schemathesis' checks; streamed events included)."""
    import schemathesis
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    for path, body in RICH:
        case = schema[path]["POST"].Case(body=body, media_type="application/json")
        response = case.call(base_url=fuzz_server.url, timeout=120)
        assert response.status_code == 200, response.text
        case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                 response_schema_conformance])


def test_schemathesis_finds_no_server_error(fuzz_server):
    from benchmarks.fuzz_server import fuzz

    report = fuzz(fuzz_server.url, max_examples=150, seed=19)
    assert report["cases"] >= 150 and len(report["operations"]) == 14
    assert report["server_errors"] == 0 and report["failures"] == [], report["failures"][:5]
    assert report["statuses"].get("200", 0) > 0 and report["statuses"].get("400", 0) > 0
