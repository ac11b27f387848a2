"""rollout.envs.tool_moves: grid games played by move() calls (env.action_format: tool_call)."""

from __future__ import annotations

import asyncio

import pytest

from rollout.chat import CHATML_TEMPLATE, JinjaChatTokenizer
from rollout.envs.registry import get_env
from rollout.envs.tool_moves import PREFILL, ToolMoveEnv, demo_text, tool_prompts
from rollout.testing import make_tools_test_tokenizer


def _episode(name="frozenlake", invalid_ends=True):
    spec = get_env(name)
    env = spec.factory("compact", invalid_ends_episode=invalid_ends, action_format="tool_call")()
    if name == "frozenlake":
        from rollout.envs.frozenlake import make_tasks
        task = make_tasks(3, 1, 0, sizes=(4,), max_turns=8)[0][0]
    else:
        from rollout.envs.sokoban import make_tasks
        task = make_tasks(3, 1, 0)[0][0]
    return env, task


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_the_prompt_asks_for_calls_and_a_call_moves(name):
    env, task = _episode(name)
    assert isinstance(env, ToolMoveEnv)
    prompt = env.system_prompt(task)
    assert "Call move with one direction" in prompt and "```" not in prompt
    asyncio.run(env.reset(task))
    action = env.optimal_actions()[0]
    step = asyncio.run(env.step(demo_text(action)))
    assert step.info["action"] == action and step.info.get("valid") is not False and step.role == "tool"
    clone = env.clone()
    assert isinstance(clone, ToolMoveEnv) and clone.game is not env.game


@pytest.mark.parametrize("answer", [
    "```Up```",  # a fenced move is not a call
    '{"direction": "Sideways"}}\n</tool_call>',
    '{"direction": "Up"\n',  # half a call
])
def test_anything_but_one_valid_move_call_is_invalid(answer):
    env, task = _episode(invalid_ends=False)
    asyncio.run(env.reset(task))
    step = asyncio.run(env.step(answer))
    assert step.info.get("valid") is False and step.role == "user" and not step.done


def test_the_first_of_several_calls_counts():
    env, task = _episode()
    asyncio.run(env.reset(task))
    two = demo_text("Down") + '\n<tool_call>\n{"name": "move", "arguments": {"direction": "Up"}}\n</tool_call>'
    assert asyncio.run(env.step(two)).info["action"] == "Down"


def test_tool_prompts_render_the_tool_and_prefill_the_call():
    tok = make_tools_test_tokenizer()
    prompts = tool_prompts(tok)
    text = tok.decode(prompts.initial([{"role": "user", "content": "P _"}]))
    assert '"name": "move"' in text and text.endswith("assistant\n" + PREFILL)
    tail = prompts.continuation([{"role": "user", "content": "P _"}], demo_text("Up"),
                                [{"role": "tool", "content": "_ P"}], tok.encode(demo_text("Up")) + [tok.eos_token_id])
    assert tok.decode(tail).endswith("<tool_response>\n_ P\n</tool_response>\nassistant\n" + PREFILL)
    with pytest.raises(ValueError, match="renders tools"):
        tool_prompts(JinjaChatTokenizer(tok.tokenizer, CHATML_TEMPLATE))


def test_warm_start_demonstrations_use_the_call_format():
    from jaxprm.train.warmstart import make_demos
    from rollout.envs.frozenlake import make_tasks

    tok = make_tools_test_tokenizer()
    tasks, _ = make_tasks(5, 4, 0, sizes=(4,), max_turns=6)
    spec = get_env("frozenlake")
    demos = make_demos(tasks, tok, n=4, optimal_prob=1.0, seed=0, prompts=tool_prompts(tok),
                       env_factory=spec.factory("compact", action_format="tool_call"))
    assert all(d.success for d in demos)
    d = demos[0]
    supervised = tok.decode([t for t, m in zip(d.tokens, d.mask) if m])
    assert supervised.startswith('{"direction": "') and "</tool_call>" in supervised and "<tool_call>" not in supervised
    assert "<tool_response>" in tok.decode(d.tokens)
