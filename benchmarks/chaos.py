"""Chaos campaigns: kill the trainer's generation servers mid-run and check that nothing is lost.

    python -m benchmarks.chaos [--kills 10] [--steps 40] [--down-s 20] [--seed 0] [--json PATH]

The generation campaign: two external ``python -m jaxprm.serve`` processes (the tiny model, base
weights) serve one training run (``server.kind: external``, both URLs). At random moments
(seeded) one of them is SIGKILLed -- inside a step, with requests in flight -- and restarted on the
same port ``--down-s`` seconds later with its *base* weights. The trainer must take it out of
rotation, finish the step on the other server (the same requests, the same seeds), and give the
restarted server the current weights (checked by ``/get_weight_version``) before it samples again.
Each kill comes 1-3 steps after the previous server recovered, so at most one server is down at a
time; ``--steps`` must leave room for all of them (about ``(down_s + 10) / step_s`` steps a kill).

Reported, per campaign: faults injected, steps lost (train rows missing from 1..N; goal 0), rows
duplicated (goal 0), the largest ``behavior_kl`` of any step (a server sampling stale weights
shows here; ~0 means every sample came from the learner's policy), failovers and recoveries the
rows counted, and the time to recover (from a restart to the trainer's "is back" line). Writes
JSON (with provenance) to ``benchmarks/results/chaos_cpu.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The trainer's settings in a campaign: tiny and quick, no warm start (the servers' base weights are
#: the policy's version 0), a checkpoint every step.
CONFIG = [
    "env.train_tasks=64", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.every_steps=1000",
    "eval.at_start=false", "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1",
    "rollout.k=2", "rollout.strategy=flat", "warm_start.enabled=false", "checkpoint.every_steps=1",
    "checkpoint.keep=2", "progress=false", "plots=false", "export_final=false", "server.kind=external",
    "server.model_name=jaxprm", "server.dialect=vllm",
]


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m jaxprm.serve --model tiny`` on a fixed loopback port, in its own process group;
    :meth:`kill` SIGKILLs it, :meth:`start` (re)starts it with base weights and waits for ``/health``."""

    def __init__(self, port: int, weights_root: Path, log: Path) -> None:
        self.port, self.weights_root, self.log = port, weights_root, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        f = open(self.log, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxprm.serve", "--model", "tiny", "--port", str(self.port),
             "--served-model-name", "jaxprm", "--weights-root", str(self.weights_root)],
            cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        f.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server on port {self.port} exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server on port {self.port} did not answer /health within {timeout:.0f} s; see {self.log}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(60)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def train_rows(run: Path) -> list[dict]:
    from jaxprm.train.rundir import read_metrics

    path = run / "metrics.jsonl"
    return [r for r in read_metrics(path) if r.get("kind") == "train"] if path.is_file() else []


def _done(run: Path) -> int:
    return max((r["step"] for r in train_rows(run)), default=0)


def _wait_for_weights(url: str, *, deadline: float, trainer: subprocess.Popen) -> float | None:
    """When a restarted server (version 0, base weights) first reports a weight version > 0 -- the
    trainer's push -- or ``None`` if that did not happen before ``deadline`` or the run ended."""
    while time.monotonic() < deadline and trainer.poll() is None:
        try:
            with urllib.request.urlopen(url + "/get_weight_version", timeout=2) as r:
                if int(json.loads(r.read())["weight_version"]) > 0:
                    return time.monotonic()
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return None


