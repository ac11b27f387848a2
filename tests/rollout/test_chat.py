"""Template-difference prompts: no retokenization drift, end-of-turn handling, prefix checks."""

import pytest

from rollout.chat import CHATML_TEMPLATE, JinjaChatTokenizer, PromptBuilder, PromptDriftError, check_extends

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Map:\nP _ G\nmove?"}]


def _render_ids(tok, msgs):
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))


def test_assistant_close_found(prompts, tok):
    assert prompts.assistant_close == "<|im_end|>\n"
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]


@pytest.mark.parametrize("with_eos", [True, False])
def test_multi_turn_prompt_equals_full_rendering(prompts, tok, with_eos):
    """prompt + sampled (+EOT if missing) + delta == encode(render(whole conversation))."""
    msgs = list(MSGS)
    prompt = prompts.initial(msgs)
    assert prompt == _render_ids(tok, msgs)
    for turn, answer in enumerate(["```Left```", "I go ```Up```", "```down```"]):
        sampled = tok.encode(answer) + ([tok.eos_token_id] if with_eos else [])
        new = [{"role": "user", "content": f"You moved. turn {turn}\nP _ G"}]
        tail = prompts.continuation(msgs, answer, new, sampled)
        nxt = prompt + sampled + tail
        check_extends(prompt, nxt)
        msgs = [*msgs, {"role": "assistant", "content": answer}, *new]
        assert nxt == _render_ids(tok, msgs)
        # the end-of-turn token appears exactly once after the sampled tokens
        assert (sampled + tail)[len(tok.encode(answer))] == tok.eos_token_id
        prompt = nxt


def test_tool_role_messages(prompts, tok):
    sampled = tok.encode("```Left```") + [tok.eos_token_id]
    new = [{"role": "tool", "content": "ok"}, {"role": "user", "content": "next"}]
    tail = prompts.continuation(MSGS, "```Left```", new, sampled)
    full = [*MSGS, {"role": "assistant", "content": "```Left```"}, *new]
    assert prompts.initial(MSGS) + sampled + tail == _render_ids(tok, full)


def test_non_prefix_stable_template_rejected(tok):
    # A template that rewrites the last assistant turn depending on what follows.
    tpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
           "{% if m['role'] == 'assistant' and loop.last %}[final]{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    bad = JinjaChatTokenizer(tok.tokenizer, tpl)
    pb = PromptBuilder(bad)
    with pytest.raises(PromptDriftError, match="prefix-stable"):
        pb.continuation(MSGS, "x", [{"role": "user", "content": "y"}], [5, bad.eos_token_id])


def test_check_extends_reports_first_difference():
    check_extends([1, 2], [1, 2, 3])
    with pytest.raises(PromptDriftError, match="token 1"):
        check_extends([1, 2, 3], [1, 5, 3, 4])
    with pytest.raises(PromptDriftError):
        check_extends([1, 2, 3], [1, 2])


def test_template_must_render_content(tok):
    bad = JinjaChatTokenizer(tok.tokenizer, "{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ValueError, match="verbatim"):
        PromptBuilder(bad)


def test_chatml_constant_renders(tok):
    assert JinjaChatTokenizer(tok.tokenizer, CHATML_TEMPLATE).apply_chat_template(MSGS, True).endswith(
        "<|im_start|>assistant\n")
