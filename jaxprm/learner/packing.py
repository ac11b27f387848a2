"""Tree packing: the rows of a group that share a prefix are packed so each shared token appears once.

A GRPO / PaTR group exports one flat row per leaf (root-to-leaf), so a turn shared by ``n`` leaves
is forwarded ``n`` times. ``pack_rows`` merges the rows of each tree into a token trie laid out in
depth-first order in one packed row (several small trees may share a packed row):

* ``positions[j]``: the token's index in every flat row that contains it (RoPE position);
* ``parents[j]``: the packed index of the previous token on its root path (-1 for a first token);
* ``subtree_end[j]``: one past the last packed index of its subtree (DFS exit time). Query ``q``
  may attend key ``k`` iff ``k <= q < subtree_end[k]``: ``k`` is on ``q``'s root path. Tokens of
  other trees in the same row are never on it, so no segment ids are needed.
* ``query_blocks`` / ``key_blocks``: the same attention, block-sparse. Every packed token belongs to
  the first flat row that contains it; that row's new tokens are cut into blocks of ``Q``
  consecutive depths, and a block's keys are the row's first tokens up to the block's last depth
  (key ``i`` at depth ``i``). Attention then costs about packed tokens x row length, where the
  dense ``subtree_end`` mask costs packed length squared per row.

Two rows share a token only if the whole prefix, the token, its loss mask and its behaviour
log-prob are equal (tree strategies copy the parent's turns, so their shared turns always match).

Per-token arrays of a ``PackedBatch`` are *token-aligned* (entry ``j`` is about token ``j`` itself,
predicted from its root path), unlike the flat ``Batch``'s prediction positions: in a tree one
position may be followed by several children. ``flat_index`` maps every flat prediction position
``(b, t)`` (about token ``t + 1`` of row ``b``) to its packed slot.

The loss on packed tokens is exact: see ``jaxprm.learner.packed_loss``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxprm.learner.batch import DEFAULT_LEN_BUCKETS, DEFAULT_ROW_BUCKETS, RowData, bucket_size

__all__ = [
    "DEFAULT_BLOCK_BUCKETS",
    "PackedBatch",
    "pack_rows",
    "gather_to_flat",
    "tree_attention_mask",
]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """Tree-packed learner batch (a JAX pytree; ``R`` packed rows of length ``L``).

    Attributes:
      tokens: ``int32 [R, L]`` token ids in depth-first order, 0 in padding.
      positions: ``int32 [R, L]`` index of the token in the flat rows that contain it (RoPE).
      parents: ``int32 [R, L]`` packed index (same row) of the previous token on the root path,
        -1 for the first token of a tree and for padding.
      subtree_end: ``int32 [R, L]`` DFS exit time: ``k`` is visible to ``q`` iff
        ``k <= q < subtree_end[k]`` (padding: ``k + 1``, i.e. only itself).
      loss_mask: ``float32 [R, L]`` token-aligned: 1 where at least one flat row trains on the token.
      old_logprobs: ``float32 [R, L]`` token-aligned behaviour log-prob (0 where the mask is 0).
      row_weights: ``float32 [R]`` 1 for packed rows holding a tree, 0 for padding rows.
      lengths: ``int32 [R]`` packed tokens in each row (its trees fill ``[0, lengths[r])``).
      query_blocks: ``int32 [R, N, Q]`` slots of each attention block's queries (-1 = none); every
        packed token is in exactly one block.
      key_blocks: ``int32 [R, N, S]`` slots of the block's root path by depth (key ``i`` has depth
        ``i``; -1 beyond it): query ``q`` attends keys ``i <= positions[q]``. ``S`` is the flat
        length ``T`` unless ``pack_rows`` was given key-length buckets.
      flat_index: ``int32 [B, T]`` packed slot ``r * L + j`` of flat prediction position ``(b, t)``
        (token ``t + 1`` of flat row ``b``), -1 where there is no such token.
      flat_rows: ``int32 [B]`` the packed row holding flat row ``b``, -1 for flat padding rows.
    """

    tokens: jax.Array
    positions: jax.Array
    parents: jax.Array
    subtree_end: jax.Array
    loss_mask: jax.Array
    old_logprobs: jax.Array
    row_weights: jax.Array
    lengths: jax.Array
    query_blocks: jax.Array
    key_blocks: jax.Array
    flat_index: jax.Array
    flat_rows: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)  # type: ignore[return-value]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(N, Q, S)``: attention blocks per row, queries and keys per block."""
        return (*self.query_blocks.shape[1:], self.key_blocks.shape[2])  # type: ignore[return-value]

    def replace(self, **changes) -> PackedBatch:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    PackedBatch, data_fields=[f.name for f in dataclasses.fields(PackedBatch)], meta_fields=[]
)


