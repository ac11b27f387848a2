"""Private inputs for scorer calls: copies of what a call may touch, read-only views of the rest.

For scoring turn ``i`` of a branch a scorer gets:

- ``interaction``: a private ``Interaction.clone()`` (messages / env state deep-copied, token
  rewards copied, the immutable model response shared);
- ``ctx["messages"]``: a private deep copy of the branch conversation;
- ``ctx["branch"]``: a fresh list whose entry ``i`` is that same private clone and whose other
  entries are read-only views (messages and env state frozen into ``ReadOnlyDict`` / tuples,
  read-only token-reward arrays), built once per run and shared by all calls;
- the caller's other ``ctx`` values, passed through as they are (treat them as read-only).

So a scorer that mutates what it was given changes nothing outside its own call, and the cost per
call stays linear in the branch length (the read-only views are not copied per call).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import numpy as np

from rollout.types import Interaction, copy_json

__all__ = ["BranchSnapshot", "ReadOnlyDict", "readonly"]


class ReadOnlyDict(dict):
    """A ``dict`` that refuses mutation (still JSON-serializable; copies are plain dicts)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("scorer inputs are read-only: copy them (copy.deepcopy) before changing them")

    __setitem__ = __delitem__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]
    __ior__ = _refuse  # type: ignore[assignment]

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict:
        return {copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> tuple:
        return (dict, (dict(self),))


def readonly(obj: Any) -> Any:
    """Recursively freeze JSON-like data: mappings -> ``ReadOnlyDict``, lists/tuples -> tuples,
    numpy arrays -> read-only copies; other values are returned as they are."""
    if isinstance(obj, Mapping):
        return ReadOnlyDict({k: readonly(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(readonly(v) for v in obj)
    if isinstance(obj, np.ndarray):
        arr = np.array(obj, copy=True)
        arr.setflags(write=False)
        return arr
    return obj


def _view(it: Interaction) -> Interaction:
    return dataclasses.replace(
        it,
        messages=readonly(it.messages),
        output_messages=readonly(it.output_messages),
        token_rewards=None if it.token_rewards is None else readonly(np.asarray(it.token_rewards)),
        env_state=readonly(it.env_state),
    )


class BranchSnapshot:
    """Per-run source of isolated scorer inputs (see the module docstring)."""

    def __init__(self, interactions: Sequence[Interaction], messages: Any) -> None:
        self._source = list(interactions)
        self._views = [_view(it) for it in self._source]
        self._messages = messages

    def turn_inputs(self, index: int, base_ctx: Mapping[str, Any]) -> tuple[Interaction, dict[str, Any]]:
        clone = self._source[index].clone()
        branch = list(self._views)
        branch[index] = clone
        ctx = dict(base_ctx)
        ctx["messages"] = copy_json(self._messages)
        ctx["branch"] = branch
        ctx["turn_index"] = index
        return clone, ctx

    def trajectory_inputs(self, base_ctx: Mapping[str, Any]) -> tuple[list[Interaction], dict[str, Any]]:
        clones = [it.clone() for it in self._source]
        ctx = dict(base_ctx)
        ctx["messages"] = copy_json(self._messages)
        ctx["branch"] = list(clones)
        return clones, ctx
