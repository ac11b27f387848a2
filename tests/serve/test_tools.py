"""Function tools on the embedded server (``/v1/chat/completions``): a tiny model fine-tuned in the
test to answer with a Hermes tool call, served over loopback; calls come back parsed (plain and
streamed, through the openai SDK's accumulator), ``tool_choice`` none / named behave, a template
without tool support is a 400 naming the model, and half a call is content, counted in /metrics."""

from __future__ import annotations

import copy
import json

import openai
import pytest

from jaxprm.models import load_model
from jaxprm.serve import ServerHandle
from rollout.chat import CHATML_TEMPLATE

from .conftest import SAMPLER_KW

MOVE = {"type": "function", "function": {"name": "move", "description": "Move one cell.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "enum": ["Up", "Down", "Left", "Right"]}},
    "required": ["direction"]}}}
MSGS = [{"role": "user", "content": "P _\n_ G"}]
CALL = '<tool_call>\n{"name": "move", "arguments": {"direction": "Right"}}\n</tool_call>'
KW = dict(sampler_kwargs={**SAMPLER_KW, "prompt_buckets": (640,), "new_token_buckets": (64,)})


@pytest.fixture(scope="module")
def tool_server():
    """The tiny model after 30 SFT steps on one conversation that answers ``CALL``."""
    from jaxprm.train.policy import Policy
    from jaxprm.train.warmstart import Demo, sft

    model, tok = load_model("tiny")
    prompt = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True, tools=[MOVE])
    answer = [*tok.encode(CALL), tok.eos_token_id]
    policy = Policy(model, tok)
    demo = Demo(tokens=[*prompt, *answer], mask=[0.0] * len(prompt) + [1.0] * len(answer), success=True, turns=1)
    params, losses = sft(policy.apply_fn, policy.params, [demo], steps=30, batch_size=1, lr=2e-2, seed=0,
                         len_buckets=(512,))
    assert losses[-1] < 0.05, losses
    with ServerHandle.start(policy.module(params), tok, model_name="tiny-tools", **KW) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_a_call_comes_back_parsed(client, tool_server):
    out = client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=[MOVE], temperature=0,
                                         max_tokens=64, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "move"
    assert json.loads(call.function.arguments) == {"direction": "Right"}
    # the sampled tokens are the markup (what a trainer trains on), then <|im_end|>
    _, tok = load_model("tiny")
    ids = choice.model_extra["token_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == CALL + "<|im_end|>"


def test_streamed_calls_accumulate_in_the_sdk(client):
    with client.beta.chat.completions.stream(model="tiny-tools", messages=MSGS, tools=[MOVE], temperature=0,
                                             max_tokens=64) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["move"]
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"direction": "Right"}


def test_tool_choice_none_returns_the_markup_as_content(client):
    out = client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=[MOVE], tool_choice="none",
                                         temperature=0, max_tokens=64)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == CALL
    assert not out.choices[0].message.tool_calls


def test_named_tool_choice_prefills_the_call(client, tool_server):
    out = client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=[MOVE], temperature=0,
                                         max_tokens=64, tool_choice={"type": "function", "function": {"name": "move"}},
                                         extra_body={"return_token_ids": True})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "move" and json.loads(call.function.arguments) == {"direction": "Right"}
    _, tok = load_model("tiny")
    prompt = tok.decode(out.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "move", "arguments": ')


def test_half_a_call_is_content_and_counted(client, tool_server, http_for):
    out = client.chat.completions.create(model="tiny-tools", messages=MSGS, tools=[MOVE], temperature=0,
                                         max_tokens=20)
    assert out.choices[0].finish_reason == "length" and out.choices[0].message.tool_calls is None
    assert out.choices[0].message.content.startswith("<tool_call>")
    metrics = http_for(tool_server).get("/metrics").text
    failures = [ln for ln in metrics.splitlines() if ln.startswith("jaxprm:tool_call_parse_failures_total")]
    assert failures and float(failures[0].split()[-1]) >= 1


def test_hostile_tool_input_is_a_400(client):
    bad = [
        {"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]},
        {"tools": [{"type": "function"}]},
        {"tools": [MOVE], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
        {"tools": [MOVE], "messages": [*MSGS, {"role": "tool", "tool_call_id": "call_nothing", "content": "?"}]},
        {"tool_choice": "required"},
    ]
    for kw in bad:
        kw.setdefault("messages", MSGS)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny-tools", max_tokens=4, **kw)


def test_a_template_without_tools_is_a_400_naming_the_model():
    model, tok = load_model("tiny")
    plain = copy.copy(tok)
    plain.chat_template = CHATML_TEMPLATE
    with ServerHandle.start(model, plain, model_name="plain-chatml", **KW) as handle:
        c = openai.OpenAI(base_url=handle.base_url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="'plain-chatml' does not render tools"):
            c.chat.completions.create(model="plain-chatml", messages=MSGS, tools=[MOVE], max_tokens=4)


@pytest.fixture
def http_for():
    import httpx

    clients = []

    def make(handle):
        clients.append(httpx.Client(base_url=handle.url, timeout=60))
        return clients[-1]

    yield make
    for c in clients:
        c.close()


def test_responses_api_calls_continue_and_stream(client):
    tool = {"type": "function", "name": "move", "description": "Move one cell.",
            "parameters": MOVE["function"]["parameters"]}
    first = client.responses.create(model="tiny-tools", input=MSGS[0]["content"], tools=[tool], temperature=0,
                                    max_output_tokens=64)
    (call,) = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "move"
    assert json.loads(call.arguments) == {"direction": "Right"} and call.call_id.startswith("call_")
    second = client.responses.create(model="tiny-tools", previous_response_id=first.id, tools=[tool], temperature=0,
                                     max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}])
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    events = list(client.responses.create(model="tiny-tools", input=MSGS[0]["content"], tools=[tool],
                                          temperature=0, max_output_tokens=64, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny-tools", previous_response_id="resp_nope", input="x")
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        client.responses.create(model="tiny-tools", input="x", tools=[{"type": "file_search"}])


def test_a_streamed_response_sends_its_text_as_it_is_generated(client):
    """``/v1/responses`` with ``stream``: the text arrives in several ``output_text.delta`` events
    (one per engine delta), their concatenation is the final text, which is the unstreamed answer's
    (greedy), read through the SDK's stream helper; a streamed response can be continued by
    ``previous_response_id``."""
    kw = dict(model="tiny-tools", input="Describe the lake.", temperature=0, max_output_tokens=24)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:  # the SDK's helper: its accumulator checks each event
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text == events[-1].response.output_text
    assert events[-1].response.output[0].id == events[2].item.id
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    later = client.responses.create(model="tiny-tools", previous_response_id=events[-1].response.id, input="More.",
                                    temperature=0, max_output_tokens=4)
    assert later.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
