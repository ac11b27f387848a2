"""Chaos campaigns: kill the servers and agents a training run depends on, and check nothing is lost.

    python -m benchmarks.chaos [--kills 10] [--scorer-kills 5] [--agent-kills 10] [--down-s 20]
                               [--only generation scorer agent] [--seed 0] [--json PATH]

* **Generation servers.** Two external ``python -m jaxprm.serve`` processes (the tiny model, base
  weights) serve one training run (``server.kind: external``, both URLs). At random moments
  (seeded) one of them is SIGKILLed -- inside a step's rollout, with requests in flight -- and
  restarted on the same port ``--down-s`` seconds later with its *base* weights. The trainer must
  take it out of rotation, finish the step on the other server (the same requests, the same seeds),
  and give the restarted server the current weights (checked by ``/get_weight_version``) before it
  samples again. Time to recover: from the restart to the server reporting the trainer's weights.
* **A scorer server.** A run whose process reward is an LLM judge (``python -m rollout.testing
  --policy judge``); the judge is SIGKILLed and restarted the same way. Its calls fail (after two
  failed calls the breaker refuses at once), the step's groups are scored again once it answers
  (``prm.unavailable_wait_s``). Time to recover: from the restart to the first train row written
  after it with no group rejected.
* **Agent processes** behind the recording proxy (the official SDK, ``benchmarks/agent_process.py``),
  SIGKILLed after a random turn: a group with a killed member must be rejected and counted, every
  other group exports one full row per session, no interaction twice ("steps lost" counts lost rows).

Each kill comes 1-3 steps after the previous recovery, so at most one server is down at a time;
the runs' ``--steps`` leave room for all kills. Reported per campaign: faults injected, steps lost
(train rows missing from 1..N; goal 0), rows duplicated (goal 0), the largest ``behavior_kl`` of
any step (a server sampling stale weights shows here; ~0: every sample came from the learner's
policy), the steps without an update (every group rejected: the row is there, nothing was
learned), the failovers and recoveries the rows counted, and the time to recover. Writes JSON (with
provenance) to ``benchmarks/results/chaos_cpu.json`` and prints a table.
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
from collections.abc import Callable
from pathlib import Path

from benchmarks._harness import free_port, wait_healthy
from benchmarks.provenance import provenance, result_path, write_result

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


class ServerProcess:
    """A server process on a fixed loopback port, in its own process group: ``command`` (default
    ``python -m jaxprm.serve --model tiny`` with base weights); :meth:`kill` SIGKILLs it,
    :meth:`start` (re)starts it and waits for ``/health``."""

    def __init__(self, port: int, weights_root: Path | None, log: Path, command: list[str] | None = None) -> None:
        self.port, self.weights_root, self.log = port, weights_root, log
        self.url = f"http://127.0.0.1:{port}"
        self.command = command or ["-m", "jaxprm.serve", "--model", "tiny", "--port", str(port),
                                   "--served-model-name", "jaxprm", "--weights-root", str(weights_root)]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        f = open(self.log, "a")
        self.proc = subprocess.Popen([sys.executable, *self.command], cwd=ROOT, env=_env(), stdout=f,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        f.close()
        try:
            wait_healthy(self.url, self.proc, timeout=timeout, log=self.log)
        except RuntimeError:
            self.kill()  # its whole process group
            raise
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(60)


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


def _kill_loop(trainer: subprocess.Popen, run: Path, servers: list[ServerProcess], *, kills: int, down_s: float,
               rng: random.Random, deadline: float,
               recovered: Callable[[ServerProcess, float], float | None]) -> list[dict]:
    """SIGKILL one of ``servers`` ``kills`` times while ``trainer`` runs: each kill 1-3 steps after the
    previous recovery, a random fraction into the step's rollout (the last rollout's length); restart the victim ``down_s`` later, then
    ``recovered(victim, restart_time)`` gives the moment the run had it back (``None``: never).
    Returns one record per kill."""
    faults = []
    for _ in range(kills):
        target = _done(run) + rng.randint(1, 3)
        while trainer.poll() is None and _done(run) < target and time.monotonic() < deadline:
            time.sleep(0.05)
        if trainer.poll() is not None or time.monotonic() >= deadline:
            break
        rows = train_rows(run)  # the next step's rollout begins as a row is written: kill inside it
        time.sleep(rng.uniform(0.1, 0.9) * float(rows[-1].get("rollout_s", 0.5)))
        victim = rng.choice(servers)
        t_kill = time.monotonic()
        step_at_kill = _done(run)
        victim.kill()
        time.sleep(down_s)
        t_restart = time.monotonic()
        victim.start()
        started = time.monotonic()
        back = recovered(victim, started)
        faults.append({"server": victim.url, "after_step": step_at_kill, "down_s": round(t_restart - t_kill, 1),
                       "restart_s": round(started - t_restart, 1),
                       "recover_s": None if back is None else round(back - started, 1)})
    return faults


def _trainer(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen([sys.executable, "-m", "jaxprm.train", *args], cwd=ROOT, env=_env(), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _finish(trainer: subprocess.Popen, deadline: float) -> int:
    try:
        return trainer.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(trainer.pid, signal.SIGKILL)
        return -1


def _run_record(kind: str, rc: int, faults: list[dict], steps: int, rows: list[dict], log: Path) -> dict:
    """What every trainer campaign reports: faults, train rows missing from 1..N or duplicated."""
    steps_seen = [r["step"] for r in rows]
    return {
        "kind": kind,
        "returncode": rc,
        "faults": len(faults),
        "kills": faults,
        "steps": steps,
        "steps_lost": len(set(range(1, steps + 1)) - set(steps_seen)),
        "rows_duplicated": len(steps_seen) - len(set(steps_seen)),
        "skipped_steps": sum(bool(r.get("skipped")) for r in rows),  # every group rejected: no update
        "max_behavior_kl": max((float(r["behavior_kl"]) for r in rows if r.get("behavior_kl") is not None),
                               default=None),
        "log_tail": log.read_text()[-1500:] if rc != 0 else "",
    }


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
    run, log = work / "run", work / "train.log"
    trainer = _trainer([*CONFIG, f"steps={steps}", f"server.urls=[{servers[0].url},{servers[1].url}]",
                        f"server.weight_sync_dir={weights}", f"run_dir={run}", *extra], log)
    deadline = time.monotonic() + timeout
    try:
        faults = _kill_loop(trainer, run, servers, kills=kills, down_s=down_s, rng=rng, deadline=deadline,
                            recovered=lambda v, t: _wait_for_weights(v.url, deadline=min(deadline, t + 300),
                                                                     trainer=trainer))
        rc = _finish(trainer, deadline)
    finally:
        served = {s.url: _generated_tokens(s.url) for s in servers}  # since each one's last (re)start
        for s in servers:
            s.kill()
    rows = train_rows(run)
    return {**_run_record("generation server", rc, faults, steps, rows, log),
            "generated_tokens_since_restart": served,
            "failovers": sum(int(r.get("server_failovers", 0)) for r in rows),
            "downs": sum(int(r.get("server_downs", 0)) for r in rows),
            "recoveries": sum(int(r.get("server_recoveries", 0)) for r in rows)}


def judge_config(url: str, **kwargs) -> str:
    """A config (YAML) whose process reward is an LLM judge at ``url`` on every turn (flat GRPO);
    ``kwargs`` override the judge's (timeouts, retries, breaker)."""
    import yaml

    judge = {"base_url": url, "model": "judge", "timeout_s": 5, "max_retries": 1, "backoff_s": 0.05,
             "breaker_failures": 2, "breaker_probe_s": 1.0, **kwargs}
    return yaml.safe_dump({"rollout": {"strategy": "flat"},
                           "prm": {"enabled": True, "scorers": [{"path": "scorers.LLMJudgeScorer", "weight": 0.1,
                                                                 "kwargs": judge}],
                                   "advantage_shaping": {"mode": "additive"}}})


