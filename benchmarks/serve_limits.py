"""How long one heavy request makes others wait (issue 19, item 3), on ``python -m jaxprm.serve
--model tiny`` started as a subprocess on a free loopback port.

    python -m benchmarks.serve_limits [--json benchmarks/results/serve_limits_cpu.json] [--repeats 2]

1. ``/health`` latency (p50, max) while a 3.9 MB text prompt is tokenized (it is then refused: too
   long for the context), against ``/health`` alone.
2. A 4-token completion's latency alone, and submitted 1 s after the largest request the default
   ``max_request_tokens`` (32768) admits: 32 rows x 1000 tokens and 64 rows x 500 tokens (ignore_eos,
   so they run to their cap); the issue's 256 rows x 1024 tokens is refused with a 400 at once.

Each measurement is repeated ``--repeats`` times (round 0 also pays the XLA compiles of the new
batch shapes, e.g. 33 decode rows). Prints a table and writes the JSON (load average before and
after: timings on a shared machine are noisy). About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._harness import free_port, wait_healthy
from benchmarks.provenance import result_path, write_result

ROOT = Path(__file__).resolve().parents[1]


def _start(port: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "jaxprm.serve", "--model", "tiny", "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=300)
    return proc


def _health_during(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """/health latencies while ``body`` is posted to /v1/completions."""
    done, lat = threading.Event(), []
    result: dict[str, Any] = {}

    def big():
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        result.update(status=r.status_code, seconds=round(time.perf_counter() - t, 2))
        done.set()

    th = threading.Thread(target=big)
    with httpx.Client(base_url=url, timeout=600) as c:
        th.start()
        while not done.is_set():
            t = time.perf_counter()
            c.get("/health")
            lat.append(time.perf_counter() - t)
            time.sleep(0.005)
    th.join()
    return {"request_status": result["status"], "request_s": result["seconds"], "health_answers": len(lat),
            "health_p50_ms": round(1e3 * statistics.median(lat), 1), "health_max_ms": round(1e3 * max(lat), 1)}


def _small(c: httpx.Client) -> float:
    t = time.perf_counter()
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t


def _small_behind(url: str, rows: int, max_tokens: int) -> dict[str, Any]:
    """A 4-token request's latency, sent 1 s after a request of ``rows`` x ``max_tokens``."""
    prompts = [f"hello {i}" for i in range(rows // 32 or 1)]
    n = rows // len(prompts)
    result: dict[str, Any] = {}

    def big():
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"prompt": prompts, "n": n, "max_tokens": max_tokens,
                                                      "ignore_eos": True}, timeout=900)
        result.update(status=r.status_code, seconds=round(time.perf_counter() - t, 2),
                      message=r.json().get("error", {}).get("message", "")[:160] if r.status_code != 200 else "")

    th = threading.Thread(target=big)
    th.start()
    time.sleep(1.0)
    with httpx.Client(base_url=url, timeout=900) as c:
        small = _small(c)
    th.join()
    return {"rows": rows, "max_tokens": max_tokens, "big_status": result["status"], "big_s": result["seconds"],
            "big_message": result["message"], "small_s": round(small, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_limits", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="default: benchmarks/results/serve_limits_<device>.json")
    p.add_argument("--repeats", type=int, default=3, help="rounds (round 0 includes the first compiles)")
    args = p.parse_args(argv)
    args.json = args.json or result_path("serve_limits")
    load0 = os.getloadavg()
    port = free_port()
    proc = _start(port)
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(0)
    words = ["frozen", "lake", "hole", "goal", "left", "right", "up", "down"]
    text = " ".join(rng.choice(words) for _ in range(700_000))[:3_900_000]
    out: dict[str, Any] = {"health_alone": [], "health_during_long_prompt": [], "small_alone_s": [],
                           "small_behind": []}
    try:
        with httpx.Client(base_url=url, timeout=600) as c:
            for _ in range(3):  # warm-up: compile the small request's programs
                _small(c)
        for rnd in range(args.repeats):
            out["health_during_long_prompt"].append({"round": rnd, **_health_during(url, {"prompt": text,
                                                                                        "max_tokens": 2})})
            with httpx.Client(base_url=url, timeout=600) as c:
                lat = []
                for _ in range(50):
                    t = time.perf_counter()
                    c.get("/health")
                    lat.append(time.perf_counter() - t)
                out["health_alone"].append({"round": rnd, "health_p50_ms": round(1e3 * statistics.median(lat), 1),
                                            "health_max_ms": round(1e3 * max(lat), 1)})
                out["small_alone_s"].append(round(_small(c), 3))
            for rows, max_tokens in ((32, 1000), (64, 500), (256, 1024)):
                out["small_behind"].append({"round": rnd, **_small_behind(url, rows, max_tokens)})
    finally:
        proc.terminate()
        proc.wait(30)
    out.update(loadavg_start=list(load0), loadavg_end=list(os.getloadavg()))
    print(f"{'measurement':<52} result")
    for h in out["health_during_long_prompt"]:
        print(f"{'/health during a 3.9 MB prompt (p50 / max ms)':<52} {h['health_p50_ms']} / {h['health_max_ms']}  "
              f"({h['health_answers']} answers; prompt: {h['request_status']} after {h['request_s']} s)")
    for h in out["health_alone"]:
        print(f"{'/health alone (p50 / max ms)':<52} {h['health_p50_ms']} / {h['health_max_ms']}")
    print(f"{'4-token request alone (s)':<52} {out['small_alone_s']}")
    for b in out["small_behind"]:
        label = f"[{b['round']}] 4-token request behind {b['rows']} rows x {b['max_tokens']} tokens (s)"
        print(f"{label:<52} {b['small_s']}  (big: {b['big_status']} after {b['big_s']} s)")
    print(f"load average {out['loadavg_start']} -> {out['loadavg_end']}")
    if args.json:
        write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
