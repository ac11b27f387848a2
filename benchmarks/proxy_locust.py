"""The recording proxy under a locust load: SDK agents spawned by locust, nothing lost.

    python -m benchmarks.proxy_locust [--agents 256] [--turns 20] [--spawn-rate 64]
                                      [--json benchmarks/results/proxy_locust_cpu.json]

The same stack as ``benchmarks.proxy_soak`` (the scripted upstream ``python -m rollout.testing
--policy hashed``: no model, so the proxy is what is measured; the proxy ``python -m rollout.proxy``),
but the load comes from locust (``locust --headless``, a separate process): ``--agents`` users, each
one agent written with the official ``openai`` SDK that plays one session of ``--turns`` chat
turns and sets its reward (``benchmarks/locust/proxy_agents.py``). The sessions are opened
beforehand in groups of 8; every group is exported after the run.

Checked: every session's row holds exactly the completions its agent received, in order
(``interaction_ids``), no group rejected, no locust failure. Reported: the chat turns' latency p50 /
p99 as the agents timed them (each also a locust request), the proxy's own time per turn p50 / p99
(``/rl/stats``), turns/s, and the proxy process's RSS, descriptors and threads before and after.
Writes the JSON (with provenance) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.proxy import ADMIN, ROOT, start_proxy, start_stack, stop_all
from benchmarks._harness import proc_sample
from benchmarks.proxy_soak import GROUP
from benchmarks.provenance import result_path, write_result

LOCUSTFILE = ROOT / "benchmarks" / "locust" / "proxy_agents.py"


def _locust() -> str:
    """The ``locust`` executable beside this interpreter (or on ``PATH``)."""
    here = Path(sys.executable).with_name("locust")
    found = str(here) if here.is_file() else shutil.which("locust")
    if found is None:
        raise SystemExit("locust is not installed: pip install locust (it is in the test extra)")
    return found


def open_sessions(url: str, n: int) -> tuple[list[tuple[str, list[str]]], list[dict]]:
    """``n`` sessions in groups of :data:`GROUP`: ``([(group_id, session_ids)], [{"session_id",
    "session_api_key"}])``."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    groups, sessions = [], []
    for g in range(-(-n // GROUP)):
        size = min(GROUP, n - g * GROUP)
        r = httpx.post(url + "/rl/start_session", headers=admin, json={"task_id": f"locust-{g}", "group_size": size})
        r.raise_for_status()
        body = r.json()
        groups.append((body["group_id"], [s["session_id"] for s in body["sessions"]]))
        sessions += [{"session_id": s["session_id"], "session_api_key": s["session_api_key"]} for s in body["sessions"]]
    return groups, sessions


def check_exports(url: str, groups: list[tuple[str, list[str]]], played: dict[str, list[str]]) -> dict[str, int]:
    """Export every group and compare each row's turns with what its agent received."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    rows = rejected = not_matching = 0
    for gid, sids in groups:
        out = httpx.post(url + "/export_trajectories", headers=admin, timeout=120,
                         json={"session_ids": sids, "group_id": gid}).json()
        rejected += "rejected" in out
        for row in out.get("rows", []):
            rows += 1
            not_matching += row["interaction_ids"] != played.get(row["session_id"])
    return {"rows": rows, "rejected_groups": rejected, "rows_not_matching": not_matching}


def _locust_counts(prefix: Path) -> dict[str, int]:
    """Requests and failures of the ``chat.completions`` row of locust's ``PREFIX_stats.csv`` (its
    last write; the latencies are taken from the agents' own records, every turn included)."""
    with open(f"{prefix}_stats.csv") as f:
        row = next((r for r in csv.DictReader(f) if r["Name"] == "chat.completions"), None)
    return {"locust_requests": int(row["Request Count"]) if row else 0,
            "failures": int(row["Failure Count"]) if row else 0}


def run(args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAXPRM_PROXY_ADMIN_KEY=ADMIN)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            up_url = start_stack(procs, "hashed", env)
            url = start_proxy(procs, up_url, "rollout.testing:make_test_tokenizer", 8, env)
            pid = procs[-1].pid
            groups, sessions = open_sessions(url, args.agents)
            (tmp / "sessions.json").write_text(json.dumps(sessions))
            httpx.get(url + "/rl/stats?reset=1", headers={"Authorization": f"Bearer {ADMIN}"}).raise_for_status()
            before = proc_sample(pid)
            cmd = [_locust(), "-f", str(LOCUSTFILE), "--headless", "--users", str(args.agents), "--spawn-rate",
                   str(args.spawn_rate), "--host", url, "--run-time", f"{args.max_s}s", "--csv", str(tmp / "locust"),
                   "--only-summary", "--loglevel", "WARNING", "--stop-timeout", "5"]
            lenv = dict(env, JAXPRM_LOCUST_SESSIONS=str(tmp / "sessions.json"), JAXPRM_LOCUST_TURNS=str(args.turns),
                        JAXPRM_LOCUST_OUT=str(tmp / "played.jsonl"))
            print(f"locust: {args.agents} SDK agents x {args.turns} turns against the proxy ...", flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=lenv, cwd=ROOT, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            after = proc_sample(pid)
            played_rows = [json.loads(line) for line in (tmp / "played.jsonl").read_text().splitlines()] \
                if (tmp / "played.jsonl").is_file() else []
            if not played_rows:
                raise RuntimeError(f"locust ran no session (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            played = {r["session_id"]: r["ids"] for r in played_rows}
            stats = _locust_counts(tmp / "locust")
            lat = [x for r in played_rows for x in r["latency_ms"]]
            stats.update(latency_p50_ms=float(np.percentile(lat, 50)), latency_p99_ms=float(np.percentile(lat, 99)),
                         latency_mean_ms=float(np.mean(lat)))
            own = httpx.get(url + "/rl/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()["overhead_ms"]
            checked = check_exports(url, groups, played)
        finally:
            stop_all(procs)
    turns = sum(len(ids) for ids in played.values())
    result = {"agents": args.agents, "turns_per_agent": args.turns, "sessions_played": len(played_rows),
              "sessions_with_error": sum(r["error"] is not None for r in played_rows), "turns": turns,
              "wall_s": wall, "turns_per_s": turns / wall, **stats, "own_p50_ms": own["p50"], "own_p99_ms": own["p99"],
              **checked, "proxy_before": before, "proxy_after": after, "locust_exit": proc.returncode}
    print(f"\n| agents x turns | turns | rows | rows not matching | rejected groups | locust failures | turns/s "
          f"| latency p50 / p99 (ms) | proxy's own p50 / p99 (ms) | proxy RSS (MB) before / after |\n"
          f"|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.agents} x {args.turns} | {turns} | {checked['rows']} | {checked['rows_not_matching']} "
          f"| {checked['rejected_groups']} | {stats['failures']} | {turns / wall:.0f} "
          f"| {stats['latency_p50_ms']:.0f} / {stats['latency_p99_ms']:.0f} | {own['p50']:.2f} / {own['p99']:.2f} "
          f"| {before['rss_mb']:.0f} / {after['rss_mb']:.0f} |", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_locust", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=256)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--spawn-rate", type=float, default=64.0, help="locust users started per second")
    p.add_argument("--max-s", type=int, default=1800, help="locust's --run-time cap (the run ends when every "
                                                           "agent has finished)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/proxy_locust_<device>.json")
    args = p.parse_args(argv)
    args.json = args.json or result_path("proxy_locust")
    result = run(args)

    write_result(args.json, {"benchmark": "proxy_locust", **vars(args), **result})
    print(f"wrote {args.json}")
    bad = result["rows_not_matching"] or result["rejected_groups"] or result["failures"] or result["sessions_with_error"] \
        or result["rows"] != args.agents
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
