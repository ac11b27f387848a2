"""Real agent frameworks train through the proxy: the OpenAI Agents SDK (its Chat Completions model
and its default Responses model) and smolagents' ``ToolCallingAgent`` (``OpenAIServerModel``), each
with a function tool, against the scripted upstream (a call, then the answer), then exported; the
Agents SDK's rows then go through one update of the trainer's step (a toy policy).

What each framework sends back decides what the proxy can chain: the Agents SDK echoes the
assistant's tool calls as they were answered, so its turns continue token-exactly (one concat row);
smolagents re-renders its memory as text ("Calling tools: [...]" as an assistant message,
"Observation: ..." as a user message), so no earlier turn prefixes the next request and each turn
is recorded as a root of its own (one row per turn: trainable, not concatenated)."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from rollout.chat import TOOLS_TEMPLATE
from rollout.client import ClientConfig
from rollout.proxy import ProxyConfig, ProxyServer
from rollout.testing import ScriptedServer, ServerScript, make_test_tokenizer, turn_script_policy

from .conftest import ADMIN

agents = pytest.importorskip("agents")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no exporter calls to the internet

CALL = '<tool_call>\n{"name": "move", "arguments": {"direction": "Right"}}\n</tool_call>'
MOVES: list[str] = []


def move(direction: str) -> str:
    """Move one cell on the frozen lake.

    Args:
        direction: Up, Down, Left or Right.
    """
    MOVES.append(direction)
    return f"You moved {direction}. You reached the goal."


@pytest.fixture(scope="module")
def tok():
    return make_test_tokenizer(template=TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def learn():
    """``learn(rows)``: one GRPO update of a toy policy (the test tokenizer's vocabulary fits) on a
    framework's exported rows, through the trainer's step; returns its metrics. One compiled shape."""
    import jax
    import optax

    import jaxprm
    from jaxprm.train.policy import Policy
    from jaxprm.train.step import TrainStep, step_inputs
    from tests.train._models import toy_transformer

    policy = Policy(toy_transformer(seed=0, vocab=512))
    step = TrainStep(policy.apply_fn, optax.sgd(0.1), jaxprm.policy_loss,
                     loss_kwargs={"eps_clip": 0.2, "agg": "token-mean"})

    def run(rows):
        batch = jaxprm.pad_rows([r.to_row_data(0) for r in rows], row_buckets=(4,), len_buckets=(1024,))
        adv = jaxprm.compute_advantages(batch, jaxprm.AdvantageConfig(group_reward_norm=False)).advantages
        _, metrics = step(step.init_state(policy.params), step_inputs(batch, adv), jax.random.key(0))
        return {k: float(v) for k, v in metrics.items()}

    return run


async def _with_proxy(tok, turns, fn):
    with ScriptedServer(ServerScript(policy=turn_script_policy(tok, turns)), tok) as up:
        cfg = ProxyConfig(upstream=ClientConfig(endpoints=(up.url,), timeout_s=30, max_retries=0), admin_key=ADMIN,
                          default_max_tokens=256)
        srv = await ProxyServer.start(cfg, tok)
        try:
            _, (session,) = srv.proxy.start_session("framework")
            out = await fn(srv, session)
            srv.proxy.set_reward(session, {"reward": 1.0})
            exported = await srv.proxy.export({"session_ids": [session.id]})
            return session, out, exported
        finally:
            await srv.stop()


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_openai_agents_sdk_trains_through_the_proxy(tok, learn, model_class):
    from openai import AsyncOpenAI

    async def run(srv, session):
        client = AsyncOpenAI(base_url=srv.base_url, api_key=session.api_key, max_retries=0)
        model = getattr(agents, model_class)(model="jaxprm", openai_client=client)
        agent = agents.Agent(name="walker", instructions="Reach G.", tools=[agents.function_tool(move)], model=model)
        result = await agents.Runner.run(agent, "P _\n_ G", max_turns=4)
        await client.close()
        return result

    MOVES.clear()
    session, result, exported = asyncio.run(_with_proxy(tok, [CALL, "I reached the goal."], run))
    assert result.final_output == "I reached the goal." and MOVES == ["Right"]
    first, second = session.records.values()
    assert second.parent is first  # the echoed call continues the recorded turn
    (row,) = exported.rows  # both turns, token-exact, in one row
    assert row.tokens[row.loss_mask > 0].tolist() == [*first.response.output_tokens.tolist(),
                                                      *second.response.output_tokens.tolist()]
    assert "You moved Right." in tok.decode(second.response.input_tokens.tolist())
    metrics = learn(exported.rows)
    assert metrics["trained_tokens"] == row.loss_mask.sum() and np.isfinite(metrics["loss"])


def test_smolagents_tool_calling_agent_trains_through_the_proxy(tok):
    smolagents = pytest.importorskip("smolagents")

    # tool_choice "required": the proxy prefills "<tool_call>\n", the model writes the rest
    turns = ['{"name": "move", "arguments": {"direction": "Right"}}\n</tool_call>',
             '{"name": "final_answer", "arguments": {"answer": "reached G"}}\n</tool_call>']

    async def run(srv, session):
        model = smolagents.OpenAIServerModel(model_id="jaxprm", api_base=srv.base_url, api_key=session.api_key)
        agent = smolagents.ToolCallingAgent(tools=[smolagents.tool(move)], model=model, max_steps=3, verbosity_level=0)
        return await asyncio.to_thread(agent.run, "P _\n_ G. Reach G.")

    MOVES.clear()
    session, answer, exported = asyncio.run(_with_proxy(tok, turns, run))
    assert answer == "reached G" and MOVES == ["Right"]
    first, second = session.records.values()
    assert json.loads(first.output_message["tool_calls"][0]["function"]["arguments"]) == {"direction": "Right"}
    assert second.parent is None  # smolagents re-renders its memory as text: no concat chain
    assert len(exported.rows) == 2 and all(r.loss_mask.sum() > 0 for r in exported.rows)
    # its rows batch for the learner like any (the update itself is checked on the Agents SDK's rows:
    # smolagents' long default system prompt makes these rows ~4x longer, a minute of toy-model step)
    import jaxprm

    batch = jaxprm.pad_rows([r.to_row_data(0) for r in exported.rows])
    assert float(batch.loss_mask.sum()) == sum(r.loss_mask.sum() for r in exported.rows)