# ---------------------------------------------------------------------------------------------
# Building (numpy, on the host)

DEFAULT_BLOCK_BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def _shared_prefix(a: RowData, b: RowData) -> int:
    """Length of the longest prefix on which token, loss mask and log-prob all agree."""
    n = min(len(a.tokens), len(b.tokens))
    if n == 0:
        return 0
    same = (np.asarray(a.tokens[:n]) == np.asarray(b.tokens[:n]))
    same &= np.asarray(a.loss_mask[:n], np.float32) == np.asarray(b.loss_mask[:n], np.float32)
    same &= np.asarray(a.logprobs[:n], np.float32) == np.asarray(b.logprobs[:n], np.float32)
    bad = np.flatnonzero(~same)
    return int(bad[0]) if bad.size else n


@dataclasses.dataclass
class _Tree:
    """One tree before layout: per row, its node id per token; per node, token data."""

    rows: list[int]  # flat row indices
    slots: list[np.ndarray]  # per row: node id of each of its tokens
    starts: list[int]  # per row: depth of its first own (not shared with an earlier row) token
    parent: np.ndarray  # [N] node id of the parent, -1 for roots
    depth: np.ndarray  # [N]
    token: np.ndarray
    mask: np.ndarray
    logprob: np.ndarray
    order: np.ndarray  # [N] DFS pre-order of node ids
    end: np.ndarray  # [N] DFS exit time (in pre-order positions) per node id


def _build_tree(rows: Sequence[RowData], members: Sequence[int]) -> _Tree:
    """Trie of the rows ``members`` (each row a chain; a new row branches off the row it shares
    the longest prefix with), then its DFS layout."""
    parent: list[np.ndarray] = []
    depth: list[np.ndarray] = []
    token: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    logprob: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    # Segments: each row adds one chain of new nodes [first, first + length) attached at a node.
    seg_first: list[int] = []
    seg_len: list[int] = []
    branches: dict[int, list[int]] = {}  # node id -> segments attached below it (insertion order)
    roots: list[int] = []
    starts: list[int] = []
    n_nodes = 0
    for i, b in enumerate(members):
        row = rows[b]
        L = len(row.tokens)
        best, best_j = 0, -1
        for j in range(i):
            p = _shared_prefix(rows[members[j]], row)
            if p > best:
                best, best_j = p, j
        new = L - best
        starts.append(best)
        ids = np.empty(L, np.int64)
        if best:
            ids[:best] = slots[best_j][:best]
        ids[best:] = n_nodes + np.arange(new)
        slots.append(ids)
        if new:
            attach = int(ids[best - 1]) if best else -1
            par = np.concatenate([[attach], ids[best:-1]]) if new > 1 else np.array([attach])
            parent.append(par)
            depth.append(np.arange(best, L))
            token.append(np.asarray(row.tokens[best:], np.int32))
            mask.append(np.asarray(row.loss_mask[best:], np.float32))
            logprob.append(np.asarray(row.logprobs[best:], np.float32))
            seg = len(seg_first)
            seg_first.append(n_nodes)
            seg_len.append(new)
            (roots if attach < 0 else branches.setdefault(attach, [])).append(seg)
            n_nodes += new
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    parent_a, depth_a = cat(parent, np.int64), cat(depth, np.int64)
    # DFS pre-order over runs: a run is a stretch of a segment up to the next node with branches.
    order = np.empty(n_nodes, np.int64)
    end = np.empty(n_nodes, np.int64)
    points = sorted(branches)
    pos = 0
    runs: list[tuple[int, int, int]] = []  # (first node, last node, start position)
    run_parent: list[int] = []
    stack = [(s, seg_first[s], -1) for s in reversed(roots)]
    while stack:
        seg, node, prun = stack.pop()
        last_node = seg_first[seg] + seg_len[seg] - 1
        k = np.searchsorted(points, node)
        stop = points[k] if k < len(points) and points[k] <= last_node else last_node
        n = stop - node + 1
        order[pos:pos + n] = np.arange(node, stop + 1)
        run = len(runs)
        runs.append((node, stop, pos))
        run_parent.append(prun)
        pos += n
        # Children of ``stop``: the rest of its segment first, then the branches (in order).
        for s in reversed(branches.get(stop, [])):
            stack.append((s, seg_first[s], run))
        if stop < last_node:
            stack.append((seg, stop + 1, run))
    # Exit times: a run's tokens all end where the subtree of its last token ends.
    run_end = [start + (last - first + 1) for first, last, start in runs]
    for r in range(len(runs) - 1, -1, -1):
        if run_parent[r] >= 0:
            run_end[run_parent[r]] = max(run_end[run_parent[r]], run_end[r])
    for (first, last, _), e in zip(runs, run_end):
        end[first:last + 1] = e
    return _Tree(rows=list(members), slots=slots, starts=starts, parent=parent_a, depth=depth_a, token=cat(token, np.int32),
                 mask=cat(mask, np.float32), logprob=cat(logprob, np.float32), order=order, end=end)


