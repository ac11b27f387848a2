"""Shared test configuration and fixtures."""

import os
import socket

import pytest

# Keep XLA on the CPU and quiet; tests must never need an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@pytest.fixture(scope="module")
def tiny():
    """``(model, tokenizer)`` of the tiny preset (one per test module: servers may swap its weights)."""
    from jaxprm.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny):
    return tiny[1]


@pytest.fixture
def free_port():
    """``free_port() -> int``: a loopback port with nothing listening on it."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick
