"""The recording proxy's configuration and its one error type (layer 4).

``ProxyConfig`` is checked when it is built: a bad value raises ``ValueError`` naming the field and
the allowed values, and active process-reward scorers are checked against the proxy's settings with
``scorers.validate_prm_config`` (concat chat template, token-backed upstream, direct advantages).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from rollout.client import ClientConfig
from rollout.tool_calls import get_parser
from scorers.config import PRMConfig, as_prm_config, validate_prm_config

__all__ = ["ProxyConfig", "ProxyError", "CHAT_TEMPLATE_TYPES", "HITL_SESSION"]

CHAT_TEMPLATE_TYPES = ("concat", "hf")
HITL_SESSION = "__hitl__"


class ProxyError(Exception):
    """A request the proxy refuses; ``status`` is the HTTP status, ``str(exc)`` the message.

    ``param`` names the offending field when there is one (it becomes the OpenAI error's ``param``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """How the proxy runs.

    Attributes:
      upstream: where generation goes (``rollout.client.ClientConfig``: endpoints, ``vllm`` or
        ``sglang`` dialect, timeouts, retries, concurrency); must be token-backed for PRM scoring.
      admin_key: the key that starts sessions, exports and chats into ``__hitl__``.
      chat_template_type: ``"concat"`` (default; earlier turns stay token-identical, required for
        process rewards and concat export) or ``"hf"`` (every prompt is a fresh rendering of the
        whole conversation; only individual export).
      prm: the process-reward config (``scorers.PRMConfig`` or its mapping); ``None``: no scoring.
      passthrough: forward calls with no or an unknown key without recording (else 401).
      model_name: the id ``/v1/models`` reports and answers carry.
      default_max_tokens: ``max_tokens`` of a request that gives none.
      max_context_tokens: prompt + generated tokens limit (``None``: the upstream decides). A prompt
        that leaves no room is a 400; ``max_tokens`` is clipped to the room left.
      session_timeout_s: a session without activity for this long is removed by the sweep.
      sweep_interval_s: how often the sweep runs.
      drain_timeout_s: at shutdown, how long in-flight exports may still run before they are cancelled.
      max_group_size: the largest ``group_size`` a ``start_session`` may ask for.
      tool_call_parser: how tool calls are read out of generated text (``rollout.tool_calls``:
        ``hermes`` for Qwen2.5/3 and Hermes templates, ``llama3_json``).
    """

    upstream: ClientConfig
    admin_key: str
    chat_template_type: str = "concat"
    prm: PRMConfig | Mapping[str, Any] | None = None
    passthrough: bool = False
    model_name: str = "jaxprm-proxy"
    default_max_tokens: int = 256
    max_context_tokens: int | None = None
    session_timeout_s: float = 3600.0
    sweep_interval_s: float = 30.0
    drain_timeout_s: float = 300.0
    max_group_size: int = 1024
    tool_call_parser: str = "hermes"

    def __post_init__(self) -> None:
        if not isinstance(self.upstream, ClientConfig):
            raise TypeError(f"upstream must be a rollout.client.ClientConfig, got {type(self.upstream).__name__}")
        if not isinstance(self.admin_key, str) or not self.admin_key.strip():
            raise ValueError("admin_key must be a non-empty string")
        if self.chat_template_type not in CHAT_TEMPLATE_TYPES:
            raise ValueError(f"chat_template_type={self.chat_template_type!r}; allowed: {CHAT_TEMPLATE_TYPES}")
        for name in ("session_timeout_s", "sweep_interval_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r}; must be a finite number > 0")
        for name in ("default_max_tokens", "max_group_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}; must be >= 1")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"max_context_tokens={self.max_context_tokens!r}; must be >= 2 or None")
        get_parser(self.tool_call_parser)  # a ValueError naming the allowed parsers
        prm = as_prm_config(self.prm)
        validate_prm_config(prm, export_style="concat", token_backed=self.upstream.require_tokens,
                            token_rewards_as_adv=True, chat_template_type=self.chat_template_type)
        object.__setattr__(self, "prm", prm)

    @property
    def prm_active(self) -> bool:
        return bool(self.prm is not None and self.prm.active)