def pack_rows(
    rows: Sequence[RowData],
    *,
    flat_shape: tuple[int, int],
    trees: Sequence[Sequence[int]] | None = None,
    row_buckets: Sequence[int] = DEFAULT_ROW_BUCKETS,
    len_buckets: Sequence[int] = DEFAULT_LEN_BUCKETS,
    min_rows: int = 0,
    min_len: int = 0,
    trees_per_row: int | None = None,
    query_block: int = 64,
    key_len_buckets: Sequence[int] | None = None,
    block_buckets: Sequence[int] = DEFAULT_BLOCK_BUCKETS,
) -> PackedBatch:
    """Pack token-aligned rows (as ``pad_rows`` takes them) into a ``PackedBatch``.

    Args:
      rows: the flat rows, in the order ``pad_rows`` put them in the flat batch of shape
        ``flat_shape = (B, T)``.
      trees: lists of row indices that may share prefixes (default: one tree per ``group_id``).
      row_buckets, len_buckets, min_rows, min_len: packed rows ``R`` and length ``L`` are bucketed
        like ``pad_rows`` (``L`` from the largest tree; trees are packed first-fit-decreasing
        into rows of length ``L``).
      trees_per_row: at most this many trees per packed row (default: no limit; 1 = one tree per
        row).
      query_block: queries per attention block ``Q``; the block count ``N`` is bucketed by
        ``block_buckets``.
      key_len_buckets: buckets of the key-slot length ``S`` of ``key_blocks`` (the longest root
        path); default: ``S = T``, the flat length. Coarse buckets give the learner fewer shapes to
        compile but pad every block's keys (attention work grows with ``S``).
    Returns:
      The ``PackedBatch``; its ``flat_index`` refers to the flat batch of shape ``flat_shape``.
    """
    B, T = flat_shape
    if len(rows) > B:
        raise ValueError(f"{len(rows)} rows do not fit a flat batch of {B} rows")
    if any(len(r.tokens) > T for r in rows):
        raise ValueError(f"a row is longer than the flat length T={T}")
    if trees is None:
        by_group: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_group.setdefault(int(r.group_id), []).append(i)
        trees = list(by_group.values())
    seen = sorted(i for t in trees for i in t)
    if seen != list(range(len(rows))):
        raise ValueError("trees must partition the row indices 0..len(rows)-1")
    built = [_build_tree(rows, t) for t in trees]
    sizes = [len(t.order) for t in built]
    L = bucket_size(max(max(sizes, default=1), min_len, 1), len_buckets)
    # First-fit decreasing into rows of length L.
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(built)), key=lambda i: -sizes[i]):
        for k in range(len(bins)):
            if sizes[i] <= room[k] and (trees_per_row is None or len(bins[k]) < trees_per_row):
                bins[k].append(i)
                room[k] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(L - sizes[i])
    R = bucket_size(max(len(bins), min_rows, 1), row_buckets)

    tokens = np.zeros((R, L), np.int32)
    positions = np.zeros((R, L), np.int32)
    parents = np.full((R, L), -1, np.int32)
    subtree_end = np.tile(np.arange(1, L + 1, dtype=np.int32), (R, 1))
    loss_mask = np.zeros((R, L), np.float32)
    old_lp = np.zeros((R, L), np.float32)
    weights = np.zeros((R,), np.float32)
    lengths = np.zeros((R,), np.int32)
    flat_index = np.full((B, T), -1, np.int32)
    flat_rows = np.full((B,), -1, np.int32)
    Q = int(query_block)
    blocks: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(R)]
    for r, members in enumerate(bins):
        weights[r] = 1.0
        offset = 0
        for i in members:
            t = built[i]
            n = len(t.order)
            where = np.empty(n, np.int64)  # packed position of each node id
            where[t.order] = offset + np.arange(n)
            sl = slice(offset, offset + n)
            tokens[r, sl] = t.token[t.order]
            positions[r, sl] = t.depth[t.order]
            par = t.parent[t.order]
            parents[r, sl] = np.where(par >= 0, where[np.maximum(par, 0)], -1)
            subtree_end[r, sl] = offset + t.end[t.order]
            loss_mask[r, sl] = t.mask[t.order]
            old_lp[r, sl] = t.logprob[t.order] * t.mask[t.order]
            for b, ids, start in zip(t.rows, t.slots, t.starts):
                flat_rows[b] = r
                # Prediction position t is about token t + 1; token 0 is never predicted.
                flat_index[b, : len(ids) - 1] = r * L + where[ids[1:]]
                path = where[ids]
                for d0 in range(start, len(ids), Q):
                    d1 = min(d0 + Q, len(ids))
                    blocks[r].append((path[d0:d1], path[:d1]))
            offset += n
        lengths[r] = offset
    N = bucket_size(max(max(len(b) for b in blocks), 1), block_buckets)
    S = T
    if key_len_buckets is not None:
        S = bucket_size(max((len(ks) for bl in blocks for _, ks in bl), default=1), key_len_buckets)
    query_blocks = np.full((R, N, Q), -1, np.int32)
    key_blocks = np.full((R, N, S), -1, np.int32)
    for r, bl in enumerate(blocks):
        for i, (qs, ks) in enumerate(bl):
            query_blocks[r, i, : len(qs)] = qs
            key_blocks[r, i, : len(ks)] = ks
    # A token is trainable only where it is predicted (not a first token).
    loss_mask = np.where(parents >= 0, loss_mask, 0.0).astype(np.float32)
    old_lp = old_lp * loss_mask
    return PackedBatch(
        tokens=jnp.asarray(tokens), positions=jnp.asarray(positions), parents=jnp.asarray(parents),
        subtree_end=jnp.asarray(subtree_end), loss_mask=jnp.asarray(loss_mask), old_logprobs=jnp.asarray(old_lp),
        row_weights=jnp.asarray(weights), lengths=jnp.asarray(lengths), query_blocks=jnp.asarray(query_blocks),
        key_blocks=jnp.asarray(key_blocks), flat_index=jnp.asarray(flat_index), flat_rows=jnp.asarray(flat_rows),
    )


# ---------------------------------------------------------------------------------------------
# Kernels (jittable)


def tree_attention_mask(subtree_end: jax.Array) -> jax.Array:
    """``bool [R, L, L]``: ``mask[r, q, k] = k <= q < subtree_end[r, k]`` (k on q's root path)."""
    L = subtree_end.shape[-1]
    idx = jnp.arange(L)
    return (idx[None, None, :] <= idx[None, :, None]) & (idx[None, :, None] < subtree_end[:, None, :])


def gather_to_flat(packed_values: jax.Array, flat_index: jax.Array) -> jax.Array:
    """Flat ``[B, T]`` view of token-aligned packed values ``[R, L]``: ``out[b, t] =
    packed_values.ravel()[flat_index[b, t]]`` (0 where ``flat_index`` is -1)."""
    flat = packed_values.reshape(-1)
    got = jnp.take(flat, jnp.maximum(flat_index, 0), axis=0)
    return jnp.where(flat_index >= 0, got, jnp.zeros((), flat.dtype))
