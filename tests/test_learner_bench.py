"""``benchmarks.learner``'s row builders."""

from __future__ import annotations


def test_the_learner_benchmarks_flat_grpo_rows_share_only_their_prompt():
    from benchmarks.learner import prompt_rows

    rows = prompt_rows(20, (5, 9), groups=3, leaves=4, vocab=64)
    assert len(rows) == 12 and {r.group_id for r in rows} == {0, 1, 2}
    for g in range(3):
        mine = [r for r in rows if r.group_id == g]
        assert all((r.tokens[:20] == mine[0].tokens[:20]).all() and 25 <= len(r.tokens) < 29 for r in mine)
        assert len({int(r.tokens[20]) for r in mine}) == 4  # the leaves part right after the prompt
        assert all(r.loss_mask[:20].sum() == 0 for r in mine)
