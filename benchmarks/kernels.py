"""Learner-kernel throughput: jitted JAX vs float64 numpy vs eager PyTorch (AReaL-style).

    python -m benchmarks.kernels [--sizes 8x512,64x2048,256x8192] [--repeats 5] [--json PATH]
                                 [--anchor REV]

For each kernel and size it reports tokens/s (B*T per second) of the jitted float32 JAX kernel, of a
float64 numpy implementation and (when torch is installed) of an eager float32 PyTorch version
written the way the reference system does it (a Python loop over time for GAE, autograd for the
loss). It also measures the memory-copy bandwidth (the host's on the CPU backend, the device's on an
accelerator, where the PyTorch references run on CUDA too) and reports each JAX kernel's achieved
bytes/s (compulsory reads + writes, float32, masks as float32) as a fraction of it.

``--break-even`` times only GAE's sequential ``scan`` against the parallel-prefix ``associative`` method
at ``gamma * lam < 1`` (where they differ) over sizes from 8x128 to 16x32768.

``--anchor REV`` also times the JAX kernels of commit ``REV`` (loaded in-process from ``git
archive``, ``benchmarks.anchor``), each repeat alternating between the current and the old kernel,
so a speed change is measured in one run under the same machine load; the JSON records the load
average and, per size, the full-size copies / transposes in the compiled HLO of each GAE method
and of ``compute_advantages``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.provenance import write_result

import jaxprm

try:
    import torch
except ImportError:  # torch is optional: the table then has no torch column
    torch = None


def _best_time(fn: Callable[[], object], repeats: int, sync: Callable[[object], object] = lambda x: x) -> float:
    sync(fn())  # warm-up (compiles for JAX)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes/s of a large copy (read + write counted) into a preallocated buffer, split over
    ``threads`` (default: all cores, as XLA runs the kernels; numpy releases the GIL while copying).
    This is the machine's practical streaming ceiling."""
    from concurrent.futures import ThreadPoolExecutor

    threads = threads or os.cpu_count() or 1
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    parts = list(zip(np.array_split(dst, threads), np.array_split(src, threads)))
    with ThreadPoolExecutor(threads) as pool:
        t = _best_time(lambda: list(pool.map(lambda p: np.copyto(*p), parts)), repeats)
    return 2 * nbytes / t


# ---------------------------------------------------------------------------------------------
# Inputs


