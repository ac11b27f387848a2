"""Random tree groups as flat token-aligned rows (what ``rollout.export.group_rows`` produces):
each tree node is one turn (env/prompt tokens with mask 0, then generated tokens with mask 1 and
log-probs, and a node key shared by the rows that share the turn), and every leaf is one row. Used by the packing tests and ``benchmarks.learner``."""

from __future__ import annotations

import numpy as np

from jaxprm.learner.batch import RowData


def random_tree_rows(rng: np.random.Generator, *, group_id: int, leaves: int, turns: int = 3,
                     prompt_len: tuple[int, int] = (2, 6), turn_len: tuple[int, int] = (1, 5),
                     vocab: int = 50, share: float = 0.6, shared_prompt: bool = True) -> list[RowData]:
    """``leaves`` rows of one group. Each new leaf copies a random prefix (a whole number of turns)
    of an earlier leaf with probability ``share`` (a tree branch), else starts fresh from the
    group's prompt (``shared_prompt``) or a new prompt; then samples its remaining turns."""
    prompt = rng.integers(1, vocab, rng.integers(*prompt_len))
    made: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
    rows = []
    for _ in range(leaves):
        if made and rng.random() < share:
            src = made[rng.integers(len(made))]
            keep = int(rng.integers(1, len(src) + 1))
            turns_of = list(src[:keep])
        else:
            p = prompt if shared_prompt else rng.integers(1, vocab, rng.integers(*prompt_len))
            turns_of = [(p, np.zeros(len(p), np.float32), np.zeros(len(p), np.float32), None)]
        while len(turns_of) < turns + 1:
            env = rng.integers(1, vocab, rng.integers(0, 3))
            gen = rng.integers(1, vocab, rng.integers(*turn_len))
            toks = np.concatenate([env, gen])
            mask = np.concatenate([np.zeros(len(env)), np.ones(len(gen))]).astype(np.float32)
            lp = np.where(mask > 0, -rng.random(len(toks)) * 3, 0.0).astype(np.float32)
            turns_of.append((toks, mask, lp, (group_id, len(made), len(turns_of))))  # a node key
        made.append(turns_of)
        tokens = np.concatenate([t[0] for t in turns_of]).astype(np.int32)
        rows.append(RowData(tokens=tokens, loss_mask=np.concatenate([t[1] for t in turns_of]),
                            logprobs=np.concatenate([t[2] for t in turns_of]),
                            outcome_reward=float(rng.random() < 0.5), group_id=group_id,
                            process_rewards=np.where(np.concatenate([t[1] for t in turns_of]) > 0,
                                                     -(rng.random(len(tokens)) < 0.3).astype(np.float32), 0.0),
                            turn_ids=np.concatenate([np.where(t[1] > 0, j - 1, -1) for j, t in enumerate(turns_of)]).astype(np.int32),
                            turn_nodes=[t[3] for t in turns_of[1:]], turn_states=[None] * turns,
                            turn_rewards=np.zeros(turns, np.float32)))
    return rows


def random_groups(seed: int, groups: int = 3, leaves: tuple[int, int] = (1, 6), **kw) -> list[RowData]:
    rng = np.random.default_rng(seed)
    rows: list[RowData] = []
    for g in range(groups):
        rows += random_tree_rows(rng, group_id=g, leaves=int(rng.integers(*leaves)), **kw)
    return rows
