"""Function tools through the recording proxy with the official openai SDK: calls parsed into
``message.tool_calls`` (plain and streamed), tool results as prompt tokens of the next turn, the
concat rule token-exact against a replay, and hostile tool input answered with a 4xx or as content.

The upstream is the scripted generation server (``rollout.testing``) with a Hermes-template
tokenizer, so the model's turns are known: a call, then an answer."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pytest

from rollout.chat import TOOLS_TEMPLATE, PromptBuilder
from rollout.client import ClientConfig
from rollout.proxy import ProxyConfig, ProxyServer
from rollout.testing import ScriptedServer, ServerScript, make_test_tokenizer, turn_script_policy

from .conftest import ADMIN

MOVE = {"type": "function", "function": {"name": "move", "description": "Move one cell.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "enum": ["Up", "Down", "Left", "Right"]}},
    "required": ["direction"]}}}
SYS = {"role": "system", "content": "Reach G."}
USER = {"role": "user", "content": "P _\n_ G"}
CALL = '<tool_call>\n{"name": "move", "arguments": {"direction": "Right"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return make_test_tokenizer(template=TOOLS_TEMPLATE)


def run(tok, turns, fn, **config):
    """Start a scripted upstream answering ``turns`` and a proxy on it; ``await fn(srv)``."""
    async def go():
        with ScriptedServer(ServerScript(policy=turn_script_policy(tok, turns)), tok) as up:
            cfg = ProxyConfig(upstream=ClientConfig(endpoints=(up.url,), timeout_s=30, max_retries=0),
                              admin_key=ADMIN, default_max_tokens=256, **config)
            srv = await ProxyServer.start(cfg, tok)
            try:
                return await fn(srv)
            finally:
                await srv.stop()
    return asyncio.run(go())


def test_a_tool_call_and_its_result_continue_token_exactly(tok):
    async def go(srv):
        _, (s,) = srv.proxy.start_session("tools")
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
            first = await client.chat.completions.create(model="m", messages=[SYS, USER], tools=[MOVE])
            call = first.choices[0].message.tool_calls[0]
            msgs = [SYS, USER, first.choices[0].message.model_dump(),  # as the SDK's users echo it (nulls included)
                    {"role": "tool", "tool_call_id": call.id, "content": "P moved right.\n_ P\n_ G"}]
            second = await client.chat.completions.create(model="m", messages=msgs, tools=[MOVE])
        srv.proxy.set_reward(s, {"reward": 1.0})
        exported = await srv.proxy.export({"session_ids": [s.id]})
        return s, first, second, msgs, exported

    s, first, second, msgs, exported = run(tok, [CALL, "Done: I reached G."], go)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "move"
    assert json.loads(call.function.arguments) == {"direction": "Right"}
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "Done: I reached G."
    r1, r2 = s.records.values()
    assert r2.parent is r1 and r1.text == CALL  # the echoed assistant message found its record
    # the trained tokens are what the model generated, markup included
    assert tok.decode(r1.response.output_tokens.tolist()) == CALL
    # concat: the second prompt extends the first turn's tokens; a replay renders the same tokens
    head = np.concatenate([r1.response.input_tokens, r1.response.output_tokens])
    assert np.array_equal(r2.response.input_tokens[:len(head)], head)
    replay = PromptBuilder(tok).initial(msgs, [MOVE])
    assert r2.response.input_tokens.tolist() == replay
    assert "<tool_response>\nP moved right." in tok.decode(r2.response.input_tokens.tolist())
    (row,) = exported.rows  # one row: both turns, the tool result as prompt (mask 0)
    trained = row.tokens[row.loss_mask > 0].tolist()
    assert trained == [*r1.response.output_tokens.tolist(), *r2.response.output_tokens.tolist()]


def test_streamed_tool_calls_accumulate_in_the_sdk(tok):
    async def go(srv):
        _, (s,) = srv.proxy.start_session("stream")
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
            async with client.beta.chat.completions.stream(model="m", messages=[SYS, USER], tools=[MOVE]) as stream:
                async for _ in stream:
                    pass
                final = await stream.get_final_completion()
            stats = srv.proxy.stats()
        return final, stats

    final, stats = run(tok, ["Let me move.\n" + CALL + "\n" + CALL.replace("Right", "Down")], go)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me move.\n"
    assert [json.loads(c.function.arguments)["direction"] for c in choice.message.tool_calls] == ["Right", "Down"]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert stats["tool_calls"] == 2


def test_tool_choice_named_prefills_the_call_and_parallel_false_keeps_one(tok):
    rest = '{"direction": "Up"}}\n</tool_call>\n' + CALL

    async def go(srv):
        _, (s,) = srv.proxy.start_session("named")
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
            out = await client.chat.completions.create(
                model="m", messages=[SYS, USER], tools=[MOVE], parallel_tool_calls=False,
                tool_choice={"type": "function", "function": {"name": "move"}})
        return s, out

    s, out = run(tok, [rest], go)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "move" and json.loads(call.function.arguments) == {"direction": "Up"}
    (rec,) = s.records.values()
    prompt = tok.decode(rec.response.input_tokens.tolist())
    assert prompt.endswith('<tool_call>\n{"name": "move", "arguments": ')  # the prefill is prompt, not trained
    assert tok.decode(rec.response.output_tokens.tolist()) == rest


def test_hostile_tool_input_is_a_4xx_or_content(tok):
    async def go(srv):
        _, (s,) = srv.proxy.start_session("hostile")
        statuses = []
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
            for kw in ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
                       {"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]},
                       {"tools": [MOVE], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
                       {"tools": [MOVE], "messages": [SYS, USER, {"role": "tool", "tool_call_id": "call_x",
                                                                  "content": "?"}]},
                       {"tools": [MOVE], "messages": [SYS, {"role": "user", "content": "x" * 200_000}]}):
                kw.setdefault("messages", [SYS, USER])
                try:
                    await client.chat.completions.create(model="m", **kw)
                    statuses.append(200)
                except openai.APIStatusError as e:
                    statuses.append(e.status_code)
            half = await client.chat.completions.create(model="m", messages=[SYS, USER], tools=[MOVE])
        return statuses, half, srv.proxy.stats()

    statuses, half, stats = run(tok, ['<tool_call>\n{"name": "move", "arguments": {"dir'], go,
                                max_context_tokens=4096)
    assert all(400 <= st < 500 for st in statuses), statuses
    assert half.choices[0].finish_reason == "stop" and half.choices[0].message.tool_calls is None
    assert half.choices[0].message.content.startswith("<tool_call>")  # half a call comes back as content
    assert stats["tool_call_parse_failures"] == 1


def test_a_template_without_tools_is_a_400_naming_it():
    plain = make_test_tokenizer()  # ChatML without tool support

    async def go(srv):
        _, (s,) = srv.proxy.start_session("plain")
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="does not render tools") as e:
                await client.chat.completions.create(model="m", messages=[SYS, USER], tools=[MOVE])
        return e.value

    err = run(plain, ["hi"], go)
    assert "JinjaChatTokenizer" in str(err)


def test_responses_api_with_function_tools_and_previous_response_id(tok):
    """The Responses API: a call, its output by previous_response_id, the answer; streamed too; the
    turns recorded as one conversation, token-exact like chat."""
    tool = {"type": "function", "name": "move", "description": "Move one cell.",
            "parameters": MOVE["function"]["parameters"]}

    async def go(srv):
        _, (s,) = srv.proxy.start_session("responses")
        async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=s.api_key, max_retries=0) as client:
            first = await client.responses.create(model="m", instructions=SYS["content"], input=USER["content"],
                                                  tools=[tool])
            call = first.output[0]
            second = await client.responses.create(
                model="m", instructions=SYS["content"], previous_response_id=first.id, tools=[tool],
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "P moved right."}])
            events = [e async for e in await client.responses.create(
                model="m", instructions=SYS["content"], input=USER["content"], tools=[tool], stream=True)]
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await client.responses.create(model="m", previous_response_id="resp_unknown", input="x")
            with pytest.raises(openai.BadRequestError, match="only function tools"):
                await client.responses.create(model="m", input="x", tools=[{"type": "web_search"}])
        return s, first, second, events

    s, first, second, events = run(tok, [CALL, "Done."], go)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    assert first.output[0].name == "move" and json.loads(first.output[0].arguments) == {"direction": "Right"}
    assert second.output_text == "Done." and second.usage.input_tokens > first.usage.input_tokens
    r1, r2, r3 = s.records.values()
    assert first.id == r1.id and second.id == r2.id and r2.parent is r1  # previous_response_id continues the record
    head = np.concatenate([r1.response.input_tokens, r1.response.output_tokens])
    assert np.array_equal(r2.response.input_tokens[:len(head)], head)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and r3.parent is None
    done = events[-1].response
    assert done.id == r3.id and done.output[0].type == "function_call"
