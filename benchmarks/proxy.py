"""Per-turn overhead of the recording proxy against calling the upstream directly.

    python -m benchmarks.proxy [--agents 1 64] [--gen-ms 0 500] [--turns 8] [--samples 400]
                               [--kinds chat tools] [--anchor REV] [--json benchmarks/results/proxy_cpu.json]

Processes on loopback: the scripted upstream (``python -m rollout.testing``: a deterministic policy
and no model, so the proxy's cost is not hidden behind generation; ``--gen-ms`` makes each of its
answers take that long, as generation would, without using the CPU; set through its ``/script``
route), the proxy (``python -m
rollout.proxy`` in front of it, SGLang dialect), optionally the proxy of an older commit
(``--anchor REV``, run from ``git archive REV``), and this process, where ``n`` agents written with
the official ``openai`` SDK play FrozenLake-shaped conversations that grow every turn.

**Interleaved, paired.** Every turn of every agent calls each arm once with the same messages, in
an order that rotates with the turn and the agent: the upstream's own ``/v1/chat/completions``
("direct"), the proxy (whose answer continues the conversation, so every later turn is a concat
turn with a parent) and the anchor. The arms therefore see the same machine load at the same
moments, and each proxied turn has a direct twin. Reported per concurrency:

- latency p50 / p99 of each arm (ms, around ``chat.completions.create``);
- ``overhead_p50`` = p50(proxy) - p50(direct), ``overhead_p99`` likewise, and ``paired_p50``, the
  median over turns of (proxy - its direct twin);
- ``cpu_ms_per_turn``: the proxy process's CPU time (user + system, from ``/proc``: everything it
  does, HTTP server and client included) divided by the turns it served: robust to a shared
  machine, and the proxy's capacity is ``1000 / cpu_ms_per_turn`` turns/s per core;
- ``own_p50`` / ``own_p99``: the proxy's own wall time per turn as it measures it (``/rl/stats``:
  the chat route from the request body to the built answer, minus the upstream wait; under load it
  includes waiting for the event loop).

``--kinds``: ``chat`` turns answer a fenced move; ``tools`` turns send a ``move`` function tool,
the upstream answers a Hermes tool call (the tools template on both sides), the proxy parses it
into ``message.tool_calls`` and the agent answers with a ``tool`` message, so the overhead includes
the parser, the tools rendered into every concat continuation and the tool-message checks. Each
kind runs its own upstream and proxy processes, one after the other; rows carry ``kind``.

``--gen-ms`` is per concurrency (one value for all, or one per ``--agents`` entry). At 64 agents a
zero-time upstream is saturated by this machine's own CPUs, and then the latencies measure the
machine's throughput, not the proxy; the default gives it 500 ms per answer (a short generation).
The JSON records the load average before and after each concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._harness import free_port, start_scripted_upstream, wait_healthy
from benchmarks.provenance import result_path, write_result

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin"
SYSTEM = "FrozenLake: reach G, avoid holes O; P is you, _ is ice. Answer one move: ```Left```, ```Down```."
MOVE = {"type": "function", "function": {"name": "move", "description": "Move one cell.", "parameters": {
    "type": "object", "properties": {"direction": {"type": "string", "enum": ["Left", "Down", "Right", "Up"]}},
    "required": ["direction"]}}}
KINDS = {"chat": ("hashed", "rollout.testing:make_test_tokenizer"),
         "tools": ("tools", "rollout.testing:make_tools_test_tokenizer")}  # kind -> (upstream policy, tokenizer)


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _ms(x: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(x) * 1e3, q)) if x else None


def _first_message(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Map:\nP _ _ O\n_ O _ _\n_ _ _ O\nO _ _ G\nAgent {i}. What is your move?"}]


async def _agents(arms: dict[str, tuple[str, list[str]]], n: int, turns: int, http, offset: int,
                  tools: bool = False) -> dict[str, list[float]]:
    """``n`` agents play ``turns`` turns; each turn calls every arm (rotating order). ``arms``:
    name -> (base URL, one key per agent). The ``proxy`` arm's answer continues the conversation
    (``tools``: its tool call, answered by a tool message). Returns each arm's latencies (s), in
    (agent, turn) order."""
    import openai

    names = list(arms)
    lat: dict[str, list[float | None]] = {a: [None] * (n * turns) for a in names}

    async def agent(i: int) -> None:
        clients = {a: openai.AsyncOpenAI(base_url=url, api_key=keys[i], http_client=http, max_retries=0)
                   for a, (url, keys) in arms.items()}
        msgs = _first_message(i)
        for t in range(turns):
            k = (t + i + offset) % len(names)
            answer = None
            for a in names[k:] + names[:k]:
                t0 = time.perf_counter()
                try:
                    r = await clients[a].chat.completions.create(model="m", messages=msgs, seed=i * 1000 + t,
                                                                 **({"tools": [MOVE], "max_tokens": 64} if tools
                                                                    else {"max_tokens": 16}))
                except Exception as e:
                    raise RuntimeError(f"agent {i} turn {t}: the {a} arm failed: {type(e).__name__}: {e}") from e
                lat[a][i * turns + t] = time.perf_counter() - t0
                if a == "proxy":
                    answer = r.choices[0].message.model_dump(exclude_none=True)
            observation = f"You moved.\nMap:\n_ P _ O\n_ O _ _\n_ _ _ O\nO _ _ G\nTurn {t}."
            if tools:
                if not answer.get("tool_calls"):
                    raise RuntimeError(f"agent {i} turn {t}: the proxy answered no tool call: {answer}")
                reply = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": observation}
            else:
                reply = {"role": "user", "content": observation}
            msgs = [*msgs, answer, reply]

    await asyncio.gather(*(agent(i) for i in range(n)))
    return {a: [x for x in v if x is not None] for a, v in lat.items()}


async def _bench(upstream: str, proxies: dict[str, tuple[str, int]], agents: list[int], gen_ms: list[float],
                 turns: int, samples: int, kind: str = "chat") -> list[dict]:
    import httpx

    out = []
    admin = {"Authorization": f"Bearer {ADMIN}"}
    limits = httpx.Limits(max_connections=4 * max(agents) + 8, max_keepalive_connections=4 * max(agents) + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        for n, delay in zip(agents, gen_ms):
            (await http.post(upstream + "/script", json={"delay_s": delay / 1000.0})).raise_for_status()
            load_before = os.getloadavg()
            lat: dict[str, list[float]] = {"direct": [], **{a: [] for a in proxies}}
            cpu = {a: 0.0 for a in proxies}
            rounds = max(1, -(-samples // (n * turns)))
            for r in range(rounds + 1):  # round 0 warms connections and code paths up (not timed)
                arms: dict[str, tuple[str, list[str]]] = {"direct": (upstream + "/v1", ["x"] * n)}
                for a, (url, _) in proxies.items():
                    start = await http.post(url + "/rl/start_session", headers=admin,
                                            json={"task_id": f"b{n}-{r}", "group_size": n})
                    start.raise_for_status()
                    arms[a] = (url + "/v1", [s["session_api_key"] for s in start.json()["sessions"]])
                if r == 1:
                    for url, _ in proxies.values():
                        await http.get(url + "/rl/stats?reset=1", headers=admin)
                c0 = {a: _cpu_s(pid) for a, (_, pid) in proxies.items()}
                got = await _agents(arms, n, turns if r else 2, http, offset=r, tools=kind == "tools")
                c1 = {a: _cpu_s(pid) for a, (_, pid) in proxies.items()}
                if r:
                    for a in lat:
                        lat[a] += got[a]
                    for a in proxies:
                        ok = c0[a] is not None and c1[a] is not None
                        cpu[a] += (c1[a] - c0[a]) if ok else float("nan")
                for a, (url, _) in proxies.items():
                    await http.post(url + "/export_trajectories", headers=admin, json={
                        "session_ids": [f"b{n}-{r}-{i}" for i in range(n)], "discard_trajectory": True})
            row: dict = {"kind": kind, "agents": n, "gen_ms": delay, "turns": len(lat["direct"]), "loadavg_before": load_before,
                         "loadavg_after": os.getloadavg()}
            for a, v in lat.items():
                row[f"{a}_p50_ms"], row[f"{a}_p99_ms"] = _ms(v, 50), _ms(v, 99)
            for a, (url, _) in proxies.items():
                pre = "" if a == "proxy" else f"{a}_"
                diffs = [p - d for p, d in zip(lat[a], lat["direct"])]
                row[f"{pre}overhead_p50_ms"] = row[f"{a}_p50_ms"] - row["direct_p50_ms"]
                row[f"{pre}overhead_p99_ms"] = row[f"{a}_p99_ms"] - row["direct_p99_ms"]
                row[f"{pre}paired_p50_ms"] = _ms(diffs, 50)
                row[f"{pre}cpu_ms_per_turn"] = cpu[a] * 1e3 / len(lat[a])
                own = (await http.get(url + "/rl/stats", headers=admin)).json()["overhead_ms"]
                row[f"{pre}own_p50_ms"], row[f"{pre}own_p99_ms"] = own["p50"], own["p99"]
            out.append(row)
            _print_row(row, list(proxies))
    return out


_COLS = [("direct_p50_ms", "direct50"), ("direct_p99_ms", "direct99"), ("proxy_p50_ms", "proxy50"),
         ("proxy_p99_ms", "proxy99"), ("overhead_p50_ms", "ovh50"), ("overhead_p99_ms", "ovh99"),
         ("paired_p50_ms", "paired50"), ("own_p50_ms", "own50"), ("own_p99_ms", "own99"),
         ("cpu_ms_per_turn", "cpu/turn")]


def _print_header(proxies: list[str]) -> None:
    extra = "".join(f" {'anc_ovh50':>9} {'anc_cpu':>9}" for a in proxies if a != "proxy")
    print(f"{'kind':>5} {'agents':>6} {'gen_ms':>6} {'turns':>6} " + " ".join(f"{h:>9}" for _, h in _COLS) + extra
          + "   (ms per turn; load average at the end)", flush=True)


def _print_row(row: dict, proxies: list[str]) -> None:
    cells = " ".join(f"{row[k]:>9.2f}" if row.get(k) is not None else f"{'-':>9}" for k, _ in _COLS)
    extra = "".join(f" {row[f'{a}_overhead_p50_ms']:>9.2f} {row[f'{a}_cpu_ms_per_turn']:>9.2f}"
                    for a in proxies if a != "proxy")
    print(f"{row['kind']:>5} {row['agents']:>6} {row['gen_ms']:>6.0f} {row['turns']:>6} {cells}{extra}   "
          f"load {row['loadavg_after'][0]:.1f}", flush=True)


def _export_rev(rev: str, into: Path) -> None:
    """The packages of commit ``rev`` (``git archive``) under ``into``."""
    data = subprocess.run(["git", "archive", rev, "rollout", "scorers", "jaxprm"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")


def start_stack(procs: list[subprocess.Popen], policy: str, env: dict[str, str]) -> str:
    """Start the scripted upstream (``python -m rollout.testing --policy policy``) into ``procs``;
    returns its URL once it answers."""
    proc, url = start_scripted_upstream(policy, env=env)
    procs.append(proc)
    return url


def start_proxy(procs: list[subprocess.Popen], upstream: str, tokenizer: str, max_tokens: int, env: dict[str, str],
                cwd: Path = ROOT) -> str:
    """Start ``python -m rollout.proxy`` (SGLang dialect) in front of ``upstream`` into ``procs``;
    returns its URL once it answers."""
    port = free_port()
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "rollout.proxy", "--upstream", upstream, "--dialect", "sglang", "--tokenizer",
         tokenizer, "--port", str(port), "--default-max-tokens", str(max_tokens), "--log-level", "error"],
        cwd=cwd, env=env))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, procs[-1])
    return url


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes, then kill what did not exit within 30 s."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run_kind(kind: str, trees: dict[str, Path], args, gen_ms: list[float], env: dict[str, str], path) -> list[dict]:
    """Start the scripted upstream and one proxy per tree for ``kind``, run the agents, stop them."""
    policy, tokenizer = KINDS[kind]
    procs: list[subprocess.Popen] = []
    proxies: dict[str, tuple[str, int]] = {}
    try:
        up_url = start_stack(procs, policy, env)
        for name, tree in trees.items():
            url = start_proxy(procs, up_url, tokenizer, 16, dict(env, PYTHONPATH=path(tree)), cwd=tree)
            proxies[name] = (url, procs[-1].pid)
        _print_header(list(proxies))
        return asyncio.run(_bench(up_url, proxies, args.agents, gen_ms, args.turns, args.samples, kind))
    finally:
        stop_all(procs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, nargs="+", default=[1, 64])
    p.add_argument("--gen-ms", type=float, nargs="+", default=None,
                   help="upstream answer time per concurrency (default: 0 for one agent, 500 otherwise)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--samples", type=int, default=400, help="timed turns per arm and concurrency (at least)")
    p.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS),
                   help="chat (fenced moves) and/or tools (move function calls parsed by the proxy)")
    p.add_argument("--anchor", default=None, help="also time the proxy of this git revision (e.g. main)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/proxy_<device>.json")
    args = p.parse_args(argv)
    args.json = args.json or result_path("proxy")
    gen_ms = args.gen_ms or [0.0 if n == 1 else 500.0 for n in args.agents]
    if len(gen_ms) == 1:
        gen_ms = gen_ms * len(args.agents)
    if len(gen_ms) != len(args.agents):
        p.error("--gen-ms takes one value or one per --agents entry")
    inherited = os.environ.get("PYTHONPATH", "")
    path = lambda tree: os.pathsep.join(p for p in (str(tree), inherited) if p)  # noqa: E731
    env = dict(os.environ, PYTHONPATH=path(ROOT), JAX_PLATFORMS="cpu", JAXPRM_PROXY_ADMIN_KEY=ADMIN)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        anchor_dir = None
        if args.anchor:
            anchor_dir = Path(tmp) / "anchor"
            anchor_dir.mkdir()
            _export_rev(args.anchor, anchor_dir)
        for kind in args.kinds:  # the anchor's proxy may predate tools: it runs the chat kind only
            trees = {"proxy": ROOT, **({"anchor": anchor_dir} if anchor_dir is not None and kind == "chat" else {})}
            rows += _run_kind(kind, trees, args, gen_ms, env, path)

    write_result(args.json, {"benchmark": "proxy", "rows": rows, "turns_per_agent": args.turns,
                             "anchor": args.anchor, "kinds": args.kinds})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
