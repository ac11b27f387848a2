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

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ChatTokenizer",
    "JinjaChatTokenizer",
    "PromptBuilder",
    "PromptDriftError",
    "CHATML_TEMPLATE",
]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_SENTINEL = "\u2063JAXPRM_SENTINEL\u2063"


@runtime_checkable
class ChatTokenizer(Protocol):
    """What the rollout needs from a tokenizer.

    ``encode`` must NOT add special tokens of its own (no BOS): the chat template writes them.
    ``apply_chat_template`` returns the rendered *text*. ``decode`` is used only when a server
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

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt)


class PromptBuilder:
    """Builds the token prompts of a multi-turn conversation by template differences.

    ``initial(messages)`` encodes the first prompt (with the generation prompt).
    ``continuation(messages, assistant_text, new_messages, sampled)`` returns the tokens to append
    after the sampled tokens of the assistant turn: the rest of the assistant turn's closing text
    (the end-of-turn token is skipped when the sampler already emitted it) followed by the
    rendering of ``new_messages`` and the generation prompt.

    The builder is stateless and shareable between concurrent branches.
    """

    def __init__(self, tokenizer: ChatTokenizer):
        for attr in ("encode", "apply_chat_template", "eos_token_id"):
            if not hasattr(tokenizer, attr):
                raise TypeError(f"tokenizer lacks {attr!r}; it must provide encode, apply_chat_template, eos_token_id")
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=False)
        if _SENTINEL not in text:
            raise ValueError("the chat template does not render assistant message content verbatim")
        # Text the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        self.assistant_close = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
        self._close_ids = tokenizer.encode(self.assistant_close) if self.assistant_close else []

    def initial(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Tokens of the first prompt: ``encode(render(messages, add_generation_prompt=True))``."""
        return list(self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))

    def continuation(
        self,
        messages: Sequence[Mapping[str, Any]],
        assistant_text: str,
        new_messages: Sequence[Mapping[str, Any]],
        sampled: Sequence[int],
    ) -> list[int]:
        """Tokens to append after ``sampled`` (the assistant turn's tokens).

        ``messages`` is the conversation before the assistant turn, ``assistant_text`` its content.
        Returns ``close' + encode(render(all + new, gen=True)[len(render(all, gen=False)):])`` where
        ``close'`` is the template's closing of the assistant turn without the end-of-turn token
        if ``sampled`` already ends with it.
        """
        with_asst = [*messages, {"role": "assistant", "content": assistant_text}]
        before = self.tokenizer.apply_chat_template(with_asst, add_generation_prompt=False)
        after = self.tokenizer.apply_chat_template([*with_asst, *new_messages], add_generation_prompt=True)
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
        return close + list(self.tokenizer.encode(delta))


def check_extends(previous: Sequence[int], new: Sequence[int]) -> None:
    """Raise :class:`PromptDriftError` unless ``new`` starts with ``previous``."""
    n = len(previous)
    if len(new) < n or list(new[:n]) != list(previous):
        first = next((i for i, (a, b) in enumerate(zip(previous, new)) if a != b), min(n, len(new)))
        raise PromptDriftError(f"new prompt does not extend the previous one (first difference at token {first})")
