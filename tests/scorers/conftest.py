"""Fixtures for the scorer tests."""

from __future__ import annotations

import pytest

from scorer_http_server import ScriptedServer


@pytest.fixture(scope="module")
def _server_module():
    server = ScriptedServer().start()
    yield server
    server.stop()


@pytest.fixture
def server(_server_module):
    """A real uvicorn server on 127.0.0.1 (one per test module), reset for each test."""
    _server_module.reset()
    yield _server_module
    _server_module.reset()