def make_inputs(B: int, T: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = (rng.random((B, T)) < 0.7).astype(np.float32)
    mask[:, -1] = 0
    return {
        "rewards": (rng.normal(size=(B, T)) * 0.01).astype(np.float32),
        "values": rng.normal(size=(B, T)).astype(np.float32),
        "mask": mask,
        "logp": (-rng.random((B, T)) * 2).astype(np.float32),
        "old": (-rng.random((B, T)) * 2).astype(np.float32),
        "ref": (-rng.random((B, T)) * 2).astype(np.float32),
        "adv": rng.normal(size=(B, T)).astype(np.float32),
        "proc": (rng.random((B, T)) * mask).astype(np.float32),
        "proc_neg": (-(rng.random((B, T)) < 0.2).astype(np.float32) * mask).astype(np.float32),
        "outcome": (rng.random(B) < 0.5).astype(np.float32),
        "group_ids": (np.arange(B) // 8).astype(np.int32),
        "seq_lens": rng.integers(T // 2, T + 1, B).astype(np.int32),
    }


def make_batch(x: dict[str, np.ndarray], lib=jaxprm) -> jaxprm.Batch:
    B, T = x["mask"].shape
    return lib.Batch(
        tokens=jnp.zeros((B, T), jnp.int32), loss_mask=jnp.asarray(x["mask"]), old_logprobs=jnp.asarray(x["old"]),
        ref_logprobs=jnp.asarray(x["ref"]), process_rewards=jnp.asarray(x["proc_neg"]),
        values=jnp.zeros((B, T), jnp.float32), outcome_rewards=jnp.asarray(x["outcome"]),
        group_ids=jnp.asarray(x["group_ids"]), turn_ids=jnp.zeros((B, T), jnp.int32),
        seq_lens=jnp.asarray(x["seq_lens"]), truncated=jnp.zeros((B,), bool),
        row_weights=jnp.ones((B,), jnp.float32), num_groups=B,
    )


E2E_CONFIG = jaxprm.AdvantageConfig(group_reward_norm=True, kl_ctl=0.05, kl_estimator="k3", shaping_mode="gvpo")


# ---------------------------------------------------------------------------------------------
# JAX kernels (float32, jitted). Each entry: (fn over device arrays, bytes per token).


def jax_kernels(x: dict[str, np.ndarray], lib=jaxprm) -> dict[str, tuple[Callable[[], object], int]]:
    """The JAX kernels of ``lib`` (``jaxprm``, or an older copy of it: ``benchmarks.anchor``)."""
    jaxprm = lib  # noqa: F811 (the kernels below are ``lib``'s)
    d = {k: jnp.asarray(v) for k, v in x.items()}
    batch = make_batch(x, lib)
    e2e_config = lib.AdvantageConfig(group_reward_norm=True, kl_ctl=0.05, kl_estimator="k3", shaping_mode="gvpo")
    gae = {m: jax.jit(lambda r, v, mm, m=m: jaxprm.learner.gae(r, v, mm, method=m)) for m in ("scan", "associative", "cumsum")}
    kl = jax.jit(lambda a, b: jaxprm.kl_penalty(a, b, estimator="k3"))
    norm = jax.jit(lambda a, m: jaxprm.learner.normalize(a, m))
    gnorm = jax.jit(lambda a, m, g: jaxprm.learner.normalize(a, m, group_ids=g, mean_level="group", std_level="group"))
    gvpo = jax.jit(lambda a, p, m: jaxprm.shape_advantages(a, p, m, mode="gvpo", validate=False))
    pw = jax.jit(lambda a, p, m: jaxprm.shape_advantages(a, p, m, mode="process_weighted", validate=False))
    loss_grad = jax.jit(jax.value_and_grad(lambda lp, o, a, m: jaxprm.policy_loss(lp, o, a, m)[0]))
    e2e = lambda: jaxprm.compute_advantages(batch, e2e_config).advantages  # noqa: E731
    # The ceiling: XLA's own fused elementwise code over GAE's bytes (3 [B, T] reads, 2 writes).
    # XLA:CPU emits one loop per output (no multi-output fusion), so this is what any kernel with
    # GAE's inputs and outputs can reach here; the kernels' fractions are read against it.
    ceiling = jax.jit(lambda r, v, mm: (r * mm + v, r - v * mm))
    # bytes/token: float32 inputs read + outputs written (mask counted as float32)
    return {
        "gae_scan": (lambda: gae["scan"](d["rewards"], d["values"], d["mask"]), 20),
        "gae_associative": (lambda: gae["associative"](d["rewards"], d["values"], d["mask"]), 20),
        "gae_cumsum": (lambda: gae["cumsum"](d["rewards"], d["values"], d["mask"]), 20),
        "kl_k3": (lambda: kl(d["logp"], d["ref"]), 12),
        "normalize_batch": (lambda: norm(d["adv"], d["mask"]), 12),
        "normalize_group": (lambda: gnorm(d["adv"], d["mask"], d["group_ids"]), 12),
        "shape_gvpo": (lambda: gvpo(d["adv"], d["proc_neg"], d["mask"]), 16),
        "shape_process_weighted": (lambda: pw(d["adv"], d["proc"], d["mask"]), 16),
        "policy_loss_fwd_bwd": (lambda: loss_grad(d["logp"], d["old"], d["adv"], d["mask"]), 20),
        # outcome, old, ref, process, values, mask, turn ids in; 4 [B, T] outputs used downstream
        "compute_advantages": (e2e, 40),
        "ceiling_3in_2out": (lambda: ceiling(d["rewards"], d["values"], d["mask"]), 20),
    }


# ---------------------------------------------------------------------------------------------
# float64 numpy implementations (vectorized over rows, loop over time for GAE)


def np_gae(r, v, m):
    B, T = r.shape
    adv = np.zeros((B, T))
    a = np.zeros(B)
    nv = np.zeros(B)
    for t in range(T - 2, -1, -1):
        mt = m[:, t] > 0
        new = r[:, t] + nv - v[:, t] + a
        a = np.where(mt, new, a)
        nv = np.where(mt, v[:, t], nv)
        adv[:, t] = a
    return adv, adv + v


def np_normalize(x, m):
    n = m.sum()
    mean = (x * m).sum() / max(n, 1)
    c = (x - mean) * m
    std = np.sqrt((c * c).sum() / max(n - 1, 1)) if n > 1 else 1.0
    return c / (std + 1e-5)


def np_gvpo(A, p, m):
    pen = (m > 0) & (p < 0)
    shaped = np.where(A < -1e-6, 1.2 * A, np.where(A > 1e-6, 0.0, -0.4))
    return np.where(pen, shaped, A)


def np_pw(A, p, m):
    return np.where(m > 0, np.where(A >= 0, A * p, np.where(p > 0, p, A)), A)


def np_loss_fwd_bwd(lp, old, A, m):
    ratio = np.where(m > 0, np.exp(lp - old), 0.0)
    l1, l2 = -A * ratio, -A * np.clip(ratio, 0.8, 1.2)
    n = max(m.sum(), 1)
    loss = (np.maximum(l1, l2) * m).sum() / n
    grad = np.where((l1 >= l2) & (m > 0), -A * ratio, 0.0) / n
    return loss, grad


def np_e2e(x):
    m = x["mask"].astype(np.float64)
    B, T = m.shape
    r = x["outcome"].astype(np.float64)
    g = x["group_ids"]
    out = np.zeros(B)
    for gid in np.unique(g):
        sel = g == gid
        s = r[sel].std(ddof=1) if sel.sum() > 1 else 1.0
        out[sel] = (r[sel] - r[sel].mean()) / (s + 1e-5)
    d = x["old"].astype(np.float64) - x["ref"]
    rewards = -0.05 * np.clip(np.exp(-d) - 1 + d, -10, 10) * m
    rewards[np.arange(B), np.maximum(x["seq_lens"] - 2, 0)] += out
    adv, _ = np_gae(rewards, np.zeros((B, T)), m)
    return np_gvpo(np_normalize(adv, m), x["proc_neg"], m)


def numpy_kernels(x):
    f = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in x.items()}
    return {
        "gae_scan": lambda: np_gae(f["rewards"], f["values"], f["mask"]),
        "gae_associative": lambda: np_gae(f["rewards"], f["values"], f["mask"]),
        "gae_cumsum": lambda: np_gae(f["rewards"], f["values"], f["mask"]),
        "kl_k3": lambda: np.clip(np.expm1(f["ref"] - f["logp"]) + f["logp"] - f["ref"], -10, 10),
        "normalize_batch": lambda: np_normalize(f["adv"], f["mask"]),
        "shape_gvpo": lambda: np_gvpo(f["adv"], f["proc_neg"], f["mask"]),
        "shape_process_weighted": lambda: np_pw(f["adv"], f["proc"], f["mask"]),
        "policy_loss_fwd_bwd": lambda: np_loss_fwd_bwd(f["logp"], f["old"], f["adv"], f["mask"]),
        "compute_advantages": lambda: np_e2e(f),
    }


# ---------------------------------------------------------------------------------------------
# Eager PyTorch, written the way AReaL's learner does it (float32 tensors, Python loop in GAE)


def torch_device() -> str:
    """Where the eager PyTorch references run: CUDA when torch sees a GPU (a lent GPU machine)."""
    return "cuda" if torch is not None and torch.cuda.is_available() else "cpu"


def torch_sync(out=None):
    if torch_device() == "cuda":
        torch.cuda.synchronize()
    return out


def torch_kernels(x):
    if torch is None:
        return {}
    dev = torch_device()
    t = {k: torch.from_numpy(v).to(dev) for k, v in x.items()}

    def gae(rewards, values, mask):
        B, T = rewards.shape
        lastgaelam = torch.zeros(B, device=dev)
        nextvalues = torch.zeros(B, device=dev)
        out = [torch.zeros(B, device=dev)]
        for i in reversed(range(T - 1)):
            delta = rewards[:, i] + nextvalues - values[:, i]
            newgaelam = delta + lastgaelam
            mi = mask[:, i]
            nextvalues = nextvalues * (1 - mi) + values[:, i] * mi
            lastgaelam = lastgaelam * (1 - mi) + newgaelam * mi
            out.append(lastgaelam)
        adv = torch.stack(out[::-1], dim=1)
        return adv, adv + values

    def normalize(xx, mask):
        n = mask.sum()
        mean = (xx * mask).sum() / n
        var = (((xx - mean) * mask) ** 2).sum() / (n - 1)
        return (xx - mean) * mask / (var.sqrt() + 1e-5)

    def gvpo(A, p, mask):
        pen = (mask > 0) & (p < 0)
        shaped = torch.where(A < -1e-6, 1.2 * A, torch.where(A > 1e-6, torch.zeros_like(A), torch.full_like(A, -0.4)))
        return torch.where(pen, shaped, A)

    def pw(A, p, mask):
        return torch.where(mask > 0, torch.where(A >= 0, A * p, torch.where(p > 0, p, A)), A)

    def loss_fwd_bwd():
        lp = t["logp"].clone().requires_grad_(True)
        mask = t["mask"].bool()
        ratio = torch.where(mask, torch.exp(lp - t["old"]), 0)
        l1, l2 = -t["adv"] * ratio, -t["adv"] * torch.clamp(ratio, 0.8, 1.2)
        loss = torch.where(mask, torch.max(l1, l2), 0).sum() / mask.count_nonzero()
        loss.backward()
        return loss

    def e2e():
        m = t["mask"]
        B, T = m.shape
        r = t["outcome"].clone()
        for gid in torch.unique(t["group_ids"]):
            sel = t["group_ids"] == gid
            r[sel] = (r[sel] - r[sel].mean()) / (r[sel].std() + 1e-5)
        d = t["old"] - t["ref"]
        rewards = -0.05 * torch.clamp(torch.exp(-d) - 1 + d, -10, 10) * m
        rewards[torch.arange(B, device=dev), torch.clamp(t["seq_lens"] - 2, min=0).long()] += r
        adv, _ = gae(rewards, torch.zeros(B, T, device=dev), m)
        return gvpo(normalize(adv, m), t["proc_neg"], m)

    return {
        "gae_scan": lambda: gae(t["rewards"], t["values"], t["mask"]),
        "gae_associative": lambda: gae(t["rewards"], t["values"], t["mask"]),
        "gae_cumsum": lambda: gae(t["rewards"], t["values"], t["mask"]),
        "kl_k3": lambda: torch.clamp(torch.exp(t["ref"] - t["logp"]) - 1 + t["logp"] - t["ref"], -10, 10),
        "normalize_batch": lambda: normalize(t["adv"], t["mask"]),
        "shape_gvpo": lambda: gvpo(t["adv"], t["proc_neg"], t["mask"]),
        "shape_process_weighted": lambda: pw(t["adv"], t["proc"], t["mask"]),
        "policy_loss_fwd_bwd": loss_fwd_bwd,
        "compute_advantages": e2e,
    }


# ---------------------------------------------------------------------------------------------


def hlo_report(x: dict[str, np.ndarray]) -> dict[str, dict[str, int]]:
    """Full-size ``copy`` / ``transpose`` instructions in the compiled GAE and compute_advantages."""
    from benchmarks.anchor import hlo_copies

    B, T = x["mask"].shape
    d = {k: jnp.asarray(v) for k, v in x.items()}
    out = {}
    for m in ("scan", "associative", "cumsum"):
        f = jax.jit(lambda r, v, mm, m=m: jaxprm.learner.gae(r, v, mm, method=m))
        out[f"gae_{m}"] = hlo_copies(f.lower(d["rewards"], d["values"], d["mask"]).compile().as_text(), B * T)
    from jaxprm.learner.advantages import _compute_advantages_jit

    text = _compute_advantages_jit.lower(make_batch(x), E2E_CONFIG).compile().as_text()
    out["compute_advantages"] = hlo_copies(text, B * T)
    return out


def device_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s (read + write) of a jitted elementwise pass ``x + 1`` over ``nbytes`` of float32 on
    JAX's default device: the streaming ceiling of an accelerator (``copy_bandwidth`` is the host's)."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    return 2 * nbytes / _best_time(lambda: f(x), repeats, jax.block_until_ready)


def run(sizes: list[tuple[int, int]], repeats: int, anchor: str | None = None,
        kernels: list[str] | None = None) -> dict:
    on_cpu = jax.default_backend() == "cpu"
    bw = copy_bandwidth() if on_cpu else device_copy_bandwidth()
    rows = []
    hlo = {}
    old_lib = None
    if anchor:
        from benchmarks.anchor import load_anchor

        old_lib = load_anchor(anchor)
    load_before = os.getloadavg()
    for B, T in sizes:
        x = make_inputs(B, T)
        jk, nk, tk = jax_kernels(x), numpy_kernels(x), torch_kernels(x)
        hlo[f"{B}x{T}"] = hlo_report(x)
        # The slow references get fewer repeats at large sizes.
        slow_repeats = max(1, repeats if B * T <= 1 << 17 else 2)
        old = jax_kernels(x, old_lib) if old_lib is not None else {}
        for name, (fn, bytes_per_tok) in jk.items():
            if kernels and not any(name.startswith(k) for k in kernels):
                continue
            if name in old:  # interleaved: the load on a shared machine hits both alike
                from benchmarks.anchor import best_interleaved

                tj, t_old = best_interleaved(fn, old[name][0], repeats)
            else:
                tj, t_old = _best_time(fn, repeats, jax.block_until_ready), None
            tn = _best_time(nk[name], slow_repeats) if name in nk else None
            tt = _best_time(tk[name], slow_repeats, torch_sync) if name in tk else None
            n = B * T
            rows.append({
                "kernel": name, "B": B, "T": T,
                "jax_tok_s": n / tj, "numpy_f64_tok_s": None if tn is None else n / tn,
                "torch_eager_tok_s": None if tt is None else n / tt,
                "speedup_vs_numpy": None if tn is None else tn / tj,
                "speedup_vs_torch": None if tt is None else tt / tj,
                "jax_ms": tj * 1e3, "bytes_per_token": bytes_per_tok,
                "fraction_of_copy_bw": bytes_per_tok * n / tj / bw,
            })
            if t_old is not None:
                rows[-1].update(anchor_ms=t_old * 1e3, speedup_vs_anchor=t_old / tj,
                                anchor_fraction_of_copy_bw=bytes_per_tok * n / t_old / bw)
            print_row(rows[-1])
    return {
        "anchor": anchor,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "hlo_full_size_copies": hlo,
        "machine": {"backend": jax.default_backend(),  # with write_result's machine facts
                    "torch": None if torch is None else torch.__version__, "torch_device": torch_device()},
        "copy_bandwidth_GBps": bw / 1e9,
        "copy_bandwidth_of": "host memory (numpy copy)" if on_cpu else "device memory (jitted x + 1)",
        "rows": rows,
    }


HEADER = f"{'kernel':<24}{'B x T':>12}{'jax Mtok/s':>12}{'np64 Mtok/s':>13}{'torch Mtok/s':>14}" \
         f"{'x numpy':>9}{'x torch':>9}{'% copy bw':>11}{'x anchor':>10}{'anchor %':>10}"


def _fmt(v, spec):
    return format("-", spec.split(".")[0]) if v is None else format(v, spec)


def print_row(r: dict) -> None:
    print(f"{r['kernel']:<24}{str(r['B']) + 'x' + str(r['T']):>12}{r['jax_tok_s'] / 1e6:>12.1f}"
          f"{_fmt(r['numpy_f64_tok_s'] and r['numpy_f64_tok_s'] / 1e6, '>13.1f')}"
          f"{_fmt(r['torch_eager_tok_s'] and r['torch_eager_tok_s'] / 1e6, '>14.1f')}"
          f"{_fmt(r['speedup_vs_numpy'], '>9.1f')}{_fmt(r['speedup_vs_torch'], '>9.1f')}"
          f"{100 * r['fraction_of_copy_bw']:>10.0f}%{_fmt(r.get('speedup_vs_anchor'), '>10.2f')}"
          f"{_fmt(r.get('anchor_fraction_of_copy_bw') and 100 * r['anchor_fraction_of_copy_bw'], '>9.0f')}"
          f"{'%' if r.get('anchor_fraction_of_copy_bw') else ' '}", flush=True)


def gae_methods(rows: list[dict]) -> list[dict]:
    """Per size: each GAE method's time and the fastest (where ``associative`` breaks even)."""
    out = []
    for B, T in dict.fromkeys((r["B"], r["T"]) for r in rows):
        ms = {r["kernel"][4:]: r["jax_ms"] for r in rows if (r["B"], r["T"]) == (B, T) and r["kernel"].startswith("gae_")}
        if ms:
            out.append({"B": B, "T": T, "ms": ms, "fastest": min(ms, key=ms.get)})
    return out


BREAK_EVEN_SIZES = "8x128,8x512,8x2048,8x8192,64x2048,256x512,256x2048,256x8192,1024x8192,16x32768"


def gae_break_even(sizes: list[tuple[int, int]], repeats: int, gamma: float = 0.99, lam: float = 0.95) -> list[dict]:
    """GAE's ``scan`` (unroll 1 and 16) vs ``associative`` at ``gamma * lam < 1``, where the methods
    differ (at ``gamma == lam == 1`` all three run the same blocked cumulative sum): ms per size."""
    rows = []
    for B, T in sizes:
        x = make_inputs(B, T)
        d = [jnp.asarray(x[k]) for k in ("rewards", "values", "mask")]
        row = {"B": B, "T": T, "gamma": gamma, "lam": lam}
        for key, method, unroll in (("scan_u1", "scan", 1), ("scan_u16", "scan", 16), ("associative", "associative", 16)):
            f = jax.jit(lambda r, v, m, method=method, unroll=unroll: jaxprm.learner.gae(
                r, v, m, gamma=gamma, lam=lam, method=method, unroll=unroll))
            row[f"{key}_ms"] = 1e3 * _best_time(lambda: f(*d), repeats, jax.block_until_ready)
        row["fastest"] = min(("scan_u1", "scan_u16", "associative"), key=lambda k: row[f"{k}_ms"])
        rows.append(row)
        print(f"GAE {B}x{T} (gamma {gamma}, lam {lam}): scan {row['scan_u1_ms']:.3f} ms (unroll 16: "
              f"{row['scan_u16_ms']:.3f}), associative {row['associative_ms']:.3f} ms; fastest {row['fastest']}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8x512,64x2048,256x8192", help="comma-separated BxT sizes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--anchor", default=None,
                    help="also time the JAX kernels of this git revision in the same run (e.g. the parent commit)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="PyTorch intra-op threads (default 1: its OpenMP pool stalls when cores are shared)")
    ap.add_argument("--kernels", default=None,
                    help="comma-separated kernel-name prefixes to time (default: all), e.g. gae,normalize")
    ap.add_argument("--break-even", action="store_true",
                    help=f"only time GAE's scan vs associative at gamma 0.99, lam 0.95 (sizes default: {BREAK_EVEN_SIZES})")
    args = ap.parse_args(argv)
    if args.break_even and args.sizes == ap.get_default("sizes"):
        args.sizes = BREAK_EVEN_SIZES
    sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes.split(",")]
    if args.break_even:
        result = {"machine": {"backend": jax.default_backend()},  # with write_result's machine facts
                  "loadavg_before": os.getloadavg(), "break_even": gae_break_even(sizes, args.repeats)}
        result["loadavg_after"] = os.getloadavg()
        if args.json:
            write_result(args.json, result)
            print(f"wrote {args.json}")
        return result
    if torch is not None:
        torch.set_num_threads(args.torch_threads)
    print(f"jax {jax.__version__} on {jax.default_backend()}; torch {getattr(torch, '__version__', 'absent')}")
    print(HEADER, flush=True)
    result = run(sizes, args.repeats, args.anchor, args.kernels.split(",") if args.kernels else None)
    print(f"memory-copy bandwidth: {result['copy_bandwidth_GBps']:.1f} GB/s (read + write, {result['copy_bandwidth_of']})")
    result["gae_methods"] = gae_methods(result["rows"])
    for g in result["gae_methods"]:
        times = ", ".join(f"{m} {t:.3f} ms" for m, t in g["ms"].items())
        print(f"GAE at {g['B']}x{g['T']}: {times}; fastest: {g['fastest']}")
    if args.json:
        write_result(args.json, result)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
