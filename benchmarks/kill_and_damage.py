"""Kill-and-damage campaign: SIGKILL the trainer at random points (startup, inside a step, in the
middle of a checkpoint save), resume it each time, then damage its latest checkpoint in one of four
ways and resume once more; every campaign must end with train rows for steps exactly 1..N.

    python -m benchmarks.kill_and_damage [--steps 6] [--kills 3] [--strategy flat|tree_random|patr] [--json PATH]

One campaign per damage kind (truncated array file, garbage metadata, empty directory, half-written
directory). Uninterrupted reference runs of the same config give the yardstick for what a resume
reproduces: the data of every train row (rewards, successes, tokens, ...) and the final parameters
(max |difference| of the exported policy). Two reference runs also show how much two uninterrupted
runs differ from each other. Prints a table and writes JSON (with the machine's load average) to
``benchmarks/results/kill_and_damage_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.provenance import result_path, write_result

ROOT = Path(__file__).resolve().parents[1]
TMP_SUFFIX = ".orbax-checkpoint-tmp"

CONFIG = [
    "env.train_tasks=32", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.every_steps=3",
    "eval.at_start=false", "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1",
    "warm_start.enabled=false", "checkpoint.every_steps=1", "checkpoint.keep=3",
    "progress=false", "plots=false", "export_final=true",
]
#: Fields of a train row that are data (what was sampled and rewarded), not timings or float losses.
DATA_FIELDS = ("reward", "success", "groups_with_success", "mixed_groups", "trajectories", "sampled_actions",
               "invalid_rate", "generated_tokens", "kept_groups", "rows", "seq_len", "trained_tokens")


# ------------------------------------------------------------------------------------------------
# the four kinds of damage (also used by tests/train/test_checkpoints.py)


def truncate_array_file(d: Path) -> None:
    """Cut every array data file of the checkpoint to half its length."""
    files = [p for p in (d / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    if not files:
        raise RuntimeError(f"{d}: no array data files")
    for f in files:
        os.truncate(f, f.stat().st_size // 2)


def garbage_metadata(d: Path) -> None:
    """Overwrite the array tree's metadata with random bytes."""
    (d / "state" / "_METADATA").write_bytes(np.random.default_rng(0).bytes(200))


def empty_directory(d: Path) -> None:
    shutil.rmtree(d)
    d.mkdir()


def half_written(d: Path) -> None:
    """What a copy or save cut short leaves: the arrays' item, but no metadata item, no commit marker."""
    shutil.rmtree(d / "meta")
    (d / "commit_success.txt").unlink()


DAMAGE = {"truncated array file": truncate_array_file, "garbage metadata": garbage_metadata,
          "empty directory": empty_directory, "half-written directory": half_written}


# ------------------------------------------------------------------------------------------------
# running and killing


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")


def _train_steps(run: Path) -> list[int]:
    from jaxprm.train.rundir import read_metrics

    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]


def _last_step_s(run: Path, default: float = 3.0) -> float:
    """Wall seconds of the run's latest train step (``default`` before the first)."""
    from jaxprm.train.rundir import read_metrics

    rows = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train" and "step_s" in r]
    return float(rows[-1]["step_s"]) if rows else default


