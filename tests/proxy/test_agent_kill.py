"""An agent process killed mid-session (SIGKILL, real processes over loopback HTTP): its group is
rejected at export (``missing_session``) and counted, the other groups train, and a killed agent's
session that nobody exports is discarded by the stale sweep."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx

from rollout.client import ClientConfig
from rollout.proxy import ProxyConfig, ProxyServer
from rollout.testing import ScriptedServer, ServerScript, hashed_action_policy, make_test_tokenizer

from .conftest import ADMIN

AGENT = Path(__file__).resolve().parents[2] / "benchmarks" / "agent_process.py"


async def _agent(srv, key: str, turns: int, pause: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, str(AGENT), srv.url, key, str(turns), str(pause),
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def _kill_after_first_turn(proc: asyncio.subprocess.Process) -> None:
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.startswith(b"turn 0"), (line, (await proc.stderr.read())[-2000:])
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL


def test_a_killed_agent_rejects_its_group_and_the_others_train():
    tok = make_test_tokenizer()

    async def go():
        with ScriptedServer(ServerScript(policy=hashed_action_policy(tok)), tok) as up:
            cfg = ProxyConfig(upstream=ClientConfig(endpoints=(up.url,), timeout_s=30, max_retries=0), admin_key=ADMIN,
                              default_max_tokens=8, session_timeout_s=60.0)
            srv = await ProxyServer.start(cfg, tok)
            try:
                ga, a = srv.proxy.start_session("a", group_size=3)
                gb, b = srv.proxy.start_session("b", group_size=2)
                _, (c,) = srv.proxy.start_session("c")
                procs = [await _agent(srv, s.api_key, 3, 0.3) for s in (*a, *b, c)]
                await asyncio.gather(_kill_after_first_turn(procs[1]), _kill_after_first_turn(procs[5]))
                codes = [await p.wait() for p in procs]
                admin = {"Authorization": f"Bearer {ADMIN}"}
                async with httpx.AsyncClient(timeout=60) as http:
                    out_a = (await http.post(srv.url + "/export_trajectories", headers=admin,
                                             json={"session_ids": [s.id for s in a], "group_id": ga})).json()
                    out_b = (await http.post(srv.url + "/export_trajectories", headers=admin,
                                             json={"session_ids": [s.id for s in b], "group_id": gb})).json()
                # c (killed, never exported) goes stale: the sweep as it runs a minute later
                swept = srv.proxy.store.sweep(cfg.session_timeout_s, now=time.monotonic() + cfg.session_timeout_s + 1)
                return codes, out_a, out_b, c, swept, srv.proxy.stats()
            finally:
                await srv.stop()

    codes, out_a, out_b, c, swept, stats = asyncio.run(go())
    assert codes == [0, -signal.SIGKILL, 0, 0, 0, -signal.SIGKILL]
    assert out_a["rows"] == [] and out_a["rejected"]["reason"] == "missing_session"
    assert out_a["rejected"]["session_ids"] == ["a-1"]
    assert len(out_b["rows"]) == 2 and all(len(r["interaction_ids"]) == 3 for r in out_b["rows"])
    assert stats["rejected_groups"] == 1 and stats["exported_rows"] == 2
    assert swept == [c.id] and c.removed and stats["live_sessions"] == 0
