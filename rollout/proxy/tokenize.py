"""Prompts for recorded chats: concat tokenization, and loading a tokenizer for the CLI (layer 4).

Concat mode keeps earlier turns token-identical to what was generated (no re-tokenization drift)::

    prompt = parent.input_tokens + parent.output_tokens + suffix

where ``suffix`` is ``rollout.chat.PromptBuilder.continuation``: the chat template's rendering of
the messages after the parent's output (plus the generation prompt), taken as the difference of two
renderings after the parent's end-of-turn; the parent's stop token is kept (a length-truncated
parent gets the end-of-turn token appended). Without a parent the prompt is the template of the
messages with the generation prompt. In ``hf`` mode every prompt is that fresh rendering.

Messages are rendered with string contents (a list of ``{"type": "text", "text": ...}`` parts is
joined); keys whose value is null are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxprm.imports import import_object
from rollout.chat import ChatTokenizer, PromptBuilder, PromptDriftError
from rollout.proxy.config import ProxyError
from rollout.proxy.sessions import Record

__all__ = ["PromptMaker", "template_message", "load_tokenizer", "HFChatTokenizer"]


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A request message as the chat template sees it (string content, null keys dropped)."""
    out = {k: v for k, v in message.items() if v is not None}
    content = out.get("content")
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise ProxyError(400, "message content parts must be text ({'type': 'text', 'text': ...}); "
                                      "images and audio are not supported", param="messages")
        out["content"] = "".join(parts)
    elif content is None:
        out["content"] = ""
    elif not isinstance(content, str):
        raise ProxyError(400, f"message content must be a string or a list of text parts, got "
                              f"{type(content).__name__}", param="messages")
    return out


class PromptMaker:
    """Token prompts for records: concat continuation of the parent, or a fresh rendering."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.builder = PromptBuilder(tokenizer)
        self.tokenizer = tokenizer

    def fresh(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
              ) -> list[int]:
        """``encode(template(messages, add_generation_prompt=True[, tools]))``."""
        return self.builder.initial([template_message(m) for m in messages], tools)

    def prompt(self, rec: Record) -> list[int]:
        """The prompt of ``rec``: concat on its parent when it has one (and is concat), else fresh."""
        parent = rec.parent
        if not rec.concat or parent is None:
            return self.fresh(rec.messages, rec.tools)
        assert parent.response is not None
        before = [template_message(m) for m in parent.messages]
        new = [template_message(m) for m in rec.messages[len(parent.messages) + 1:]]
        try:
            tail = self.builder.continuation(before, parent.text, new, parent.response.output_tokens, rec.tools)
        except PromptDriftError as e:
            raise ProxyError(500, f"concat tokenization failed: {e}; run the proxy with chat_template_type 'hf' "
                                  "for this template (individual export only, no process rewards)") from None
        r = parent.response
        return [*r.input_tokens.tolist(), *r.output_tokens.tolist(), *tail]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)


# ---------------------------------------------------------------------------------- loading


class HFChatTokenizer:
    """A Hugging Face tokenizer directory as a ``rollout.chat.ChatTokenizer``.

    Reads ``tokenizer.json`` (the ``tokenizers`` library), the ``chat_template`` and ``eos_token``
    of ``tokenizer_config.json`` (or ``chat_template.jinja``), and renders the template the way
    ``transformers`` does (sandboxed jinja2 with ``trim_blocks``, ``lstrip_blocks``, loop controls,
    ``raise_exception`` and a non-escaping ``tojson``).
    """

    def __init__(self, directory: str | Path) -> None:
        import jinja2.ext
        import jinja2.sandbox
        import tokenizers

        d = Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d / 'tokenizer.json'} not found: --tokenizer needs a Hugging Face "
                                    "tokenizer directory or a package.module:function")
        self.backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        if not template:
            raise ValueError(f"{d}: no chat_template (tokenizer_config.json or chat_template.jinja)")
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, Mapping) else eos
        if not isinstance(eos, str) or self.backend.token_to_id(eos) is None:
            raise ValueError(f"{d}: tokenizer_config.json needs an eos_token in the vocabulary, got {eos!r}")
        self.eos_token = eos
        self.eos_token_id = int(self.backend.token_to_id(eos))
        self._vars = {k: (v.get("content") if isinstance(v, Mapping) else v) or ""
                      for k, v in ((n, config.get(n)) for n in ("bos_token", "eos_token", "pad_token", "unk_token"))}

        def _raise(msg: str):
            raise jinja2.exceptions.TemplateError(msg)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                            **variables: Any) -> str:
        return self._template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                     **self._vars, **variables)


def load_tokenizer(spec: str) -> ChatTokenizer:
    """``spec``: a Hugging Face tokenizer directory, or ``package.module:function`` returning a
    tokenizer (called without arguments), e.g. ``jaxprm.models:build_tiny_tokenizer`` for the
    embedded server's tiny model."""
    if Path(spec).is_dir():
        return HFChatTokenizer(spec)
    if ":" not in spec:
        raise ValueError(f"--tokenizer {spec!r}: not a directory and not package.module:function")
    obj = import_object(spec, where="--tokenizer", colon_only=True, shape="package.module:function")
    tok = obj() if callable(obj) and not hasattr(obj, "encode") else obj
    for need in ("encode", "decode", "apply_chat_template", "eos_token_id"):
        if not hasattr(tok, need):
            raise TypeError(f"--tokenizer {spec!r} gave {type(tok).__name__}, which lacks {need!r}")
    return tok