def _start(args: list[str], log: Path) -> subprocess.Popen:
    f = open(log, "a")
    return subprocess.Popen([sys.executable, "-m", "jaxprm.train", *args], cwd=ROOT, env=_env(), stdout=f,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _checkpoints(run: Path) -> list[int]:
    d = run / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _again(run: Path, base: list[str]) -> list[str]:
    """``--resume RUN`` once the run wrote its config; a run killed before that starts afresh."""
    return ["--resume", str(run)] if (run / "config.yaml").is_file() else base


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: server thread, checkpoint writers
    proc.wait(60)


def _saving(run: Path) -> bool:
    ck = run / "checkpoints"
    try:
        return any(TMP_SUFFIX in e.name for e in os.scandir(ck))
    except FileNotFoundError:
        return False


def _kill_at_random(proc: subprocess.Popen, run: Path, steps: int, rng: random.Random, timeout: float) -> dict:
    """Kill ``proc`` at a random point: during startup, at a random moment inside a random later step,
    or while a checkpoint is being written. Returns what happened."""
    mode = rng.choice(["startup", "in-step", "mid-save"])
    done = max(_train_steps(run) or [0])
    deadline = time.monotonic() + timeout
    if mode == "startup":
        delay = rng.uniform(0.5, 8.0)
        while time.monotonic() < deadline and proc.poll() is None and delay > 0:
            time.sleep(0.05)
            delay -= 0.05
    elif mode == "in-step":
        # a random moment of step ``target``: a random fraction of the last step's duration after
        # step ``target - 1`` ended (a fixed delay overshoots short steps into the run's end)
        target = rng.randint(done + 1, steps) if done < steps else steps
        while time.monotonic() < deadline and proc.poll() is None and max(_train_steps(run) or [0]) < target - 1:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.1, 0.9) * _last_step_s(run))
    else:
        skip = rng.randint(0, max(0, steps - done - 2))  # which of the coming saves to hit
        seen = 0
        while time.monotonic() < deadline and proc.poll() is None:
            if _saving(run):
                if seen >= skip:
                    break
                seen += 1
                while _saving(run) and proc.poll() is None:
                    time.sleep(0.002)
            time.sleep(0.002)
    saving = _saving(run)
    if proc.poll() is not None:
        return {"mode": mode, "killed": False, "returncode": proc.returncode, "steps_done": max(_train_steps(run) or [0])}
    _kill(proc)
    return {"mode": mode, "killed": True, "while_saving": saving, "steps_done": max(_train_steps(run) or [0])}


def _finish(args: list[str], log: Path, timeout: float) -> int:
    proc = _start(args, log)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return -1


