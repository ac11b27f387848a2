"""Chat templates as token prompts, without retokenization drift (layer 4).

The rollout never re-encodes text the model produced. A multi-turn prompt grows by appending:

    prompt_{t+1} = prompt_t + sampled_t + [end-of-turn if the sampler did not emit it] + delta_t

where ``delta_t`` is the token encoding of the text the chat template adds for the new user / tool
messages (plus the generation prompt). ``delta_t`` is the *difference of two renderings*: the
conversation ending with the assistant turn (no generation prompt) and the same conversation with
the new messages and a generation prompt. The closing text of the assistant turn (for ChatML
``<|im_end|>\\n``) is found once by rendering a sentinel conversation.

Anything that provides :class:`ChatTokenizer` works: the models layer's tokenizer (passed in by the
trainer, never imported here) or :class:`JinjaChatTokenizer` (a ``tokenizers.Tokenizer`` plus a
jinja2 template), which the tests and benchmarks use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ChatTokenizer",
    "JinjaChatTokenizer",
    "PromptBuilder",
    "PromptDriftError",
    "CHATML_TEMPLATE",
    "TOOLS_TEMPLATE",
]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: ChatML with function tools in Qwen2.5's Hermes style: with ``tools``, a system turn lists them in
#: ``<tools>`` (after the caller's system message, or a default one) and asks for
#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; an assistant message's
#: ``tool_calls`` render as those blocks; consecutive ``tool`` messages share one user turn of
#: ``<tool_response>`` blocks. Conversations without tools render exactly as ``CHATML_TEMPLATE``.
#: Whitespace control on every tag: the output is the same with or without ``trim_blocks``.
TOOLS_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] -}}"
    "{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}"
    "{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\n<tool_call>\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' and loop.first and tools -%}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if m['content'] -%}{{- '\n' + m['content'] -}}{%- endif -%}"
    "{%- for call in m['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '\n<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def _tojson(x: Any, indent: int | None = None, **_: Any) -> str:
    """``tojson`` as Hugging Face templates expect it: plain JSON, no HTML escaping."""
    return json.dumps(x, ensure_ascii=False, indent=indent)


_SENTINEL = "\u2063JAXPRM_SENTINEL\u2063"


@runtime_checkable
class ChatTokenizer(Protocol):
    """What the rollout needs from a tokenizer.

    ``encode`` must NOT add special tokens of its own (no BOS): the chat template writes them.
    ``apply_chat_template`` returns the rendered *text*; it takes ``tools=[...]`` as a keyword when
    a request brings function tools (``rollout.tool_calls``). ``decode`` is used only when a server
    returns no text for the sampled tokens.
    """

    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool
    ) -> str: ...


class PromptDriftError(AssertionError):
    """A new prompt does not extend the previous one, or the template is not prefix-stable."""


class JinjaChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus a jinja2 chat template (sandboxed).

    Args:
      tokenizer: a ``tokenizers.Tokenizer``; its special tokens (``<|im_end|>`` ...) must be added
        so that they encode to single ids.
      chat_template: jinja2 source; it sees ``messages`` and ``add_generation_prompt``.
      eos_token: the end-of-turn token text (must encode to exactly one id).
    """

    def __init__(self, tokenizer: Any, chat_template: str = CHATML_TEMPLATE, eos_token: str = "<|im_end|>"):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False, keep_trailing_newline=True)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(chat_template)
        ids = tokenizer.encode(eos_token, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"eos_token={eos_token!r} encodes to {ids}; it must be one special token")
        self.eos_token = eos_token
        self.eos_token_id = int(ids[0])

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                            **variables: Any) -> str:
        """The template's text of ``messages``; ``variables`` (e.g. ``tools``) go to the template."""
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)


