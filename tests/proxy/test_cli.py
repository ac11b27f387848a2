"""``python -m rollout.proxy``: a real process in front of the embedded server, driven by the SDK,
stopped with SIGTERM; bad arguments fail fast with a clear message."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from rollout.chat import PromptBuilder

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra):
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3", **extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serves_records_scores_and_stops(upstream, tmp_path):
    handle, tok = upstream
    prm = tmp_path / "prm.yaml"
    prm.write_text("prm:\n  enabled: true\n  scorers:\n    - path: scorers.LengthBudgetScorer\n"
                   "      kwargs: {max_output_tokens: 4}\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout.proxy", "--upstream", handle.url, "--tokenizer",
         "jaxprm.models:build_tiny_tokenizer", "--prm-config", str(prm), "--port", str(port),
         "--default-max-tokens", "8", "--log-level", "info"],
        cwd=ROOT, env=_env(JAXPRM_PROXY_ADMIN_KEY="cli-admin"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the proxy did not come up"
            time.sleep(0.2)
        admin = {"Authorization": "Bearer cli-admin"}
        start = httpx.post(url + "/rl/start_session", json={"task_id": "cli", "group_size": 2}, headers=admin)
        assert start.status_code == 201, start.text
        sessions = start.json()["sessions"]
        assert [s["session_id"] for s in sessions] == ["cli-0", "cli-1"]
        msgs = [{"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}]
        for s in sessions:
            client = openai.OpenAI(base_url=url + "/v1", api_key=s["session_api_key"], max_retries=0)
            client.chat.completions.create(model="m", messages=msgs)
            client.close()
            r = httpx.post(url + "/rl/set_reward", json={"reward": 1.0},
                           headers={"Authorization": f"Bearer {s['session_api_key']}"})
            assert r.status_code == 200 and r.json()["ready_transition"]
        out = httpx.post(url + "/export_trajectories", json={"session_ids": ["cli-0", "cli-1"]}, headers=admin,
                         timeout=60).json()
        assert len(out["rows"]) == 2 and set(out["prm_stats"]["sessions"]) == {"cli-0", "cli-1"}
        prompt = PromptBuilder(tok).initial(msgs)  # the proxy's tokenizer matches the server's
        assert all(r["tokens"][:len(prompt)] == prompt for r in out["rows"])
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully (the lifespan closes the runner, then the client), then
        # re-raises the signal it captured: the process ends "killed by SIGTERM", without a traceback
        assert proc.wait(60) in (0, -signal.SIGTERM)
        err = proc.stderr.read()
        assert "Traceback" not in err and "Application shutdown complete" in err, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_bad_arguments_fail_fast():
    out = subprocess.run([sys.executable, "-m", "rollout.proxy", "--upstream", "http://127.0.0.1:1", "--tokenizer",
                          "x:y"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--admin-key" in out.stderr
    out = subprocess.run([sys.executable, "-m", "rollout.proxy", "--upstream", "http://127.0.0.1:1", "--admin-key",
                          "k", "--tokenizer", "/nonexistent"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "--tokenizer '/nonexistent': not a directory" in out.stderr
    out = subprocess.run([sys.executable, "-m", "rollout.proxy", "--upstream", "ftp://x", "--admin-key", "k",
                          "--tokenizer", "x:y"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "must start with http:// or https://" in out.stderr
