"""Token-backed interactions and interaction trees (layer 2: plain Python + numpy, no jax).

An *interaction* is one generated turn: the chat messages the model saw, the messages it produced,
and the exact token ids / logprobs the server sampled (``ModelResponse``). Interactions form a tree
through ``parent_id``; a *branch* is the chain from the root to one leaf. Scorers attach a per-token
process reward (``token_rewards``, shape ``[output_len]``) to each interaction of a branch.

Model responses are immutable and shared between clones; messages and token rewards are copied by
``InteractionTree.clone_branch`` so that scoring one branch never touches another.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["ModelResponse", "Interaction", "InteractionTree", "STOP_REASONS", "branch_messages", "copy_json", "freeze"]

STOP_REASONS = ("stop", "length", "abort")


def _readonly(x: Any, dtype: Any) -> np.ndarray:
    arr = np.array(x, dtype=dtype, copy=True).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class ModelResponse:
    """What the server returned for one request, token-backed and read-only.

    Attributes:
      input_tokens: ``int32 [P]`` the full prompt token ids sent.
      output_tokens: ``int32 [output_len]`` the sampled token ids.
      output_logprobs: ``float32 [output_len]`` log-prob of each sampled token under the sampler.
      stop_reason: ``"stop"`` (EOS / stop token), ``"length"`` (max tokens: truncated) or ``"abort"``.
      weight_version: the server's weight version that produced the tokens, if reported.
    """

    input_tokens: np.ndarray
    output_tokens: np.ndarray
    output_logprobs: np.ndarray
    stop_reason: str = "stop"
    weight_version: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_tokens", _readonly(self.input_tokens, np.int32))
        object.__setattr__(self, "output_tokens", _readonly(self.output_tokens, np.int32))
        object.__setattr__(self, "output_logprobs", _readonly(self.output_logprobs, np.float32))
        if self.output_logprobs.shape != self.output_tokens.shape:
            raise ValueError(
                f"output_logprobs has shape {self.output_logprobs.shape}, "
                f"expected {self.output_tokens.shape} (one per output token)"
            )
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"stop_reason={self.stop_reason!r}; allowed: {STOP_REASONS}")

    def __copy__(self) -> ModelResponse:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelResponse:
        # Immutable (frozen, read-only arrays): copies of an interaction share it.
        return self

    @property
    def output_len(self) -> int:
        return int(self.output_tokens.shape[0])

    @property
    def input_len(self) -> int:
        return int(self.input_tokens.shape[0])

    @property
    def truncated(self) -> bool:
        return self.stop_reason == "length"


_ids = itertools.count()

_ATOMS = (str, int, float, bool, type(None))


def copy_json(obj: Any) -> Any:
    """A deep copy of JSON-like data (dict / list / tuple / scalars), several times faster than
    ``copy.deepcopy`` on chat messages; any other object is deep-copied with ``copy.deepcopy``."""
    t = type(obj)
    if t in _ATOMS:
        return obj
    if t is dict:
        return {k: copy_json(v) for k, v in obj.items()}
    if t is list:
        return [copy_json(v) for v in obj]
    if t is tuple:
        return tuple(copy_json(v) for v in obj)
    return copy.deepcopy(obj)


def new_interaction_id(prefix: str = "it") -> str:
    """A process-unique interaction id."""
    return f"{prefix}-{next(_ids)}"


@dataclasses.dataclass(eq=False)
class Interaction:
    """One generated turn.

    Attributes:
      id: unique id within its tree.
      parent_id: id of the previous turn on the branch, ``None`` for a root turn.
      messages: the chat messages the model saw for this turn (the conversation so far).
      output_messages: the messages the model produced (normally one assistant message).
      model_response: the token-backed server response (shared, read-only).
      token_rewards: ``float32 [output_len]`` process reward per generated token, or ``None``.
      reward: outcome reward observed after this turn (the env's step reward), if any.
      env_state: what the rollout recorded about the environment after this turn (for scorers
        such as FrozenLake progress): e.g. ``{"position": (r, c), "done": False, "action": "Left"}``.
    """

    id: str
    parent_id: str | None
    messages: list[dict[str, Any]]
    output_messages: list[dict[str, Any]]
    model_response: ModelResponse | None = None
    token_rewards: np.ndarray | None = None
    reward: float | None = None
    env_state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def output_len(self) -> int:
        return 0 if self.model_response is None else self.model_response.output_len

    def clone(self) -> Interaction:
        """Copy with deep-copied messages/env state and copied rewards; the response is shared."""
        return Interaction(
            id=self.id,
            parent_id=self.parent_id,
            messages=copy_json(self.messages),
            output_messages=copy_json(self.output_messages),
            model_response=self.model_response,
            token_rewards=None if self.token_rewards is None else np.array(self.token_rewards, copy=True),
            reward=self.reward,
            env_state=copy_json(self.env_state),
        )


class InteractionTree:
    """Interactions linked by ``parent_id``; insertion order is kept (parents before children)."""

    def __init__(self, interactions: Iterable[Interaction] = ()) -> None:
        self._nodes: dict[str, Interaction] = {}
        self._children: dict[str | None, list[str]] = {None: []}
        for it in interactions:
            self.add(it)

    def add(self, interaction: Interaction) -> Interaction:
        if interaction.id in self._nodes:
            raise ValueError(f"duplicate interaction id {interaction.id!r}")
        if interaction.parent_id is not None and interaction.parent_id not in self._nodes:
            raise KeyError(f"parent {interaction.parent_id!r} of {interaction.id!r} is not in the tree")
        self._nodes[interaction.id] = interaction
        self._children.setdefault(interaction.parent_id, []).append(interaction.id)
        self._children.setdefault(interaction.id, [])
        return interaction

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Interaction]:
        return iter(self._nodes.values())

    def __contains__(self, interaction_id: object) -> bool:
        return interaction_id in self._nodes

    def get(self, interaction_id: str) -> Interaction:
        try:
            return self._nodes[interaction_id]
        except KeyError:
            raise KeyError(f"unknown interaction id {interaction_id!r}") from None

    def children(self, interaction_id: str | None) -> list[Interaction]:
        return [self._nodes[i] for i in self._children.get(interaction_id, [])]

    def roots(self) -> list[Interaction]:
        return self.children(None)

    def leaves(self) -> list[Interaction]:
        """Interactions without children, in insertion order."""
        return [n for i, n in self._nodes.items() if not self._children[i]]

    def branch(self, leaf_id: str) -> list[Interaction]:
        """The root-to-leaf chain ending at ``leaf_id`` (the tree's own objects)."""
        chain: list[Interaction] = []
        node: Interaction | None = self.get(leaf_id)
        while node is not None:
            chain.append(node)
            node = None if node.parent_id is None else self._nodes[node.parent_id]
        chain.reverse()
        return chain

    def clone_branch(self, leaf_id: str) -> list[Interaction]:
        """Independent copies of the root-to-leaf chain (see ``Interaction.clone``)."""
        return [it.clone() for it in self.branch(leaf_id)]

    def branches(self) -> list[list[Interaction]]:
        return [self.branch(leaf.id) for leaf in self.leaves()]


def branch_messages(branch: Sequence[Interaction]) -> list[dict[str, Any]]:
    """The full conversation of a branch: the last turn's input messages plus its outputs."""
    if not branch:
        return []
    last = branch[-1]
    return [*copy_json(last.messages), *copy_json(last.output_messages)]


def freeze(obj: Any) -> Any:
    """A read-only deep view of JSON-like data (dicts -> MappingProxy, lists -> tuples)."""
    from types import MappingProxyType

    if isinstance(obj, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(freeze(v) for v in obj)
    return obj
