"""Locust users for ``python -m benchmarks.proxy_locust`` (run by it; not imported by the project:
importing locust monkey-patches the process for gevent).

Each user is one agent written with the official ``openai`` SDK: it takes the next session of the
sessions file (``JAXPRM_LOCUST_SESSIONS``: ``[{"session_id", "session_api_key"}, ...]``), plays
``JAXPRM_LOCUST_TURNS`` chat turns through the proxy (``--host``), each timed as a locust request
``chat.completions``, sets the session's reward, appends ``{"session_id", "ids", "latency_ms", "error"}`` (the
completion ids it received, in order, and each turn's latency) to ``JAXPRM_LOCUST_OUT`` and stops. The last user to finish stops the run.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import gevent
import httpx
import openai
from locust import User, task
from locust.exception import StopUser

SESSIONS = json.loads(Path(os.environ["JAXPRM_LOCUST_SESSIONS"]).read_text())
TURNS = int(os.environ["JAXPRM_LOCUST_TURNS"])
OUT = Path(os.environ["JAXPRM_LOCUST_OUT"])
FIRST = "Map:\nP _ _ O\n_ O _ _\n_ _ _ O\nO _ _ G\nWhat is your move?"
_next = itertools.count()
_finished = itertools.count(1)


class ProxyAgent(User):
    """One SDK agent session of ``TURNS`` turns."""

    def on_start(self) -> None:
        i = next(_next)
        if i >= len(SESSIONS):
            raise StopUser()
        self.session = SESSIONS[i]
        self.client = openai.OpenAI(base_url=self.host + "/v1", api_key=self.session["session_api_key"],
                                    max_retries=0, timeout=600)

    @task
    def play(self) -> None:
        msgs = [{"role": "user", "content": FIRST}]
        ids: list[str] = []
        latency_ms: list[float] = []
        error = None
        for t in range(TURNS):
            t0 = time.perf_counter()
            try:
                r = self.client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            except Exception as e:  # counted by locust as a failure; the session's row will not match
                error = repr(e)
            latency_ms.append(1e3 * (time.perf_counter() - t0))
            self.environment.events.request.fire(
                request_type="POST", name="chat.completions", response_time=latency_ms[-1],
                response_length=0, exception=None if error is None else RuntimeError(error), context={})
            if error is not None:
                break
            ids.append(r.id)
            msgs = [*msgs, {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"You moved. Turn {t}."}]
        if error is None:
            httpx.post(self.host + "/rl/set_reward", json={"reward": 1.0}, timeout=600,
                       headers={"Authorization": f"Bearer {self.session['session_api_key']}"}).raise_for_status()
        with OUT.open("a") as f:
            f.write(json.dumps({"session_id": self.session["session_id"], "ids": ids, "latency_ms": latency_ms,
                                "error": error}) + "\n")
        if next(_finished) == len(SESSIONS):
            gevent.spawn_later(1.0, self.environment.runner.quit)
        raise StopUser()
