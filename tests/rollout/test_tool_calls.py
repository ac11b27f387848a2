"""rollout.tool_calls: parsing calls out of generated text, the request's tools, streaming holds."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout.chat import CHATML_TEMPLATE, TOOLS_TEMPLATE, JinjaChatTokenizer, PromptBuilder
from rollout.testing import make_test_tokenizer
from rollout.tool_calls import (HermesParser, Llama3JsonParser, StreamSplitter, check_tool_messages, get_parser,
                                parse_tool_request, template_renders_tools)

MOVE = {"type": "function", "function": {"name": "move", "description": "Move one cell.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "enum": ["Up", "Down", "Left", "Right"]}},
    "required": ["direction"]}}}
LOOK = {"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}


def error(message, param):
    return ValueError(f"{param}: {message}")


def hermes(name, args, close=True):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n' + ("</tool_call>" if close else "")


def test_hermes_parses_content_and_calls():
    out = HermesParser().parse("I go up.\n" + hermes("move", {"direction": "Up"}) + "\n" + hermes("look", {}))
    assert out.content == "I go up.\n" and not out.failed
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("move", {"direction": "Up"}), ("look", {})]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in out.calls) and out.calls[0].id != out.calls[1].id
    assert out.calls[0].to_openai()["function"] == {"name": "move", "arguments": '{"direction": "Up"}'}


def test_hermes_reads_an_unclosed_last_call_and_calls_only_have_no_content():
    out = HermesParser().parse(hermes("move", {"direction": "Left"}, close=False))
    assert out.content is None and [c.name for c in out.calls] == ["move"]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "move", "arguments": {"direction": "Up"\n',  # half a call
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "move", "arguments": [1]}\n</tool_call>',  # arguments not an object
    hermes("move", {}) + " and then some prose",
])
def test_hermes_markup_that_does_not_parse_is_content(text):
    out = HermesParser().parse(text)
    assert out.failed and out.calls == () and out.content == text


def test_plain_text_is_content_for_every_parser():
    for name in ("hermes", "llama3_json"):
        out = get_parser(name).parse("```Up```")
        assert out.content == "```Up```" and not out.calls and not out.failed


def test_llama3_json_parses_one_or_several_calls():
    p = Llama3JsonParser()
    out = p.parse('<|python_tag|>{"name": "move", "parameters": {"direction": "Up"}}; {"name": "look", "parameters": {}}')
    assert out.content is None and [c.name for c in out.calls] == ["move", "look"]
    assert json.loads(out.calls[0].arguments) == {"direction": "Up"}
    assert p.parse('{"name": "move", "parameters": {"direction": "Up"}} trailing').failed
    assert p.parse('{"name": "move", "parameters": {').failed


def test_get_parser_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"allowed: \['hermes', 'llama3_json'\]"):
        get_parser("mistral")


def test_tool_request_validation():
    assert parse_tool_request(None, None, None, error) is None
    req = parse_tool_request([MOVE, LOOK], None, None, error)
    assert req.choice == "auto" and req.parses and req.parallel and req.prefill(HermesParser()) == ""
    named = parse_tool_request([MOVE], {"type": "function", "function": {"name": "move"}}, False, error)
    assert named.named and named.prefill(HermesParser()) == '<tool_call>\n{"name": "move", "arguments": '
    assert parse_tool_request([MOVE], "required", None, error).prefill(HermesParser()) == "<tool_call>\n"
    assert not parse_tool_request([MOVE], "none", None, error).parses
    bad = [
        ([{"type": "function"}], None, None, "tools"),
        ([{"type": "code_interpreter"}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, None, "tools"),
        ([MOVE, MOVE], None, None, "duplicate"),
        ("move", None, None, "tools"),
        ([MOVE], "sometimes", None, "tool_choice"),
        ([MOVE], {"type": "function", "function": {"name": "fly"}}, None, "not among the tools"),
        (None, "required", None, "tool_choice needs tools"),
        ([MOVE], None, "yes", "parallel_tool_calls"),
    ]
    for tools, choice, parallel, match in bad:
        with pytest.raises(ValueError, match=match):
            parse_tool_request(tools, choice, parallel, error)


def test_named_choice_prefill_completes_into_a_call_and_parallel_false_keeps_one():
    req = parse_tool_request([MOVE], {"type": "function", "function": {"name": "move"}}, False, error)
    out = req.finish(HermesParser(), '{"direction": "Down"}}\n</tool_call>\n' + hermes("move", {"direction": "Up"}))
    assert [json.loads(c.arguments) for c in out.calls] == [{"direction": "Down"}]


def test_tool_messages_must_answer_an_earlier_call():
    call = {"id": "call_1", "type": "function", "function": {"name": "move", "arguments": "{}"}}
    ok = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "moved"}]
    check_tool_messages(ok, error)
    with pytest.raises(ValueError, match="answers no tool call"):
        check_tool_messages([*ok, {"role": "tool", "tool_call_id": "call_2", "content": "?"}], error)
    with pytest.raises(ValueError, match="tool_calls\\[0\\]"):
        check_tool_messages([{"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f"}}]}], error)


def test_template_probe_tells_templates_with_tools_from_those_without():
    tok = make_test_tokenizer()
    with_tools = PromptBuilder(JinjaChatTokenizer(tok.tokenizer, TOOLS_TEMPLATE))
    plain = PromptBuilder(JinjaChatTokenizer(tok.tokenizer, CHATML_TEMPLATE))
    assert template_renders_tools(lambda m, tools: with_tools.render(m, True, tools))
    assert not template_renders_tools(lambda m, tools: plain.render(m, True, tools))


def test_tools_template_without_tools_renders_as_chatml():
    tok = make_test_tokenizer()
    a, b = JinjaChatTokenizer(tok.tokenizer, TOOLS_TEMPLATE), JinjaChatTokenizer(tok.tokenizer, CHATML_TEMPLATE)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    for gen in (True, False):
        assert a.apply_chat_template(msgs, gen) == b.apply_chat_template(msgs, gen)


@given(st.lists(st.text(alphabet="ab<>/_tolcn{}\" :\n", max_size=6), max_size=12), st.booleans())
def test_streamed_content_plus_calls_equal_the_whole_answer(pieces, with_call):
    """Whatever the cut, the streamed content is the content of the whole text and never shows markup."""
    req = parse_tool_request([MOVE], None, None, error)
    if with_call:
        pieces = [*pieces, *[c for c in hermes("move", {"direction": "Up"})]]
    split = StreamSplitter(req, HermesParser())
    sent = "".join(split.feed(p) for p in pieces)
    rest, out = split.finish()
    whole = req.finish(HermesParser(), "".join(pieces))
    assert [c.name for c in out.calls] == [c.name for c in whole.calls]
    assert sent + rest == (whole.content or "") or (whole.content is None and (sent + rest).strip() == "")
    if out.calls:
        assert "<tool_call>" not in sent + rest


@given(st.lists(st.sampled_from(['{"name": "move", ', '"parameters": {"direction": "Up"}}', "; ", "<|python_tag|>",
                                 "I think ", "Up", " "]), max_size=8))
def test_llama3_json_streams_nothing_that_may_become_a_call(pieces):
    """llama3_json holds everything once the answer may be a call; what it streamed is the content."""
    parser = get_parser("llama3_json")
    req = parse_tool_request([MOVE], None, None, error)
    split = StreamSplitter(req, parser)
    sent = "".join(split.feed(p) for p in pieces)
    rest, out = split.finish()
    whole = parser.parse("".join(pieces))
    assert [c.name for c in out.calls] == [c.name for c in whole.calls]
    if out.calls:
        assert sent == "" and rest == ""
    else:
        assert sent + rest == (whole.content or "")
