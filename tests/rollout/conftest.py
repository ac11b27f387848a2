"""Fixtures for the rollout tests: one tiny real tokenizer and scripted servers on 127.0.0.1."""

import contextlib

import pytest

from rollout.chat import PromptBuilder
from rollout.testing import ScriptedServer, ServerScript, hashed_action_policy, make_test_tokenizer


@pytest.fixture(scope="session")
def tok():
    return make_test_tokenizer()


@pytest.fixture(scope="session")
def prompts(tok):
    return PromptBuilder(tok)


@pytest.fixture
def serve(tok):
    """``serve(script=None) -> ScriptedServer`` (started; stopped after the test)."""
    with contextlib.ExitStack() as stack:

        def start(script: ServerScript | None = None) -> ScriptedServer:
            script = script or ServerScript(policy=hashed_action_policy(tok))
            return stack.enter_context(ScriptedServer(script, tok))

        yield start
