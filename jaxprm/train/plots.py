"""PNG plots of a run (matplotlib, Agg backend): training curves and one PaTR tree."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["training_curves", "health_curves", "health_figure", "tree_png"]

_STATUS_COLORS = {"success": "tab:green", "done": "tab:gray", "max_turns": "tab:blue", "pruned": "tab:red",
                  "loop": "tab:orange", "context": "tab:purple", "invalid": "tab:brown"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: str | Path) -> Path:
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    _plt().close(fig)
    return out


def training_curves(metrics_path: str | Path, out: str | Path) -> Path:
    """Eval sampled success / pass@k / greedy success and train reward / success over steps."""
    from jaxprm.train.rundir import read_metrics

    rows = read_metrics(metrics_path)
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ev = [r for r in rows if r.get("kind") == "eval"]
    tr = [r for r in rows if r.get("kind") == "train"]
    ax = axes[0]
    if ev:
        xs = [r["step"] for r in ev]
        for key, label in (("success", "sampled success"), ("greedy_success", "greedy success")):
            if any(key in r for r in ev):
                ax.plot(xs, [r.get(key) for r in ev], marker="o", label=label)
        pk = next((k for k in ev[0] if k.startswith("pass_at_")), None)
        if pk:
            ax.plot(xs, [r.get(pk) for r in ev], marker="s", ls="--", label=pk.replace("_", " ").replace("at ", "@"))
    ax.set(title="held-out evaluation", xlabel="step", ylabel="rate", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[1]
    if tr:
        xs = [r["step"] for r in tr]
        ax.plot(xs, [r.get("reward") for r in tr], label="mean outcome reward")
        ax.plot(xs, [r.get("groups_with_success") for r in tr], label="groups with a success", alpha=0.7)
    ax.set(title="training rollouts", xlabel="step", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, out)


def health_curves(metrics_path: str | Path, out: str | Path) -> Path:
    """The trainer process over steps (``jaxprm.train.health``): RSS, open descriptors, threads and
    programs compiled; flat after warm-up when nothing leaks."""
    from jaxprm.train.rundir import read_metrics

    return health_figure(read_metrics(metrics_path), out)


def health_figure(rows: list[dict[str, Any]], out: str | Path) -> Path:
    """:func:`health_curves` from metrics rows (train rows with ``rss_mb`` are drawn)."""
    tr = [r for r in rows if r.get("kind") == "train" and "rss_mb" in r]
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (key, label) in zip(axes, (("rss_mb", "RSS (MB)"), ("open_fds", "open descriptors"),
                                       ("threads", "threads"), ("compiled_programs", "programs compiled"))):
        pts = [(r["step"], r[key]) for r in tr if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker=".", lw=1)
        ax.set(xlabel="step", title=label)
        ax.grid(alpha=0.3)
    return _save(fig, out)


def tree_png(group: Any, out: str | Path) -> Path:
    """One rollout group as a tree: x = turn, one lane per leaf; nodes where a branch was expanded
    (several children) are marked, leaves colored by status (success / hole / pruned / loop ...)."""
    tree = group.tree
    plt = _plt()
    status = {lf.leaf_id: lf.status for lf in group.all_leaves}
    # Lay out: leaves get lanes in DFS order; inner nodes sit at the mean lane of their leaves.
    lanes: dict[str, float] = {}
    depth: dict[str, int] = {}
    counter = [0]

    def visit(node_id, d):
        depth[node_id] = d
        kids = tree.children(node_id)
        if not kids:
            lanes[node_id] = counter[0]
            counter[0] += 1
            return lanes[node_id]
        ys = [visit(k.id, d + 1) for k in kids]
        lanes[node_id] = sum(ys) / len(ys)
        return lanes[node_id]

    for root in tree.roots():
        visit(root.id, 1)
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.35 * counter[0] + 1)))
    for it in tree:
        if it.parent_id is not None:
            ax.plot([depth[it.parent_id], depth[it.id]], [lanes[it.parent_id], lanes[it.id]], color="0.6", lw=1, zorder=1)
    for it in tree:
        kids = tree.children(it.id)
        if len(kids) > 1:
            ax.scatter(depth[it.id], lanes[it.id], s=60, marker="D", color="black", zorder=3)
        elif not kids:
            st = status.get(it.id, "?")
            ax.scatter(depth[it.id], lanes[it.id], s=50, color=_STATUS_COLORS.get(st, "k"), zorder=3)
        else:
            ax.scatter(depth[it.id], lanes[it.id], s=10, color="0.3", zorder=2)
    labels = {"done": "ended (hole)", "max_turns": "out of turns", "loop": "loop-stopped", "context": "context full",
              "invalid": "invalid answer"}
    for st, c in _STATUS_COLORS.items():
        ax.scatter([], [], color=c, label=labels.get(st, st))
    ax.scatter([], [], marker="D", color="black", label="expanded")
    s = group.stats
    ax.set(title=f"{s.strategy} group {group.group_key}: {s.leaves} leaves, {s.expanded} expanded, "
                 f"{s.pruned} pruned, {s.loop_stopped} loop-stopped, {s.successes} successes",
           xlabel="turn", ylabel="branch")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(alpha=0.2)
    return _save(fig, out)
