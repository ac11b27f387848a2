"""The cascade decode plan (which rows share which cached prefix) and the cascade program against
the per-row gather on the benchmark's batch of several groups."""

from __future__ import annotations

from benchmarks.serve_cascade import bench
from jaxprm.serve.cascade import group_slots, shared_prefix_groups


def test_shared_prefix_groups_maximize_the_saved_gather():
    """The cascade plan: rows sorted by their blocks, runs kept whole or cut at their shortest common
    prefix, whichever saves more ``(|g| - 1) * shared blocks``; groups need 2 rows and ``min_blocks``;
    at most ``max_groups`` (largest saving first)."""
    system = [1, 2]
    a, b = system + [3, 4, 5, 6], system + [7, 8, 9, 10]
    rows = [a + [11], b + [12], a + [13], b, a, system + [20]]
    groups = shared_prefix_groups(rows, min_blocks=2, max_groups=8)
    # two prompt groups of 6 blocks (3 and 2 rows) beat one 2-block system-prompt group of 6
    assert sorted(groups) == [([0, 2, 4], 6), ([1, 3], 6)]
    assert shared_prefix_groups(rows, min_blocks=2, max_groups=1) == [([0, 2, 4], 6)]
    assert shared_prefix_groups(rows, min_blocks=7, max_groups=8) == []
    # a system prompt shared by many rows whose own prompts are short: one group
    many = [system + [30 + i] for i in range(6)]
    assert shared_prefix_groups(many, min_blocks=2, max_groups=8) == [(list(range(6)), 2)]
    assert shared_prefix_groups([a], min_blocks=1, max_groups=8) == []
    assert [group_slots(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]


def test_cascade_benchmark_batch_decodes_the_same_greedy_tokens_as_the_per_row_gather():
    """``benchmarks.serve_cascade`` on the tiny model: 3 groups x 3 rows with distinct 64-token
    prompts, one decode step through the cascade program (3 prefixes in 4 slots of 4 rows, one
    slot empty) and through full per-row tables: the same greedy tokens."""
    res = bench("tiny", groups=3, rows=3, prompt=64, generated=5, repeats=1)
    assert res["same_greedy_tokens"]
    assert (res["shared_slots"], res["group_rows"], res["batch_bucket"]) == (4, 4, 9)
