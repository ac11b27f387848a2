"""Tokenizer: tiny BPE determinism and coverage, encode/decode, chat templates vs transformers."""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxprm.models import Tokenizer, build_tiny_tokenizer

# A template in the style of tool-calling chat formats: namespace, loop controls, tojson,
# raise_exception, bos/eos tokens and extra variables.
TOOL_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system=none) -%}
{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- endif -%}
{%- if tools %}<|im_start|>system
{{ ns.system or 'You are helpful.' }}
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif ns.system is not none %}<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif %}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}{%- continue -%}{%- endif -%}
  {%- if message['role'] not in ['user', 'assistant', 'tool'] -%}
    {{ raise_exception('unknown role ' + message['role']) }}
  {%- endif -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}{% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{% endif %}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>
{% endif %}{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You play FrozenLake."},
    {"role": "user", "content": "Map:\nP _ O\n_ _ G\nYou are at row 0, column 0. What is your move?"},
    {"role": "assistant", "content": "Going down. ```Down```"},
    {"role": "user", "content": "You moved Down.\nMap:\n_ _ O\nP _ G"},
]
TOOLS = [{"type": "function", "function": {"name": "move", "description": "Move <safely> & well",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer):
    return tiny_tokenizer  # this module's tests only need the tokenizer


@pytest.fixture(scope="module")
def smollm2_template():
    from jaxprm.models.gguf_io import _open
    from jaxprm.models.loading import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return _open(path)[1].get("tokenizer.chat_template")


def test_tiny_tokenizer_is_deterministic_and_task_sized(tiny):
    again = build_tiny_tokenizer()
    assert again.backend.to_str() == tiny.backend.to_str()
    assert tiny.vocab_size == 512
    assert [tiny.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    text = tiny.apply_chat_template(MESSAGES)
    ids = tiny.encode(text)
    # FrozenLake text is compact: about one token per 3 characters.
    assert len(ids) < len(text) / 2.5
    for word in ("Left", "Right", "Down", "Up", "```"):
        assert tiny.token_to_id(word) is not None, word
    assert tiny.encode("<|im_start|>user\n")[0] == 1


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_encode_decode_round_trip_any_text(tiny, text):
    ids = tiny.encode(text)
    assert all(0 <= i < tiny.vocab_size for i in ids)
    assert tiny.decode(ids, skip_special_tokens=False) == text


def test_decode_skips_special_tokens(tiny):
    ids = tiny.encode("<|im_start|>assistant\n```Up```<|im_end|>")
    assert tiny.decode(ids) == "assistant\n```Up```"
    assert tiny.decode(ids, skip_special_tokens=False).endswith("<|im_end|>")
    assert tiny.apply_chat_template(MESSAGES[:2], tokenize=True) == tiny.encode(
        tiny.apply_chat_template(MESSAGES[:2]))


@pytest.mark.parametrize("template_name", ["tiny", "tools", "smollm2"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tiny, template_name, add_generation_prompt, request):
    transformers = pytest.importorskip("transformers")
    if template_name == "tiny":
        template = tiny.chat_template
    elif template_name == "tools":
        template = TOOL_TEMPLATE
    else:
        template = request.getfixturevalue("smollm2_template")
    ours = Tokenizer(tiny.backend, chat_template=template, bos_token="<|im_start|>",
                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ours.backend, chat_template=template, bos_token="<|im_start|>",
        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    for messages in (MESSAGES, MESSAGES[1:2], MESSAGES[:3]):
        for extra in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
            expected = hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=add_generation_prompt, **extra)
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
            assert got == expected, (template_name, extra)


def test_template_errors_and_missing_template(tiny):
    ours = Tokenizer(tiny.backend, chat_template=TOOL_TEMPLATE, eos_token="<|im_end|>")
    with pytest.raises(jinja2.TemplateError, match="unknown role"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer(tiny.backend, eos_token="<|im_end|>").apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="vocabulary"):
        Tokenizer(tiny.backend, eos_token="<|nope|>")


def test_from_dir_reads_jinja_file_and_generation_config(tiny, tmp_path):
    tiny.save(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.chat_template == TOOL_TEMPLATE
    assert loaded.eos_token_ids == {0, 2, 7}
    assert loaded.eos_token_id == 2 and loaded.pad_token_id == 0
