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
