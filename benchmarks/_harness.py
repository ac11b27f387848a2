"""What the benchmarks share: loopback ports, waiting for a spawned server's ``/health``, the
scripted upstream (``python -m rollout.testing``), process samples, the machine's load, and
trainings in processes of their own (``train_process``, ``has_checkpoint``).

Each benchmark keeps its own argparse and table; its JSON goes through
``benchmarks.provenance.write_result``, by default to ``result_path(bench)``
(``benchmarks/results/<bench>_<device>[_variant].json``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["free_port", "wait_healthy", "start_scripted_upstream", "proc_sample", "loadavg", "train_process",
           "has_checkpoint"]

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released; the caller's server takes it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, *, timeout: float = 120.0, log: Path | None = None,
                 path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200. Raises ``RuntimeError`` if ``proc`` exits first, or
    (after killing it) if ``timeout`` seconds pass; both name ``log`` when given."""
    import httpx

    where = f"; see {log}" if log else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}{where}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url} did not answer {path} within {timeout:.0f} s{where}")


def start_scripted_upstream(policy: str, *args: str, env: dict[str, str] | None = None,
                            timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """``python -m rollout.testing --policy policy [args...]`` on a free loopback port (no model: a
    scripted OpenAI-compatible upstream); returns ``(process, url)`` once it is healthy."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu") if env is None else env
    proc = subprocess.Popen([sys.executable, "-m", "rollout.testing", "--port", str(port), "--policy", policy, *args],
                            cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout=timeout)
    return proc, url


def proc_sample(pid: int) -> dict[str, float]:
    """Process ``pid``'s RSS (MB), open descriptors and threads, from Linux ``/proc``."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    field = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in status if ":" in ln}
    return {"rss_mb": int(field["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(field["Threads"])}


def loadavg() -> list[float]:
    """``os.getloadavg()`` rounded (this machine is shared: numbers are compared with it beside them)."""
    return [round(x, 2) for x in os.getloadavg()]


def train_process(args: list[str], log: Path, *, cwd: Path | None = None) -> float:
    """``python -m jaxprm.train *args`` in a process of its own (compiled programs of earlier runs
    would otherwise pile up in the caller), its output appended to ``log``; returns its seconds.
    A failure raises ``RuntimeError`` with the log's tail and path (SIGKILL: most often memory)."""
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        rc = subprocess.run([sys.executable, "-m", "jaxprm.train", *args], stdout=f, stderr=subprocess.STDOUT,
                            cwd=cwd).returncode
    if rc != 0:
        why = " (killed by the kernel: most often out of memory)" if rc == -9 else ""
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"jaxprm.train {' '.join(args)} failed (exit {rc}){why}; its output is in {log}:\n{tail}")
    return time.perf_counter() - t0


def has_checkpoint(run_dir: Path) -> bool:
    """Whether an unfinished run left a config and a checkpoint to ``--resume`` from."""
    ckpt = run_dir / "checkpoints"
    return (run_dir / "config.yaml").is_file() and ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
