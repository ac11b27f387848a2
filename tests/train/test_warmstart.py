"""Warm-start demonstrations: tokenized like rollouts; random moves in or out of the loss mask."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from jaxprm.train.warmstart import make_demos
from rollout.envs.frozenlake import ACTIONS, COMPACT_SYSTEM_PROMPT, FrozenLakeEnv, make_tasks


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _turns(demo, tokenizer):
    """(action, supervised) per assistant reply: a reply is exactly ```Action``` + end of turn."""
    replies = {a: [*tokenizer.encode(f"```{a}```"), tokenizer.eos_token_id] for a in ACTIONS}
    out = []
    for i in range(len(demo.tokens)):
        for a, toks in replies.items():
            if demo.tokens[i:i + len(toks)] == toks:
                masks = set(demo.mask[i:i + len(toks)])
                assert len(masks) == 1, "a reply is all in or all out of the loss"
                out.append((a, masks.pop() > 0))
    return out


@pytest.mark.parametrize("imitate_noise", [True, False])
def test_random_moves_in_or_out_of_the_loss(tokenizer, imitate_noise):
    train, _ = make_tasks(0, 16, 0, random_start_goal=False)
    env_factory = functools.partial(FrozenLakeEnv, COMPACT_SYSTEM_PROMPT)
    demos = make_demos(train, tokenizer, n=16, optimal_prob=0.5, seed=3, env_factory=env_factory,
                       imitate_noise=imitate_noise)
    replies = [t for d in demos for t in _turns(d, tokenizer)]
    assert sum(d.turns for d in demos) == len(replies)
    assert all(a in ACTIONS for a, _ in replies)
    supervised = [s for _, s in replies]
    if imitate_noise:
        assert all(supervised)
    else:
        assert any(supervised) and not all(supervised)  # half the moves are random: some are not optimal
    # the demonstrations carry the configured system prompt
    assert COMPACT_SYSTEM_PROMPT in tokenizer.decode(demos[0].tokens)
    assert all(len(d.tokens) == len(d.mask) for d in demos)
    assert np.isin(np.concatenate([d.mask for d in demos]), [0.0, 1.0]).all()


def test_the_cache_key_follows_the_demonstrations(tokenizer):
    """Settings the key data does not name (here the system prompt's text) still miss the cache."""
    from jaxprm.train.warmstart import warm_start_key
    from rollout.envs.frozenlake import SYSTEM_PROMPT

    train, _ = make_tasks(0, 8, 0, random_start_goal=False)

    def demos(prompt):
        return make_demos(train, tokenizer, n=8, optimal_prob=0.5, seed=3,
                          env_factory=functools.partial(FrozenLakeEnv, prompt))

    key_data = {"v": 1, "seed": 0}
    assert warm_start_key(key_data, demos(COMPACT_SYSTEM_PROMPT)) == warm_start_key(key_data, demos(COMPACT_SYSTEM_PROMPT))
    assert warm_start_key(key_data, demos(COMPACT_SYSTEM_PROMPT)) != warm_start_key(key_data, demos(SYSTEM_PROMPT))
    assert warm_start_key(key_data, demos(COMPACT_SYSTEM_PROMPT)) != warm_start_key({"v": 2, "seed": 0},
                                                                                   demos(COMPACT_SYSTEM_PROMPT))


def test_the_params_digest_survives_the_cache_and_sees_one_changed_value(tmp_path):
    import jax.numpy as jnp

    from jaxprm.train.warmstart import _load_npz, _save_npz, params_digest

    params = {"a": {"w": jnp.arange(6.0).reshape(2, 3)}, "b": jnp.ones(4, jnp.float32)}
    _save_npz(tmp_path / "p.npz", params)
    assert params_digest(_load_npz(tmp_path / "p.npz", params)) == params_digest(params)
    changed = {"a": {"w": params["a"]["w"].at[1, 2].add(1e-6)}, "b": params["b"]}
    assert params_digest(changed) != params_digest(params)
    assert params_digest({"a": {"w": params["a"]["w"]}, "b": params["b"].astype(jnp.bfloat16)}) != params_digest(params)


def test_a_token_budget_takes_fewer_rows_of_long_demos():
    """``warm_start.max_batch_tokens``: a batch padded to T has min(batch_size, budget // T) rows
    (at least 1), lengths bucketed by 256; without it every batch has batch_size rows."""
    import jax.numpy as jnp

    from jaxprm.train.warmstart import Demo, sft, sft_batch_rows

    assert sft_batch_rows(1536, 16, None) == 16
    assert [sft_batch_rows(T, 16, 4096) for T in (256, 512, 1024, 1536, 8192)] == [16, 8, 4, 2, 1]
    V = 8
    shapes = []

    def apply_fn(p, tokens, pos):  # a bigram model; records each shape it is traced with
        shapes.append(tuple(tokens.shape))
        return p["w"][tokens]

    demos = [Demo(tokens=[(i + k) % V for k in range(L)], mask=[1.0] * L, success=True, turns=1)  # learnable
             for i, L in enumerate([100] * 6 + [600] * 6 + [1100] * 6)]
    params = {"w": jnp.zeros((V, V))}
    for budget, want in ((None, {(4, 256), (4, 640), (4, 2048)}), (1024, {(4, 256), (1, 768), (1, 1280)})):
        shapes.clear()
        out, losses = sft(apply_fn, params, demos, steps=40, batch_size=4, lr=1e-2, seed=0, max_batch_tokens=budget)
        assert set(shapes) == want, budget
        assert losses[-1] < losses[0]


def test_the_token_budget_enters_the_cache_key_only_when_set():
    from jaxprm.train.adapters import warm_start_key_data
    from jaxprm.train.config import load_config

    plain = warm_start_key_data(load_config(None, []))
    assert "max_batch_tokens" not in plain["warm_start"]  # caches written before the setting stay valid
    assert warm_start_key_data(load_config(None, ["warm_start.max_batch_tokens=4096"]))["warm_start"][
        "max_batch_tokens"] == 4096
