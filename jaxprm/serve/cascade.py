"""Which decode rows share which cached prompt prefix (the plan of a cascade decode call).

A decode batch usually holds several groups of rows with a common prompt: a GRPO group's samples,
a PaTR tree's branches, the chat template's system prompt for everyone. The decode program can
gather each such prefix's keys and values once for the batch (``jaxprm.models.paged``) instead of
once per row. This module picks the groups.

Each row is described by the pool blocks of its fully computed positions (the prefix cache makes
equal token prefixes the *same* blocks). Sorted by these block lists, rows with a common prefix
are contiguous, and the longest common prefix of a run of rows is the smallest common prefix of
its neighbours. The plan maximizes the gather traffic saved, ``sum_g (|g| - 1) * shared_g`` blocks,
over partitions into such runs: a run is either kept whole (sharing its smallest neighbour prefix)
or cut where that smallest prefix lies (a Cartesian-tree recursion, ``O(B log B)`` typical). A group
needs at least two rows and ``min_blocks`` shared blocks; at most ``max_groups`` are kept (the
largest savings), the other rows read their whole window through their own tables.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["shared_prefix_groups", "group_slots"]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefix_groups(prefixes: Sequence[Sequence[int]], *, min_blocks: int, max_groups: int
                         ) -> list[tuple[list[int], int]]:
    """Groups of rows that share leading blocks, as ``(row indices, shared blocks)``.

    ``prefixes[i]``: row ``i``'s pool blocks that may be shared (complete and not written by the
    call). Returns disjoint groups of >= 2 rows whose members all start with the same
    ``shared blocks >= min_blocks`` entries, chosen to maximize ``sum (|g| - 1) * shared blocks``
    (see the module docstring), at most ``max_groups`` of them (largest saving first), each
    group's rows in increasing order.
    """
    if min_blocks < 1 or max_groups < 1:
        raise ValueError(f"min_blocks={min_blocks} and max_groups={max_groups} must be >= 1")
    order = sorted(range(len(prefixes)), key=lambda i: tuple(prefixes[i]))
    lcp = [_common(prefixes[order[j]], prefixes[order[j + 1]]) for j in range(len(order) - 1)]

    def best(lo: int, hi: int) -> tuple[int, list[tuple[int, int, int]]]:
        # sorted rows [lo, hi): (saving, [(lo, hi, shared blocks), ...])
        if hi - lo < 2:
            return 0, []
        cut = min(range(lo, hi - 1), key=lambda j: lcp[j])
        shared = lcp[cut]
        whole = (hi - lo - 1) * shared if shared >= min_blocks else 0
        left, right = best(lo, cut + 1), best(cut + 1, hi)
        if left[0] + right[0] > whole or whole == 0:
            return left[0] + right[0], left[1] + right[1]
        return whole, [(lo, hi, shared)]

    _, runs = best(0, len(order))
    runs.sort(key=lambda r: -(r[1] - r[0] - 1) * r[2])
    return [(sorted(order[lo:hi]), shared) for lo, hi, shared in runs[:max_groups]]


def group_slots(n: int) -> int:
    """The shared-prefix slots of a program for ``n`` groups: the next power of two (1, 2, 4, ...)."""
    return 1 << max(0, int(n) - 1).bit_length()
