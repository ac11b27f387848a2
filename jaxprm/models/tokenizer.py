"""Tokenizer: a ``tokenizers.Tokenizer`` plus the model's own jinja2 chat template.

Files (the Hugging Face layout): ``tokenizer.json`` (required), ``tokenizer_config.json`` (special
tokens, ``add_bos_token``, ``chat_template``), optionally ``chat_template.jinja`` and
``generation_config.json`` (its ``eos_token_id`` list adds stop ids).

The chat template is rendered the way ``transformers`` renders it: a sandboxed jinja2 environment
with ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a ``tojson`` filter that does not HTML-escape, and the variables ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``pad_token``, ``unk_token`` plus any extra
keyword (``tools``, ``enable_thinking``, ...).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

__all__ = ["Tokenizer", "render_chat_template", "TURN_TERMINATORS"]

# Special tokens that end a turn or a document in the common chat formats; any of them present
# in a vocabulary (as an added token) joins ``eos_token_ids``.
TURN_TERMINATORS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
                    "<end_of_turn>")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now
_TEMPLATES: dict[str, jinja2.Template] = {}


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], **variables: Any) -> str:
    """Render a chat template string with ``messages`` and extra template variables."""
    compiled = _TEMPLATES.get(template)
    if compiled is None:
        compiled = _TEMPLATES[template] = _ENV.from_string(template)
    return compiled.render(messages=[dict(m) for m in messages], **variables)


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "content" in value:
        return value["content"]
    raise ValueError(f"cannot read special token {value!r} (expected a string or a dict with 'content')")


class Tokenizer:
    """Text <-> token ids and chat rendering for one model.

    Args:
      backend: the ``tokenizers.Tokenizer`` (its ``tokenizer.json``).
      chat_template: jinja2 template string, or None (then ``apply_chat_template`` raises).
      bos_token, eos_token, pad_token, unk_token: special token strings (must be in the vocab).
        ``eos_token`` ends a generation; ``pad_token`` defaults to ``eos_token``.
      add_bos_token: stored in ``tokenizer_config.json``; adding BOS itself is the backend
        post-processor's job (``encode(..., add_special_tokens=True)``).
      extra_eos_token_ids: more stop ids (e.g. from ``generation_config.json``).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        extra_eos_token_ids: Iterable[int] = (),
        model_max_length: int | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token if pad_token is not None else eos_token
        self.unk_token = unk_token
        self.add_bos_token = bool(add_bos_token)
        self.model_max_length = model_max_length
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            tok = getattr(self, name)
            if tok is not None and backend.token_to_id(tok) is None:
                raise ValueError(f"{name}={tok!r} is not in the tokenizer's vocabulary")
        if eos_token is None:
            raise ValueError("eos_token is required (the token that ends a generation)")
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        ids = {backend.token_to_id(eos_token)}
        ids |= {backend.token_to_id(t) for t in TURN_TERMINATORS if t in added}
        ids |= {int(i) for i in extra_eos_token_ids}
        self._eos_ids = frozenset(ids)

    # ------------------------------------------------------------------ ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.backend.token_to_id(self.eos_token)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """All ids that end a generation: ``eos_token_id``, turn terminators, generation config."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int:
        return self.backend.token_to_id(self.pad_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # ------------------------------------------------------------------ text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in the text map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary are skipped."""
        ids = [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **variables: Any,
    ) -> str | list[int]:
        """Render ``messages`` (dicts with ``role`` and ``content``) with the model's template.

        Returns the text, or its ids (``encode(text)``, no extra special tokens) if ``tokenize``.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json lacks one)")
        context = {
            "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "", "unk_token": self.unk_token or "",
        }
        context.update(variables)
        text = render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **context
        )
        return self.encode(text) if tokenize else text

    # ------------------------------------------------------------------ files

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / "tokenizer.json"))
        added = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self.backend.get_added_tokens_decoder().items())
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": added,
        }
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Load from a Hugging Face style directory (see the module docstring for the files)."""
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a tokenizer directory needs tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif template is None and (d / "chat_template.json").is_file():
            template = json.loads((d / "chat_template.json").read_text()).get("chat_template")
        extra_eos: list[int] = []
        if (d / "generation_config.json").is_file():
            eos = json.loads((d / "generation_config.json").read_text()).get("eos_token_id")
            extra_eos = [eos] if isinstance(eos, int) else list(eos or [])
        eos_token = _token_str(config.get("eos_token"))
        if eos_token is None and extra_eos:
            eos_token = backend.id_to_token(extra_eos[0])
        return cls(
            backend,
            chat_template=template,
            bos_token=_token_str(config.get("bos_token")),
            eos_token=eos_token,
            pad_token=_token_str(config.get("pad_token")),
            unk_token=_token_str(config.get("unk_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            extra_eos_token_ids=extra_eos,
            model_max_length=_int_or_none(config.get("model_max_length")),
        )


def _int_or_none(value: Any) -> int | None:
    # transformers writes a huge sentinel (1e30) when the length is unknown.
    if isinstance(value, (int, float)) and 0 < value < 1e12:
        return int(value)
    return None
