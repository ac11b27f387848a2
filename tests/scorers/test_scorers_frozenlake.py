"""FrozenLakeProgressScorer: formula, branch-accumulated reward, env-state contract, PaTR ctx."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from prm_test_scorers import run, turn
from rollout.types import branch_messages
from scorers import FrozenLakeProgressScorer, PRMConfig, PRMRunner, frozenlake_progress_score, score_branch

MAP = ["SFFF", "FHFH", "FFFH", "HFFG"]


def bfs(grid, start):
    """Shortest path length to G with holes blocked (-1: unreachable / in a hole)."""
    n = len(grid)
    if grid[start[0]][start[1]] == "H":
        return -1
    seen = {start: 0}
    q = collections.deque([start])
    while q:
        r, c = q.popleft()
        if grid[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in ((0, 1), (1, 0), (0, -1), (-1, 0)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and (nr, nc) not in seen and grid[nr][nc] != "H":
                seen[(nr, nc)] = seen[(r, c)] + 1
                q.append((nr, nc))
    return -1


def state(pos, *, success=False):
    in_hole = MAP[pos[0]][pos[1]] == "H"
    return {
        "position": list(pos),
        "distance": bfs(MAP, pos),
        "start_distance": bfs(MAP, (0, 0)),
        "in_hole": in_hole,
        "success": success,
        "done": in_hole or success,
        "action": "Down",
        "valid": True,
    }


def walk(positions, *, final_reward=0.0, success=False):
    out = []
    for i, pos in enumerate(positions):
        last = i == len(positions) - 1
        out.append(
            turn(
                f"s{i}",
                out[-1].id if out else None,
                3,
                reward=final_reward if last else 0.0,
                env_state=state(pos, success=success and last),
            )
        )
    return out


def test_formula_worked_examples():
    start = bfs(MAP, (0, 0))
    assert start == 6
    # one step closer, no reward yet: 0.5 * 0 + 0.5 * (1 - 5/6)
    assert frozenlake_progress_score(state((1, 0)), 0.0) == pytest.approx(0.5 * (1 - 5 / 6))
    assert frozenlake_progress_score(state((0, 0)), 0.0) == 0.0
    assert frozenlake_progress_score(state((3, 3), success=True), 1.0) == 1.0
    assert frozenlake_progress_score(state((1, 1)), 0.0) == 0.0  # hole
    assert frozenlake_progress_score(state((1, 1)), 0.0, hole_score=0.1) == 0.1
    # an intermediate reward counts, clipped to max_reward
    assert frozenlake_progress_score(state((2, 2)), 0.5, reward_weight=0.4) == pytest.approx(0.4 * 0.5 + 0.6 * (1 - 2 / 6))
    assert frozenlake_progress_score(state((2, 2)), 7.0, reward_weight=1.0) == 1.0
    # moving away from the goal never goes below zero; unreachable cells score zero progress
    far = {"distance": 9, "start_distance": 6}
    assert frozenlake_progress_score(far, 0.0) == 0.0
    assert frozenlake_progress_score({"distance": -1, "start_distance": 6}, 0.0) == 0.0
    # start on the goal
    assert frozenlake_progress_score({"distance": 0, "start_distance": 0}, 0.0) == pytest.approx(0.5)


def test_scores_are_in_unit_interval_and_rise_along_a_shortest_path():
    path = [(1, 0), (2, 0), (2, 1), (2, 2), (3, 2)]
    scorer = FrozenLakeProgressScorer()
    branch = walk(path)
    scores = [run(scorer.evaluate(it, {"branch": branch})) for it in branch]
    assert all(0.0 <= x <= 1.0 for x in scores)
    assert scores == sorted(scores) and scores[0] < scores[-1]


def test_accumulated_reward_uses_the_branch_prefix_only():
    branch = walk([(1, 0), (2, 0), (2, 1)])
    branch[1].reward = 0.5  # an intermediate step reward on turn 1
    s = FrozenLakeProgressScorer(reward_weight=0.5)
    assert run(s.evaluate(branch[0], {"branch": branch})) == pytest.approx(0.5 * (1 - 5 / 6))
    assert run(s.evaluate(branch[2], {"branch": branch})) == pytest.approx(0.25 + 0.5 * (1 - 3 / 6))
    # without a branch in ctx only the turn's own reward counts
    assert run(s.evaluate(branch[2], {})) == pytest.approx(0.5 * (1 - 3 / 6))


def test_delta_mode_is_the_change_of_the_level_score():
    # down, down, right, left (away from the goal), right, right, right into the hole at (2, 3)
    path = [(1, 0), (2, 0), (2, 1), (2, 0), (2, 1), (2, 2), (2, 3)]
    branch = walk(path)
    level, delta = FrozenLakeProgressScorer(), FrozenLakeProgressScorer(mode="delta")
    lv = [run(level.evaluate(it, {"branch": branch})) for it in branch]
    dv = [run(delta.evaluate(it, {"branch": branch})) for it in branch]
    np.testing.assert_allclose(dv, np.diff([0.0, *lv]), atol=1e-12)  # the start state scores 0
    assert dv[0] == pytest.approx(0.5 / 6) and dv[3] == pytest.approx(-0.5 / 6)  # toward / away
    assert dv[-1] == pytest.approx(-lv[-2]) and dv[-1] < 0  # into a hole gives back all progress
    assert sum(dv) == pytest.approx(lv[-1])  # telescopes
    good = walk([(1, 0), (2, 0), (2, 1), (2, 2), (3, 2), (3, 3)], final_reward=1.0, success=True)
    gd = [run(delta.evaluate(it, {"branch": good})) for it in good]
    assert sum(gd) == pytest.approx(1.0) and gd[-1] == pytest.approx(1.0 - 0.5 * (1 - 1 / 6))
    res = run(PRMRunner(PRMConfig(), scorers=[FrozenLakeProgressScorer(mode="delta")]).run(good))
    np.testing.assert_allclose(res["s0"], [0.5 / 6] * 3)
    with pytest.raises(ValueError, match="mode"):
        FrozenLakeProgressScorer(mode="sum")


def test_success_and_hole_through_the_runner():
    good = walk([(1, 0), (2, 0), (2, 1), (2, 2), (3, 2), (3, 3)], final_reward=1.0, success=True)
    res = run(PRMRunner(PRMConfig(), scorers=[FrozenLakeProgressScorer()]).run(good))
    np.testing.assert_allclose(res["s5"], [1.0, 1.0, 1.0])
    bad = walk([(1, 0), (1, 1)])
    res = run(PRMRunner(PRMConfig(), scorers=[FrozenLakeProgressScorer()]).run(bad))
    np.testing.assert_allclose(res["s1"], [0.0, 0.0, 0.0])


def test_patr_style_ctx_gives_a_branch_score():
    branch = walk([(1, 0), (2, 0)])
    ctx = {"messages": branch_messages(branch), "branch": branch}
    s = FrozenLakeProgressScorer()
    assert run(s.evaluate(branch[-1], ctx)) == pytest.approx(0.5 * (1 - 4 / 6))
    assert run(score_branch(s, branch)) == pytest.approx(0.5 * (1 - 4 / 6))


def test_missing_state_rejects_with_the_key():
    it = turn("x", None, 2, env_state={"position": [0, 0]})
    with pytest.raises(ValueError, match="env_state lacks 'distance'"):
        run(FrozenLakeProgressScorer().evaluate(it, {}))
    it = turn("x", None, 2, env_state={"distance": "3", "start_distance": 6})
    with pytest.raises(ValueError, match="must be an int"):
        run(FrozenLakeProgressScorer().evaluate(it, {}))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"reward_weight": 1.5}, "reward_weight"), ({"hole_score": -0.1}, "hole_score"), ({"max_reward": 0}, "max_reward")],
)
def test_kwargs_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrozenLakeProgressScorer(**kwargs)


@pytest.mark.parametrize("w", [0.0, 0.25, 0.5, 0.9])
def test_a_live_branch_scores_at_most_one_minus_the_reward_weight(w):
    """A branch still running (not in a hole, not at the goal) has earned no reward on FrozenLake, so
    it scores ``(1 - w) * progress <= 1 - w``: PaTR's prune rule ``s < median - alpha`` can never fire
    among live branches when ``alpha >= 1 - w`` (the default w = 0.5 with the paper's alpha = 0.5)."""
    scorer = FrozenLakeProgressScorer(reward_weight=w)
    live = [(r, c) for r in range(4) for c in range(4) if MAP[r][c] in "SF"]
    scores = [run(scorer.evaluate(turn("t", None, 3, reward=0.0, env_state=state(p)), {})) for p in live]
    assert max(scores) <= 1 - w + 1e-12 and min(scores) >= 0.0
    assert max(scores) == pytest.approx((1 - w) * (1 - 1 / bfs(MAP, (0, 0))))  # the cell next to G
    med = float(np.median(scores))
    assert not [s for s in scores if s < med - (1 - w)]  # alpha = 1 - w prunes nothing