class PromptBuilder:
    """Builds the token prompts of a multi-turn conversation by template differences.

    ``initial(messages)`` encodes the first prompt (with the generation prompt).
    ``continuation(messages, assistant_text, new_messages, sampled)`` returns the tokens to append
    after the sampled tokens of the assistant turn: the rest of the assistant turn's closing text
    (the end-of-turn token is skipped when the sampler already emitted it) followed by the
    rendering of ``new_messages`` and the generation prompt.

    ``tools`` (function tools) are rendered into every prompt, and ``prefill`` (text, e.g. the
    opening markup of a tool call) is appended after every generation prompt, as prompt tokens:
    the format of a tool-calling environment (``rollout.envs.tool_moves``).

    The builder is stateless and shareable between concurrent branches.
    """

    def __init__(self, tokenizer: ChatTokenizer, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 prefill: str = ""):
        for attr in ("encode", "apply_chat_template", "eos_token_id"):
            if not hasattr(tokenizer, attr):
                raise TypeError(f"tokenizer lacks {attr!r}; it must provide encode, apply_chat_template, eos_token_id")
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.tools = list(tools) if tools else None
        self.prefill = prefill
        self._prefill_ids = list(tokenizer.encode(prefill)) if prefill else []
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=False)
        if _SENTINEL not in text:
            raise ValueError("the chat template does not render assistant message content verbatim")
        # Text the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        self.assistant_close = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
        self._close_ids = tokenizer.encode(self.assistant_close) if self.assistant_close else []

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The template's text; ``tools`` (function tools) go to it as its ``tools`` variable."""
        if tools:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=list(tools))
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    def initial(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
                ) -> list[int]:
        """Tokens of the first prompt: ``encode(render(messages, add_generation_prompt=True))`` (then
        the prefill); ``tools`` default to the builder's."""
        tools = self.tools if tools is None else tools
        return [*self.tokenizer.encode(self.render(messages, True, tools)), *self._prefill_ids]

    def continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        assistant_text: str,
        new_messages: Sequence[Mapping[str, Any]],
        sampled: Sequence[int],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Tokens to append after ``sampled`` (the assistant turn's tokens).

        ``messages`` is the conversation before the assistant turn, ``assistant_text`` its content.
        Returns ``close' + encode(render(all + new, gen=True)[len(render(all, gen=False)):])`` where
        ``close'`` is the template's closing of the assistant turn without the end-of-turn token
        if ``sampled`` already ends with it, then the prefill. ``tools`` (default: the builder's) are
        rendered in both (the assistant turn's own tool calls are in ``assistant_text``, as generated).
        """
        tools = self.tools if tools is None else tools
        with_asst = [*messages, {"role": "assistant", "content": assistant_text}]
        before = self.render(with_asst, False, tools)
        after = self.render([*with_asst, *new_messages], True, tools)
        if not after.startswith(before):
            raise PromptDriftError(
                "chat template is not prefix-stable: rendering with the new messages does not extend "
                "the rendering without them (templates that rewrite earlier turns are unsupported)"
            )
        if not before.endswith(self.assistant_close):
            raise PromptDriftError("assistant turn does not end with the template's closing text")
        delta = after[len(before):]
        close = list(self._close_ids)
        ends_eos = len(sampled) > 0 and int(sampled[-1]) == self.eos_token_id
        if ends_eos and close and close[0] == self.eos_token_id:
            close = close[1:]
        elif close and close[0] != self.eos_token_id and not ends_eos:
            # Template closes turns with text that is not the EOS id: still end the turn explicitly.
            close = [self.eos_token_id, *close]
        return [*close, *self.tokenizer.encode(delta), *self._prefill_ids]


def check_extends(previous: Sequence[int], new: Sequence[int]) -> None:
    """Raise :class:`PromptDriftError` unless ``new`` starts with ``previous``."""
    n = len(previous)
    if len(new) < n or list(new[:n]) != list(previous):
        first = next((i for i, (a, b) in enumerate(zip(previous, new)) if a != b), min(n, len(new)))
        raise PromptDriftError(f"new prompt does not extend the previous one (first difference at token {first})")
