"""A generation server dies mid-run and comes back with its base weights: real server processes,
real HTTP, a real SIGKILL (``benchmarks.chaos``'s generation campaign with one kill)."""

from __future__ import annotations

import random

import pytest

from benchmarks.chaos import generation_campaign, train_rows


@pytest.mark.slow
def test_a_killed_server_is_replaced_then_gets_the_current_weights_before_it_samples(tmp_path):
    """Two external servers; one is SIGKILLed inside a step and restarted 20 s later on its port with
    base weights. The run finishes with steps 1..N exactly once, every step's ``behavior_kl`` ~0 (the
    restarted server got the learner's weights before it sampled), and rows that count the loss."""
    steps = 16
    c = generation_campaign(tmp_path, steps=steps, kills=1, down_s=20.0, rng=random.Random(0))
    assert c["returncode"] == 0, c["log_tail"]
    assert c["faults"] == 1 and c["steps_lost"] == 0 and c["rows_duplicated"] == 0
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["behavior_kl"] < 1e-3 for r in rows)
    assert c["downs"] == 1 and c["recoveries"] == 1
    assert c["kills"][0]["recover_s"] is not None  # it reported a pushed weight version before the run ended
    assert c["generated_tokens_since_restart"][c["kills"][0]["server"]] > 0  # and sampled for the run after that
    back = next(r["step"] for r in rows if r["server_recoveries"])
    assert back < steps and all(r["servers_down"] == 0 for r in rows if r["step"] >= back)
