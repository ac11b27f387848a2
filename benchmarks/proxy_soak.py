"""The recording proxy under load and over many sessions: nothing lost, memory and descriptors flat.

    python -m benchmarks.proxy_soak [--agents 256] [--turns 20] [--sessions 10000] [--wave 256]
                                    [--session-turns 2] [--json benchmarks/results/proxy_soak_cpu.json]

Processes on loopback, as ``benchmarks.proxy`` runs them: the scripted upstream (``python -m
rollout.testing --policy hashed``: no model, so the proxy is what is measured) and the proxy
(``python -m rollout.proxy``); the agents are this process, written with the official ``openai``
SDK (one ``AsyncOpenAI`` per agent over a shared connection pool), driven by asyncio.

1. **Load**: ``--agents`` agents at once (groups of 8), each ``--turns`` chat turns, then
   ``set_reward``; every group is exported. Checked: every agent's turns are in its row (one concat
   row per session, ``interaction_ids`` = the turns, in order), no group rejected. Reported: the
   proxy's own time per turn p50 / p99 (``/rl/stats``), the agents' latency p50 / p99 and turns/s.
2. **Soak**: ``--sessions`` sessions in waves of ``--wave`` concurrent agents of
   ``--session-turns`` turns, each wave exported and removed. After every wave the proxy process's
   RSS (``/proc/PID/status`` VmRSS), open descriptors (``/proc/PID/fd``) and threads are sampled.
   Reported: the samples, and the growth from the first quarter's mean to the last quarter's.

Writes the JSON (with provenance) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks._harness import proc_sample
from benchmarks.proxy import ADMIN, ROOT, start_proxy, start_stack, stop_all
from benchmarks.provenance import result_path, write_result

GROUP = 8


async def _wave(url: str, http, n: int, turns: int, tag: str, lat: list[float]) -> dict:
    """``n`` agents of ``turns`` turns (groups of :data:`GROUP`), rewarded and exported; returns counts."""
    import openai

    admin = {"Authorization": f"Bearer {ADMIN}"}
    groups = []
    for g in range(-(-n // GROUP)):
        size = min(GROUP, n - g * GROUP)
        r = await http.post(url + "/rl/start_session", headers=admin, json={"task_id": f"{tag}-{g}", "group_size": size})
        r.raise_for_status()
        groups.append((r.json()["group_id"], [s["session_api_key"] for s in r.json()["sessions"]],
                       [s["session_id"] for s in r.json()["sessions"]]))

    async def agent(key: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, http_client=http, max_retries=0)
        msgs = [{"role": "user", "content": "Map:\nP _ _ O\n_ O _ _\n_ _ _ O\nO _ _ G\nWhat is your move?"}]
        ids = []
        for t in range(turns):
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            lat.append(time.perf_counter() - t0)
            ids.append(r.id)
            msgs = [*msgs, {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"You moved. Turn {t}."}]
        (await http.post(url + "/rl/set_reward", headers={"Authorization": f"Bearer {key}"},
                         json={"reward": 1.0})).raise_for_status()
        return ids

    ids = await asyncio.gather(*(agent(k) for _, keys, _ in groups for k in keys))
    turns_by_session = dict(zip([sid for _, _, sids in groups for sid in sids], ids))
    rows = rejected = lost = 0
    for gid, _, sids in groups:
        out = (await http.post(url + "/export_trajectories", headers=admin,
                               json={"session_ids": sids, "group_id": gid})).json()
        rejected += "rejected" in out
        for row in out["rows"]:
            rows += 1
            lost += row["interaction_ids"] != turns_by_session[row["session_id"]]
    return {"sessions": n, "turns": n * turns, "rows": rows, "rejected_groups": rejected, "rows_not_matching": lost}


async def _run(url: str, pid: int, args) -> dict:
    import httpx

    admin = {"Authorization": f"Bearer {ADMIN}"}
    conns = 2 * max(args.agents, args.wave) + 8
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        await _wave(url, http, min(16, args.wave), 2, "warm", [])  # connections and code paths warm
        await http.get(url + "/rl/stats?reset=1", headers=admin)
        lat: list[float] = []
        t0 = time.perf_counter()
        load = await _wave(url, http, args.agents, args.turns, "load", lat)
        wall = time.perf_counter() - t0
        own = (await http.get(url + "/rl/stats", headers=admin)).json()["overhead_ms"]
        load.update(wall_s=wall, turns_per_s=load["turns"] / wall, own_p50_ms=own["p50"], own_p99_ms=own["p99"],
                    latency_p50_ms=1e3 * float(np.percentile(lat, 50)),
                    latency_p99_ms=1e3 * float(np.percentile(lat, 99)))
        print(f"load: {args.agents} agents x {args.turns} turns in {wall:.1f} s ({load['turns_per_s']:.0f} turns/s); "
              f"rows {load['rows']}, rejected groups {load['rejected_groups']}, rows not matching "
              f"{load['rows_not_matching']}; proxy's own time p50 {own['p50']:.2f} ms, p99 {own['p99']:.2f} ms; "
              f"agent latency p50 {load['latency_p50_ms']:.0f} ms, p99 {load['latency_p99_ms']:.0f} ms", flush=True)
        samples, done, totals = [], 0, {"rows": 0, "rejected_groups": 0, "rows_not_matching": 0}
        while done < args.sessions:
            n = min(args.wave, args.sessions - done)
            out = await _wave(url, http, n, args.session_turns, f"soak{done}", [])
            done += n
            for k in totals:
                totals[k] += out[k]
            samples.append({"sessions": done, **proc_sample(pid)})
            if len(samples) % 5 == 0 or done == args.sessions:
                s = samples[-1]
                print(f"  soak: {done:>6} sessions  RSS {s['rss_mb']:.1f} MB  fds {s['fds']}  threads {s['threads']}",
                      flush=True)
        live = (await http.get(url + "/rl/stats", headers=admin)).json()["live_sessions"]
    q = max(1, len(samples) // 4)
    growth = {k: float(np.mean([s[k] for s in samples[-q:]]) - np.mean([s[k] for s in samples[:q]]))
              for k in ("rss_mb", "fds", "threads")}
    soak = {"sessions": done, "session_turns": args.session_turns, "wave": args.wave, **totals,
            "live_sessions_after": live, "samples": samples, "growth_first_to_last_quarter": growth}
    print(f"soak: {done} sessions, rows {totals['rows']}, rejected {totals['rejected_groups']}, not matching "
          f"{totals['rows_not_matching']}, live after {live}; first->last quarter: RSS {growth['rss_mb']:+.1f} MB, "
          f"fds {growth['fds']:+.1f}, threads {growth['threads']:+.1f}", flush=True)
    return {"load": load, "soak": soak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_soak", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=256)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--wave", type=int, default=256)
    p.add_argument("--session-turns", type=int, default=2)
    p.add_argument("--json", default=None, help="default: benchmarks/results/proxy_soak_<device>.json")
    args = p.parse_args(argv)
    args.json = args.json or result_path("proxy_soak")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAXPRM_PROXY_ADMIN_KEY=ADMIN)
    procs: list[subprocess.Popen] = []
    try:
        up_url = start_stack(procs, "hashed", env)
        url = start_proxy(procs, up_url, "rollout.testing:make_test_tokenizer", 8, env)
        result = asyncio.run(_run(url, procs[-1].pid, args))
    finally:
        stop_all(procs)

    write_result(args.json, {"benchmark": "proxy_soak", **vars(args), **result})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
