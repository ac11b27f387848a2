"""``python -m jaxprm.serve`` as a subprocess on a free loopback port, and SmolLM2 end to end (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]


def _wait_healthy(proc, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server at {url} not healthy after {timeout} s")


def _serve(port: int, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "jaxprm.serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_cli_serves_tiny_with_api_key(free_port):
    proc, url = _serve(free_port(), "--model", "tiny", "--api-key", "k", "--max-batch", "4",
                       "--shared-prefix-attention", "on")
    try:
        _wait_healthy(proc, url, timeout=180)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.completions.create(model="tiny", prompt="Up", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
    finally:
        _stop(proc)


@pytest.mark.slow
def test_smollm2_chat_is_coherent():
    from jaxprm.models import load_model, smollm2_gguf_path
    from jaxprm.serve import ServerHandle

    try:
        smollm2_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))

    model, tok = load_model("smollm2-135m")
    with ServerHandle.start(model, tok, model_name="smollm2-135m") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)
        r = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0, logprobs=True)
        answer = r.choices[0].message.content
        assert "Paris" in answer, answer
        assert all(x.logprob <= 0 for x in r.choices[0].logprobs.content)
        body = httpx.post(server.url + "/generate", timeout=600, json={
            "text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True}).json()
        assert "Paris" in body["text"], body["text"]
