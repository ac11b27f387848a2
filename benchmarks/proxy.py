"""Per-turn overhead of the recording proxy against calling the upstream directly.

    python -m benchmarks.proxy [--agents 1 64] [--turns 8] [--rounds 3] [--json benchmarks/results/proxy_cpu.json]

Three processes on loopback: the scripted upstream (``python -m rollout.testing``: a deterministic
policy, no model compute, so the proxy's cost is not hidden behind generation), the proxy
(``python -m rollout.proxy`` in front of it, SGLang dialect) and this one, where ``n`` agents
written with the official ``openai`` SDK each play ``turns`` chat turns (FrozenLake-shaped
conversations that grow every turn). Every turn's latency is timed around
``chat.completions.create``, once with the agents pointed at the upstream's own
``/v1/chat/completions`` ("direct") and once at the proxy ("proxy"); rounds alternate the two.

Reported per concurrency: latency p50 / p99 of both, the overhead ``proxy - direct`` at p50 / p99,
the proxy's own work per turn as it measures it (``/rl/stats``: the chat route's time outside the
upstream call: parsing, the parent rule, concat tokenization, recording, the answer; under load it
includes waiting for the event loop), p50 / p99, and the proxy process's CPU time per turn (all of
it: HTTP server and client included; from ``/proc``, so robust to a shared machine). The JSON
records the load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin"
SYSTEM = "FrozenLake: reach G, avoid holes O; P is you, _ is ice. Answer one move: ```Left```, ```Down```."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


async def _agents(base_url: str, keys: list[str], turns: int, http) -> list[float]:
    """``len(keys)`` agents play ``turns`` turns each; returns every turn's latency (s)."""
    import openai

    lat: list[float] = []

    async def agent(i: int, key: str) -> None:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key, http_client=http, max_retries=0)
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Map:\nP _ _ O\n_ O _ _\n_ _ _ O\nO _ _ G\nAgent {i}. What is your move?"}]
        for t in range(turns):
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=16, seed=i * 1000 + t)
            lat.append(time.perf_counter() - t0)
            msgs = [*msgs, {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"You moved.\nMap:\n_ P _ O\n_ O _ _\n_ _ _ O\nO _ _ G\nTurn {t}."}]

    await asyncio.gather(*(agent(i, k) for i, k in enumerate(keys)))
    return lat


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _pct(x: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(x) * 1e3, q))


async def _bench(up_url: str, px_url: str, agents: list[int], turns: int, rounds: int, proxy_pid: int) -> list[dict]:
    import httpx

    out = []
    limits = httpx.Limits(max_connections=max(agents) + 8, max_keepalive_connections=max(agents) + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        for n in agents:
            direct: list[float] = []
            proxied: list[float] = []
            cpu = 0.0
            await _agents(up_url + "/v1", ["x"] * n, 2, http)  # warm-up: connections, code paths
            await http.get(px_url + "/rl/stats?reset=1", headers=admin)
            k = max(rounds, -(-200 // (n * turns)))  # at least ~200 turns per mode
            for r in range(k):
                direct += await _agents(up_url + "/v1", ["x"] * n, turns, http)
                start = await http.post(px_url + "/rl/start_session", json={"task_id": f"b{n}-{r}", "group_size": n},
                                        headers=admin)
                sessions = start.json()["sessions"]
                c0 = _cpu_s(proxy_pid)
                proxied += await _agents(px_url + "/v1", [s["session_api_key"] for s in sessions], turns, http)
                c1 = _cpu_s(proxy_pid)
                cpu += (c1 - c0) if c0 is not None and c1 is not None else float("nan")
                await http.post(px_url + "/export_trajectories", headers=admin, json={
                    "session_ids": [s["session_id"] for s in sessions], "discard_trajectory": True})
            stats = (await http.get(px_url + "/rl/stats?reset=1", headers=admin)).json()["overhead_ms"]
            row = {
                "agents": n, "turns": len(proxied),
                "direct_p50_ms": _pct(direct, 50), "direct_p99_ms": _pct(direct, 99),
                "proxy_p50_ms": _pct(proxied, 50), "proxy_p99_ms": _pct(proxied, 99),
                "overhead_p50_ms": _pct(proxied, 50) - _pct(direct, 50),
                "overhead_p99_ms": _pct(proxied, 99) - _pct(direct, 99),
                "proxy_own_p50_ms": stats["p50"], "proxy_own_p99_ms": stats["p99"],
                "proxy_cpu_ms_per_turn": cpu * 1e3 / len(proxied),
            }
            out.append(row)
            print(f"{n:>6} {row['turns']:>6} {row['direct_p50_ms']:>9.2f} {row['direct_p99_ms']:>9.2f} "
                  f"{row['proxy_p50_ms']:>9.2f} {row['proxy_p99_ms']:>9.2f} {row['overhead_p50_ms']:>9.2f} "
                  f"{row['overhead_p99_ms']:>9.2f} {row['proxy_own_p50_ms']:>9.2f} {row['proxy_own_p99_ms']:>9.2f} "
                  f"{row['proxy_cpu_ms_per_turn']:>9.2f}",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, nargs="+", default=[1, 64])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="benchmarks/results/proxy_cpu.json")
    args = p.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAXPRM_PROXY_ADMIN_KEY=ADMIN)
    up_port, px_port = _free_port(), _free_port()
    up_url, px_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{px_port}"
    procs = []
    load_before = os.getloadavg()
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "rollout.testing", "--port", str(up_port), "--policy",
                                       "hashed"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
        _wait_up(up_url, procs[-1])
        procs.append(subprocess.Popen([sys.executable, "-m", "rollout.proxy", "--upstream", up_url, "--dialect", "sglang",
                                       "--tokenizer", "rollout.testing:make_test_tokenizer", "--port", str(px_port),
                                       "--default-max-tokens", "16", "--log-level", "error"],
                                      cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
        _wait_up(px_url, procs[-1])
        print(f"{'agents':>6} {'turns':>6} {'direct50':>9} {'direct99':>9} {'proxy50':>9} {'proxy99':>9} "
              f"{'ovh50':>9} {'ovh99':>9} {'own50':>9} {'own99':>9} {'cpu/turn':>9}   (ms per turn)")
        rows = asyncio.run(_bench(up_url, px_url, args.agents, args.turns, args.rounds, procs[-1].pid))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    result = {"benchmark": "proxy", "rows": rows, "turns_per_agent": args.turns, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "machine": platform.machine()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"load average before {load_before}, after {result['loadavg_after']}; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