def _policy(run: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted((run / "policy").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _compare(run: Path, ref: Path) -> dict:
    from jaxprm.train.rundir import read_metrics

    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"}
    ref_rows = {r["step"]: r for r in read_metrics(ref / "metrics.jsonl") if r.get("kind") == "train"}
    data_equal = all(rows.get(s, {}).get(k) == r.get(k) for s, r in ref_rows.items() for k in DATA_FIELDS)
    loss_diff = max((abs(rows[s][k] - r[k]) for s, r in ref_rows.items() for k in ("loss", "grad_norm")
                     if s in rows and isinstance(r.get(k), float) and isinstance(rows[s].get(k), float)), default=None)
    a, b = _policy(run), _policy(ref)
    param_diff = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in b) if a else None
    return {"data_rows_equal": data_equal, "max_loss_or_grad_norm_diff": loss_diff, "max_param_diff": param_diff,
            "params_bitwise_equal": bool(a) and all(np.array_equal(a[k], b[k]) for k in b)}


def campaign(kind: str, work: Path, config: list[str], steps: int, kills: int, rng: random.Random,
             timeout: float) -> dict:
    run = work / kind.replace(" ", "_")
    log = work / f"{run.name}.log"
    base = [*config, f"steps={steps}", f"run_dir={run}"]
    events, t0 = [], time.monotonic()
    proc = _start(base, log)
    events.append(_kill_at_random(proc, run, steps, rng, timeout))
    for _ in range(kills - 1):
        proc = _start(_again(run, base), log)
        events.append(_kill_at_random(proc, run, steps, rng, timeout))
    # keep going until two checkpoints exist, so that one older than the damaged one is kept
    while len(_checkpoints(run)) < 2:
        if _finish(_again(run, base), log, timeout) != 0:
            raise RuntimeError(f"{run}: a resume failed; see {log}")
    latest = _checkpoints(run)[-1]
    DAMAGE[kind](run / "checkpoints" / str(latest))
    n_before = len(log.read_text().splitlines())
    rc = _finish(["--resume", str(run)], log, timeout)
    tail = "\n".join(log.read_text().splitlines()[n_before:])
    train = _train_steps(run)
    return {
        "damage": kind, "kills": events, "damaged_step": latest,
        "warned": f"checkpoint {latest} (" in tail and "is damaged" in tail,
        "final_returncode": rc, "train_steps": train, "steps_exact": train == list(range(1, steps + 1)),
        "lost": sorted(set(range(1, steps + 1)) - set(train)), "duplicated": len(train) - len(set(train)),
        "wall_s": time.monotonic() - t0, "run_dir": str(run),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kill_and_damage", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs per campaign before the damage")
    p.add_argument("--references", type=int, default=2, help="uninterrupted reference runs")
    p.add_argument("--strategy", default="flat", choices=("flat", "tree_random", "patr"))
    p.add_argument("--set", nargs="*", default=[], metavar="key=value", help="extra trainer overrides")
    p.add_argument("--kinds", default=",".join(DAMAGE), help="damage kinds to run, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="per process")
    p.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/kill_and_damage_<device>.json")
    args = p.parse_args(argv)
    args.json = args.json or result_path("kill_and_damage")
    rng = random.Random(args.seed)
    config = [*CONFIG, f"rollout.strategy={args.strategy}", *args.set]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := set(kinds) - set(DAMAGE):
        p.error(f"--kinds: unknown {sorted(unknown)}; known: {list(DAMAGE)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kill_and_damage-"))
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    t0 = time.monotonic()
    refs = []
    for i in range(args.references):
        ref = work / f"reference-{i}"
        rc = _finish([*config, f"steps={args.steps}", f"run_dir={ref}"], work / f"reference-{i}.log", args.timeout)
        if rc != 0:
            print(f"reference run {i} failed ({rc}); see {work}/reference-{i}.log", file=sys.stderr)
            return 1
        refs.append(ref)
    results = []
    for kind in kinds:
        res = campaign(kind, work, config, args.steps, args.kills, rng, args.timeout)
        res["vs_reference"] = _compare(Path(res["run_dir"]), refs[0]) if res["final_returncode"] == 0 else None
        results.append(res)
        print(f"{kind}: kills={[(e['mode'], e.get('steps_done'), e.get('while_saving')) for e in res['kills']]} "
              f"steps_exact={res['steps_exact']} warned={res['warned']} {res['vs_reference']}", flush=True)
    between_refs = _compare(refs[1], refs[0]) if len(refs) > 1 else None
    kills = [e for r in results for e in r["kills"]]
    summary = {
        "campaigns": len(results), "sigkills": sum(e["killed"] for e in kills),
        "sigkills_mid_save": sum(bool(e.get("while_saving")) for e in kills if e["killed"]),
        "all_resumed": all(r["final_returncode"] == 0 for r in results),
        "all_steps_exact": all(r["steps_exact"] for r in results),
        "lost_steps": sum(len(r["lost"]) for r in results), "duplicated_steps": sum(r["duplicated"] for r in results),
        "all_damage_warned": all(r["warned"] for r in results),
        "data_rows_equal_to_reference": all((r["vs_reference"] or {}).get("data_rows_equal") for r in results),
        "max_param_diff_vs_reference": max(((r["vs_reference"] or {}).get("max_param_diff") or 0.0) for r in results),
        "reference_vs_reference": between_refs,
    }
    out = {"config": {"steps": args.steps, "kills_per_campaign": args.kills, "seed": args.seed,
                      "overrides": config},
           "summary": summary, "campaigns": results, "wall_s": time.monotonic() - t0,
           "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    print("\n| damage | kills (mode@steps, mid-save) | steps 1..N | warned | data = ref | max |dparam| |")
    print("|---|---|---|---|---|---|")
    for r in results:
        k = ", ".join(f"{e['mode']}@{e.get('steps_done')}{'*' if e.get('while_saving') else ''}"
                      + ("" if e["killed"] else " (ended)") for e in r["kills"])
        v = r["vs_reference"] or {}
        print(f"| {r['damage']} | {k} | {r['steps_exact']} | {r['warned']} | {v.get('data_rows_equal')} | "
              f"{v.get('max_param_diff')} |")
    print(json.dumps(summary, indent=1))
    write_result(args.json, out)
    ok = summary["all_resumed"] and summary["all_steps_exact"] and summary["all_damage_warned"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
