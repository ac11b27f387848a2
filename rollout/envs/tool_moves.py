"""Grid games played by function calls (layer 4): ``env.action_format: tool_call``.

A move is a call of the ``move`` function tool (:data:`MOVE_TOOL`, ``direction``: Left, Down,
Right or Up), in the Hermes format of ``rollout.chat.TOOLS_TEMPLATE`` (Qwen2.5/3 and the tiny
model). The tool is rendered into every prompt and the call's opening markup up to its arguments
is prefilled as prompt tokens (:data:`PREFILL`, what ``tool_choice: {"type": "function",
"function": {"name": "move"}}`` prefills on the proxy and the server), so the model writes
``{"direction": "Up"}}`` and the closing ``</tool_call>``. The environment's answer to a call is a
``tool`` message (a ``<tool_response>`` block); an answer that is not one valid ``move`` call is an
invalid move (and the environment's reply a ``user`` message).

:class:`ToolMoveEnv` wraps a game (FrozenLake, Sokoban) for the tree path, the evaluation and the
warm start; :func:`tool_prompts` is the matching ``PromptBuilder``; the proxy's example agent
(``rollout.agents.grid_tools``) plays the same format through the SDK, so both paths see the same
tokens.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rollout.chat import ChatTokenizer, PromptBuilder
from rollout.envs.base import ACTIONS, Env, StepResult
from rollout.tool_calls import HermesParser, template_renders_tools

__all__ = ["MOVE_TOOL", "PREFILL", "ToolMoveEnv", "tool_prompts", "move_answer", "direction_of", "ACTION_FORMATS"]

ACTION_FORMATS = ("fenced", "tool_call")

MOVE_TOOL = {"type": "function", "function": {
    "name": "move", "description": "Move one cell.",
    "parameters": {"type": "object", "properties": {"direction": {"type": "string", "enum": list(ACTIONS)}},
                   "required": ["direction"]}}}
PREFILL = HermesParser().prefill("move")
_FENCED = "Answer one move: ```Left```, ```Down```, ```Right``` or ```Up```."
_CALL = "Call move with one direction: Left, Down, Right or Up."


def direction_of(arguments: str) -> str | None:
    """The ``direction`` of a ``move`` call's JSON arguments, if it is one of the actions."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    d = args.get("direction") if isinstance(args, dict) else None
    return d if d in ACTIONS else None


def move_answer(direction: str | None) -> str:
    """What the game is told for a move: the fenced action, or an empty (invalid) answer."""
    return f"```{direction}```" if direction is not None else ""


def demo_text(action: str) -> str:
    """What the model writes after :data:`PREFILL` to move ``action`` (the warm start's answers)."""
    return json.dumps({"direction": action}) + "}\n" + HermesParser.END


class ToolMoveEnv:
    """A grid game whose moves are ``move`` calls (see the module docstring); everything else is
    the game's own (``clone`` wraps the clone; other attributes are the game's)."""

    def __init__(self, game: Env) -> None:
        self.game = game
        self._parser = HermesParser()

    async def reset(self, task: Any) -> str:
        return await self.game.reset(task)

    def system_prompt(self, task: Any) -> str | None:
        """The game's prompt with its fenced-answer instruction turned into the call instruction."""
        prompt = self.game.system_prompt(task)
        if prompt is None:
            return None
        return prompt.replace(_FENCED, _CALL) if _FENCED in prompt else f"{prompt} {_CALL}"

    async def step(self, action_text: str) -> StepResult:
        parsed = self._parser.parse(PREFILL + action_text)  # the first call counts (parallel_tool_calls false)
        first = parsed.calls[0] if parsed.calls else None
        direction = direction_of(first.arguments) if first is not None and first.name == "move" else None
        result = await self.game.step(move_answer(direction))
        return dataclasses.replace(result, role="tool" if direction is not None else "user")

    def demo_answer(self, action: str) -> str:
        return demo_text(action)

    def clone(self) -> ToolMoveEnv:
        return ToolMoveEnv(self.game.clone())

    def __getattr__(self, name: str) -> Any:  # optimal_actions, forfeit_reward, ...: the game's
        return getattr(self.game, name)


def tool_prompts(tokenizer: ChatTokenizer) -> PromptBuilder:
    """The ``PromptBuilder`` of the tool format: :data:`MOVE_TOOL` rendered, :data:`PREFILL`
    appended after every generation prompt. A ``ValueError`` when the tokenizer's chat template
    does not render tools."""
    builder = PromptBuilder(tokenizer, tools=[MOVE_TOOL], prefill=PREFILL)
    if not template_renders_tools(lambda msgs, tools: builder.render(msgs, True, tools)):
        raise ValueError("env.action_format 'tool_call' needs a chat template that renders tools "
                         "(Hermes-style, e.g. Qwen2.5/3 or the tiny model's)")
    return builder