def _rejected(row: dict) -> int:
    return int(row.get("prm_rejected_groups", 0))


def _first_clean_step(run: Path, *, after_rows: int, deadline: float, trainer: subprocess.Popen) -> float | None:
    """When a train row written after the first ``after_rows`` (those before the restart) first shows
    no group rejected by the scorers; ``None`` if none did before ``deadline``."""
    while time.monotonic() < deadline and trainer.poll() is None:
        if any(not _rejected(r) for r in train_rows(run)[after_rows:]):
            return time.monotonic()
        time.sleep(0.1)
    return None


def scorer_campaign(work: Path, *, steps: int, kills: int, down_s: float, rng: random.Random,
                    timeout: float = 3600.0) -> dict:
    """One training run (embedded generation) whose process reward is an LLM judge server that is
    SIGKILLed ``kills`` times and restarted ``down_s`` later: groups are rejected with a reason
    while it is down (the breaker fails them at once), the run goes on, scoring resumes."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    judge = ServerProcess(port, None, work / "judge.log",
                          ["-m", "rollout.testing", "--port", str(port), "--policy", "judge"]).start()
    (work / "judge.yaml").write_text(judge_config(judge.url))
    run, log = work / "run", work / "train.log"
    trainer = _trainer(["--config", str(work / "judge.yaml"), *[c for c in CONFIG if not c.startswith("server.")],
                        "rollout.strategy=flat", f"steps={steps}", f"run_dir={run}"], log)
    deadline = time.monotonic() + timeout
    try:
        faults = _kill_loop(trainer, run, [judge], kills=kills, down_s=down_s, rng=rng, deadline=deadline,
                            recovered=lambda v, t: _first_clean_step(run, after_rows=len(train_rows(run)),
                                                                     deadline=min(deadline, t + 300), trainer=trainer))
        rc = _finish(trainer, deadline)
    finally:
        judge.kill()
    rows = train_rows(run)
    kinds: dict[str, int] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("prm_rejected/"):
                kinds[k.split("/", 1)[1]] = kinds.get(k.split("/", 1)[1], 0) + int(v)
    return {**_run_record("scorer server (LLM judge)", rc, faults, steps, rows, log),
            "groups_rejected": sum(_rejected(r) for r in rows), "rejected_by_kind": kinds,
            "failovers": 0, "recoveries": sum(k["recover_s"] is not None for k in faults)}


AGENT = ROOT / "benchmarks" / "agent_process.py"


async def _agent_round(proxy, http, admin: dict, rng: random.Random, *, groups: int, size: int, turns: int,
                       kills: int, tag: str) -> dict:
    """One round of the agent campaign: ``groups`` groups of ``size`` agent processes (the official
    SDK, ``turns`` turns each) through the proxy; ``kills`` of them are SIGKILLed after a random
    turn. Every group is exported; returns what came back."""
    import asyncio

    sessions = []
    for g in range(groups):
        gid, members = proxy.proxy.start_session(f"{tag}-g{g}", group_size=size)
        sessions += [(gid, s) for s in members]
    procs = [await asyncio.create_subprocess_exec(sys.executable, str(AGENT), proxy.url, s.api_key, str(turns), "0.05",
                                                  stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
             for _, s in sessions]
    victims = set(rng.sample(range(len(procs)), kills))

    async def watch(i: int) -> bool:
        """Run agent ``i`` (killing it after a random turn if it is a victim); True if it was killed."""
        proc = procs[i]
        after = rng.randrange(turns - 1) if i in victims else None
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            if after is not None and line.startswith(f"turn {after}".encode()):
                proc.send_signal(signal.SIGKILL)
                break
        return await proc.wait() == -signal.SIGKILL

    killed = await asyncio.gather(*[watch(i) for i in range(len(procs))])
    by_group: dict[str, list] = {}
    for (gid, s), k in zip(sessions, killed):
        by_group.setdefault(gid, []).append((s, k))
    out = {"killed": sum(killed), "groups": len(by_group), "rejected_with_kill": 0, "rejected_without_kill": 0,
           "rows": 0, "rows_expected": 0, "short_rows": 0, "interaction_ids": []}
    for gid, members in by_group.items():
        r = await http.post(proxy.url + "/export_trajectories", headers=admin,
                            json={"session_ids": [s.id for s, _ in members], "group_id": gid})
        body = r.json()
        hit = any(k for _, k in members)
        if body.get("rejected"):
            out["rejected_with_kill" if hit else "rejected_without_kill"] += 1
        else:
            out["rows_expected"] += len(members)
            out["rows"] += len(body["rows"])
            out["interaction_ids"] += [i for row in body["rows"] for i in row["interaction_ids"]]
            out["short_rows"] += sum(len(row["interaction_ids"]) != turns for row in body["rows"])
    return out


def agent_campaign(*, kills: int, rounds: int, rng: random.Random, groups: int = 4, size: int = 3,
                   turns: int = 4) -> dict:
    """Agent processes behind the proxy (a scripted upstream) killed mid-session: ``kills`` over
    ``rounds`` rounds. A group with a killed member must be rejected and counted; every other group
    exports one row per session with every turn; no interaction is exported twice."""
    import asyncio

    import httpx

    from rollout.client import ClientConfig
    from rollout.proxy import ProxyConfig, ProxyServer
    from rollout.testing import ScriptedServer, ServerScript, hashed_action_policy, make_test_tokenizer

    tok = make_test_tokenizer()
    admin_key = "chaos-admin"
    per_round = [kills // rounds + (i < kills % rounds) for i in range(rounds)]

    async def go() -> dict:
        with ScriptedServer(ServerScript(policy=hashed_action_policy(tok)), tok) as up:
            cfg = ProxyConfig(upstream=ClientConfig(endpoints=(up.url,), timeout_s=30, max_retries=0),
                              admin_key=admin_key, default_max_tokens=8, session_timeout_s=60.0)
            proxy = await ProxyServer.start(cfg, tok)
            try:
                async with httpx.AsyncClient(timeout=60) as http:
                    t0 = time.monotonic()
                    results = [await _agent_round(proxy, http, {"Authorization": f"Bearer {admin_key}"}, rng,
                                                  groups=groups, size=size, turns=turns, kills=k, tag=f"r{i}")
                               for i, k in enumerate(per_round)]
                    wall = time.monotonic() - t0
                return {"rounds": results, "stats": proxy.proxy.stats(), "wall_s": wall}
            finally:
                await proxy.stop()

    out = asyncio.run(go())
    rounds_ = out["rounds"]
    ids = [i for r in rounds_ for i in r["interaction_ids"]]
    stats = out["stats"]
    return {
        "kind": "agent process",
        "returncode": 0,
        "faults": sum(r["killed"] for r in rounds_),
        "groups": sum(r["groups"] for r in rounds_),
        "groups_rejected_with_a_kill": sum(r["rejected_with_kill"] for r in rounds_),
        "groups_rejected_without_a_kill": sum(r["rejected_without_kill"] for r in rounds_),
        "steps_lost": sum(r["rows_expected"] - r["rows"] + r["short_rows"] for r in rounds_),  # rows lost
        "rows_duplicated": len(ids) - len(set(ids)),
        "rejected_groups_counted": stats.get("rejected_groups"),
        "live_sessions_after": stats.get("live_sessions"),
        "max_behavior_kl": None, "failovers": 0, "recoveries": 0, "kills": [],
        "wall_s": round(out["wall_s"], 1),
    }


def campaign_table(campaigns: list[dict]) -> str:
    """The campaigns as a markdown table (one row per campaign)."""
    lines = ["| campaign | faults | steps lost | rows duplicated | steps without an update | max behavior_kl "
             "| failovers | recoveries | time to recover (s, median / max) |", "|---|---|---|---|---|---|---|---|---|"]
    for c in campaigns:
        rec = sorted(k["recover_s"] for k in c["kills"] if k.get("recover_s") is not None)
        rec_s = f"{rec[len(rec) // 2]:.1f} / {rec[-1]:.1f}" if rec else "-"
        kl = "-" if c["max_behavior_kl"] is None else f"{c['max_behavior_kl']:.1e}"
        skipped = f"{c['skipped_steps']} of {c['steps']}" if "skipped_steps" in c else "-"
        lines.append(f"| {c['kind']} | {c['faults']} | {c['steps_lost']} | {c['rows_duplicated']} | {skipped} | {kl} "
                     f"| {c['failovers']} | {c['recoveries']} | {rec_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="generation-server kills")
    ap.add_argument("--scorer-kills", type=int, default=5, help="judge-server kills")
    ap.add_argument("--agent-kills", type=int, default=10, help="agent-process kills")
    ap.add_argument("--steps", type=int, default=200, help="training steps of the generation campaign's run")
    ap.add_argument("--scorer-steps", type=int, default=60, help="training steps of the scorer campaign's run")
    ap.add_argument("--down-s", type=float, default=20.0, help="seconds a killed server stays down")
    ap.add_argument("--only", choices=["generation", "scorer", "agent"], nargs="*", default=None,
                    help="run only these campaigns (the JSON keeps the other campaigns it holds)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill times and victims")
    ap.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/chaos_<device>.json")
    ap.add_argument("--work", type=Path, default=None, help="where runs and logs go (default: a temp dir)")
    ap.add_argument("--table", action="store_true", help="only print the table of the existing JSON (and store it)")
    args = ap.parse_args(argv)
    args.json = args.json or result_path("chaos")
    if args.table:
        out = json.loads(args.json.read_text())
        out["table"] = campaign_table(out["campaigns"])
        args.json.write_text(json.dumps(out, indent=1))  # not write_result: the file keeps its run's provenance
        print(out["table"])
        return 0

    only = set(args.only or ["generation", "scorer", "agent"])
    work = args.work or Path(tempfile.mkdtemp(prefix="jaxprm-chaos-"))
    rng = random.Random(args.seed)
    campaigns = []
    if "generation" in only:
        campaigns.append(generation_campaign(work / "generation", steps=args.steps, kills=args.kills,
                                             down_s=args.down_s, rng=rng))
    if "scorer" in only:
        campaigns.append(scorer_campaign(work / "scorer", steps=args.scorer_steps, kills=args.scorer_kills,
                                         down_s=args.down_s, rng=rng))
    if "agent" in only:
        campaigns.append(agent_campaign(kills=args.agent_kills, rounds=max(1, args.agent_kills // 2), rng=rng))
    for c in campaigns:
        c["provenance"] = provenance()  # each campaign's own: --only re-runs some and keeps the others
    if args.only and args.json.is_file():  # keep the campaigns not re-run, in their order
        fresh = {c["kind"]: c for c in campaigns}
        kept = [fresh.pop(c["kind"], c) for c in json.loads(args.json.read_text())["campaigns"]]
        campaigns = kept + list(fresh.values())
    table = campaign_table(campaigns)
    print(table)
    out = {"benchmark": "chaos", **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "load_average": os.getloadavg(), "campaigns": campaigns, "table": table}
    write_result(args.json, out)
    print(f"wrote {args.json} (runs and logs under {work})")
    return 0 if all(c["returncode"] == 0 and c["steps_lost"] == 0 and c["rows_duplicated"] == 0
                    for c in campaigns) else 1


if __name__ == "__main__":
    sys.exit(main())
