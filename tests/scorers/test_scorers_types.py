"""The parts of rollout.types the scorers rely on: cheap, isolating branch clones."""

from __future__ import annotations

import copy

import numpy as np

from prm_test_scorers import chain, tree_of, turn
from rollout.types import branch_messages, copy_json


def test_copy_json_copies_containers_and_defers_to_deepcopy_for_the_rest():
    arr = np.zeros(2)
    data = {"a": [1, {"b": (2, "x")}], "arr": arr}
    out = copy_json(data)
    assert out == {"a": [1, {"b": (2, "x")}], "arr": out["arr"]}
    assert out["a"] is not data["a"] and out["a"][1] is not data["a"][1]
    assert out["arr"] is not arr and np.array_equal(out["arr"], arr)


def test_model_responses_are_shared_by_copies():
    it = turn("a", None, 3)
    assert copy.deepcopy(it.model_response) is it.model_response
    assert copy.copy(it.model_response) is it.model_response
    assert it.clone().model_response is it.model_response


def test_clone_branch_isolates_messages_state_and_rewards():
    b = chain([2, 3])
    b[1].env_state = {"position": [0, 1]}
    b[1].token_rewards = np.ones(3, dtype=np.float32)
    tree = tree_of(b)
    clone = tree.clone_branch("t1")
    clone[1].messages[0]["content"] = "changed"
    clone[1].env_state["position"][0] = 9
    clone[1].token_rewards[:] = 5
    assert b[1].messages[0]["content"] == "sys"
    assert b[1].env_state == {"position": [0, 1]}
    assert np.all(b[1].token_rewards == 1)
    msgs = branch_messages(b)
    msgs[0]["content"] = "changed"
    assert b[1].messages[0]["content"] == "sys"