def _generated_tokens(url: str) -> float | None:
    """The server's ``jaxprm:generation_tokens`` counter (``/metrics``), ``None`` if it does not answer."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("jaxprm:generation_tokens_total"))


def generation_campaign(work: Path, *, steps: int, kills: int, down_s: float, rng: random.Random,
                        timeout: float = 3600.0, extra: list[str] = ()) -> dict:
    """One training run against two external servers, ``kills`` of which are SIGKILLed (at random
    moments inside random steps, one at a time) and restarted ``down_s`` later; see the module
    docstring. Returns the campaign's record."""
    work.mkdir(parents=True, exist_ok=True)
    weights = work / "weights"
    weights.mkdir(exist_ok=True)
    servers = [ServerProcess(free_port(), weights, work / f"server{i}.log") for i in range(2)]
    for s in servers:
        s.start()
    run = work / "run"
    log = work / "train.log"
    args = [*CONFIG, f"steps={steps}", f"server.urls=[{servers[0].url},{servers[1].url}]",
            f"server.weight_sync_dir={weights}", f"run_dir={run}", *extra]
    faults: list[dict] = []
    with open(log, "a") as f:
        trainer = subprocess.Popen([sys.executable, "-m", "jaxprm.train", *args], cwd=ROOT, env=_env(), stdout=f,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        for _ in range(kills):
            # a kill 1-3 steps after the previous server recovered, a random fraction into its step
            target = _done(run) + rng.randint(1, 3)
            while trainer.poll() is None and _done(run) < target and time.monotonic() < deadline:
                time.sleep(0.05)
            if trainer.poll() is not None or time.monotonic() >= deadline:
                break
            rows = train_rows(run)
            time.sleep(rng.uniform(0.1, 0.9) * float(rows[-1].get("step_s", 2.0)))
            victim = rng.choice(servers)
            t_kill = time.monotonic()
            step_at_kill = _done(run)
            victim.kill()
            time.sleep(down_s)
            t_restart = time.monotonic()
            victim.start()
            started = time.monotonic()
            recovered = _wait_for_weights(victim.url, deadline=min(deadline, started + 300), trainer=trainer)
            faults.append({"server": victim.url, "after_step": step_at_kill, "down_s": round(t_restart - t_kill, 1),
                           "restart_s": round(started - t_restart, 1),
                           "recover_s": None if recovered is None else round(recovered - started, 1)})
        rc = trainer.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(trainer.pid, signal.SIGKILL)
        rc = -1
    finally:
        served = {s.url: _generated_tokens(s.url) for s in servers}  # since each one's last (re)start
        for s in servers:
            s.kill()
    rows = train_rows(run)
    steps_seen = [r["step"] for r in rows]
    return {
        "kind": "generation server",
        "returncode": rc,
        "faults": len(faults),
        "kills": faults,
        "steps": steps,
        "steps_lost": len(set(range(1, steps + 1)) - set(steps_seen)),
        "rows_duplicated": len(steps_seen) - len(set(steps_seen)),
        "max_behavior_kl": max((float(r["behavior_kl"]) for r in rows if r.get("behavior_kl") is not None),
                               default=None),
        "generated_tokens_since_restart": served,
        "failovers": sum(int(r.get("server_failovers", 0)) for r in rows),
        "downs": sum(int(r.get("server_downs", 0)) for r in rows),
        "recoveries": sum(int(r.get("server_recoveries", 0)) for r in rows),
        "log_tail": log.read_text()[-1500:] if rc != 0 else "",
    }


def _table(campaigns: list[dict]) -> str:
    lines = ["| campaign | faults | steps lost | rows duplicated | max behavior_kl | failovers | recoveries "
             "| time to recover (s, median / max) |", "|---|---|---|---|---|---|---|---|"]
    for c in campaigns:
        rec = sorted(k["recover_s"] for k in c["kills"] if k.get("recover_s") is not None)
        rec_s = f"{rec[len(rec) // 2]:.1f} / {rec[-1]:.1f}" if rec else "-"
        kl = "-" if c["max_behavior_kl"] is None else f"{c['max_behavior_kl']:.1e}"
        lines.append(f"| {c['kind']} | {c['faults']} | {c['steps_lost']} | {c['rows_duplicated']} | {kl} "
                     f"| {c['failovers']} | {c['recoveries']} | {rec_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="generation-server kills in the campaign")
    ap.add_argument("--steps", type=int, default=160, help="training steps of the campaign's run")
    ap.add_argument("--down-s", type=float, default=20.0, help="seconds a killed server stays down")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill times and victims")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "chaos_cpu.json")
    ap.add_argument("--work", type=Path, default=None, help="where runs and logs go (default: a temp dir)")
    args = ap.parse_args(argv)
    from benchmarks.provenance import provenance

    work = args.work or Path(tempfile.mkdtemp(prefix="jaxprm-chaos-"))
    rng = random.Random(args.seed)
    campaigns = [generation_campaign(work / "generation", steps=args.steps, kills=args.kills, down_s=args.down_s,
                                     rng=rng)]
    table = _table(campaigns)
    print(table)
    out = {**provenance(), "benchmark": "chaos", "kills": args.kills, "steps": args.steps, "down_s": args.down_s,
           "seed": args.seed, "load_average": os.getloadavg(), "campaigns": campaigns, "table": table}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json} (runs and logs under {work})")
    return 0 if all(c["returncode"] == 0 and c["steps_lost"] == 0 and c["rows_duplicated"] == 0
                    for c in campaigns) else 1


if __name__ == "__main__":
    sys.exit(main())
