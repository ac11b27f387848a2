"""Blocked GAE across many chunks: every method against the float64 loop reference for both
closed forms (telescoped for lambda >= 1/2, per-step deltas below), bootstraps, all-zero values
(the gather-free branch), rows without any active step, and the chunk lengths gamma * lambda
selects."""

import jax
import numpy as np
import pytest

import jaxprm
from jaxprm.learner.gae import gae_block_size
from tests.learner import reference as ref


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.95, 0.3), (0.5, 1.0)])
def test_many_chunks_match_the_loop(gamma, lam):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10))
    B, T = 5, 16 * 7 + 5  # several chunks and a ragged tail
    r = rng.normal(size=(B, T))
    m = (rng.random((B, T)) < np.array([0.0, 0.05, 0.5, 0.9, 1.0])[:, None]).astype(float)
    for values, boot in ((rng.normal(size=(B, T)), rng.normal(size=B)), (np.zeros((B, T)), None)):
        want_a, want_r = ref.gae(r, values, m, gamma, lam, boot)
        methods = ("scan", "associative", "cumsum") if gamma == lam == 1.0 else ("scan", "associative")
        for method in methods:
            a, ret = jaxprm.learner.gae(r, values, m, gamma=gamma, lam=lam, method=method, bootstrap_values=boot)
            np.testing.assert_allclose(a, want_a, rtol=1e-10, atol=1e-10, err_msg=method)
            np.testing.assert_allclose(ret, want_r, rtol=1e-10, atol=1e-10, err_msg=method)


def test_block_size_bounds_the_scaling():
    assert gae_block_size(1.0, 1.0) == 16 and gae_block_size(0.99, 0.95) == 16
    assert gae_block_size(0.9, 0.95) == 8 and gae_block_size(0.9, 0.9) == 4 and gae_block_size(0.5, 1.0) == 2 and gae_block_size(0.9, 0.0) == 1
    for g in (0.3, 0.6, 0.8, 0.92, 0.97):
        assert g ** -gae_block_size(g, 1.0) <= 4.0


def test_auto_picks_the_parallel_prefix_on_accelerators_only():
    from jaxprm.learner.advantages import AdvantageConfig, _gae_method, gae_method_for

    assert gae_method_for(1.0, 1.0, "gpu") == gae_method_for(1.0, 1.0, "cpu") == "cumsum"
    assert gae_method_for(0.99, 0.95, "gpu") == gae_method_for(0.99, 0.95, "tpu") == "associative"
    assert gae_method_for(0.99, 0.95, "cpu") == "scan"
    assert _gae_method(AdvantageConfig(gamma=0.99, lam=0.95)) == gae_method_for(0.99, 0.95)  # this backend
    assert _gae_method(AdvantageConfig(gamma=0.99, lam=0.95, gae_method="associative")) == "associative"
