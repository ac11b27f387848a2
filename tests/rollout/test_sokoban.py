"""Text Sokoban: the rules on hand-made rooms, the solver against a plain forward search, generated
levels (solvable, seeded, held out), clones, dead squares, the progress scorer and the registry."""

import asyncio
import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.envs import ENV_NAMES, SokobanEnv, SokobanTask, get_env
from rollout.envs.base import ACTIONS
from rollout.envs.sokoban import COMPACT_SYSTEM_PROMPT, generate_level, make_tasks, render_room
from rollout.envs.sokoban_rules import (dead_squares, distance_table, optimal_moves, parse_level, push,
                                        render_level, solve)
from rollout.types import Interaction
from scorers import SokobanProgressScorer, sokoban_progress_score

CONTRACT_KEYS = {"position", "boxes", "boxes_on_target", "distance", "start_distance", "dead", "success", "done",
                 "action", "valid", "truncated", "turn"}


def run(coro):
    return asyncio.run(coro)


def play(room, moves, **task_kw):
    env = SokobanEnv(invalid_ends_episode=True)
    run(env.reset(SokobanTask(room=room, **task_kw)))
    return env, [run(env.step(f"```{m}```")) for m in moves]


# --- the rules -------------------------------------------------------------------------------------

def test_a_push_moves_the_box_one_cell_and_the_player_into_its_place():
    env, (res,) = play(("#####", "#@$_.", "#___#"), ["Right"])
    assert res.info["position"] == [1, 2] and res.info["boxes"] == [[1, 3]]
    assert res.reward == pytest.approx(-0.1) and not res.done
    assert set(res.info) >= CONTRACT_KEYS


@pytest.mark.parametrize("room, move", [
    (("#####", "#@$#.", "#___#"), "Right"),   # the box is against a wall
    (("######", "#@$$..", "#____#"), "Right"),  # the box is against another box
    (("$@_", "._#"), "Left"),                # the box is against the grid's edge
])
def test_a_blocked_push_is_a_no_op_that_costs_a_step(room, move):
    layout, start = parse_level(room)
    env, (res,) = play(room, [move])
    assert env.state == start and res.reward == pytest.approx(-0.1)
    assert "did not move" in res.observation


def test_walking_into_a_wall_or_the_edge_is_a_no_op():
    env, results = play(("@#", "$.", "__"), ["Right", "Up", "Left"])
    assert all(r.info["position"] == [0, 0] for r in results)


def test_a_box_onto_a_target_gives_one():
    room = ("#######", "#@$.$.#", "#____##")  # two boxes: the first push puts one on, the next push...
    env, results = play(room, ["Right", "Right"], max_turns=5)
    assert results[0].reward == pytest.approx(0.9) and results[0].info["boxes_on_target"] == 1
    # ...is blocked by the second box: a no-op
    assert results[1].reward == pytest.approx(-0.1) and results[1].info["boxes_on_target"] == 1


def test_pushing_a_box_off_a_target_costs_one_and_onto_the_next_gives_it_back():
    room = ("######", "#@*_.#", "#____#", "#_$__#", "#____#", "######")  # one box on a target, one off
    env, results = play(room, ["Right", "Right"])
    assert results[0].reward == pytest.approx(-0.1 - 1) and results[0].info["boxes_on_target"] == 0
    assert results[1].reward == pytest.approx(-0.1 + 1) and results[1].info["boxes_on_target"] == 1
    assert not results[1].done


def test_success_ends_the_episode_with_the_bonus_and_max_turns_truncates():
    env, results = play(("#####", "#@$.#", "#___#"), ["Right"])
    (res,) = results
    assert res.done and res.info["success"] and res.reward == pytest.approx(-0.1 + 1 + 10)
    env, results = play(("#####", "#@$_.", "#___#"), ["Down", "Up"], max_turns=2)
    assert results[-1].done and results[-1].info["truncated"] and not results[-1].info["success"]
    assert "Out of turns" in results[-1].observation


def test_an_invalid_answer_ends_the_episode_or_is_a_no_op():
    env = SokobanEnv(invalid_ends_episode=True)
    run(env.reset(SokobanTask(room=("#####", "#@$_.", "#___#"), max_turns=5)))
    run(env.step("```Left```"))  # into the wall: a no-op turn
    res = run(env.step("I push right"))
    # it forfeits turns 2..5: quitting earns exactly what playing on with no-op moves would
    assert res.done and not res.info["valid"] and res.reward == pytest.approx(-0.4)
    _, played_on = play(("#####", "#@$_.", "#___#"), ["Left"] * 5, max_turns=5)
    assert sum(r.reward for r in played_on) == pytest.approx(-0.1 + res.reward)
    env = SokobanEnv(invalid_ends_episode=False)
    run(env.reset(SokobanTask(room=("#####", "#@$_.", "#___#"))))
    res = run(env.step("no fence"))
    assert not res.done and res.info["position"] == [1, 1]


def test_a_box_in_a_corner_off_target_is_dead():
    room = ("#####", "#___#", "#_$_#", "#_@_#", "#.__#")  # pushing Up puts the box against the top wall: dead
    env, (res,) = play(room, ["Up"])
    assert res.info["dead"] and res.info["distance"] == -1
    assert res.info["start_distance"] > 0


def test_the_observation_uses_the_model_symbols():
    env = SokobanEnv(COMPACT_SYSTEM_PROMPT)
    obs = run(env.reset(SokobanTask(room=("#####", "#@$.#", "#_*_#"), max_turns=3)))
    assert render_room(("#@$.+*",)) == "#PXOS*"
    assert "#PXO#" in obs and obs.endswith("What is your move?")
    assert env.system_prompt(None) == COMPACT_SYSTEM_PROMPT


def test_parse_and_render_are_inverse_and_bad_levels_are_refused():
    room = ("#####", "#@$.#", "#_*_#")
    assert render_level(*parse_level(room)) == room
    for bad in (("#@$#",), ("#@$.", "#__"), ("#$.#",), ("#@@$.",), ("#@x.#",)):
        with pytest.raises(ValueError):
            SokobanTask(room=bad)


# --- the solver ------------------------------------------------------------------------------------

def _forward_distance(layout, start, limit=40):
    """Fewest moves to the solution by a plain forward BFS (no pruning, no table): the reference."""
    seen, queue = {start: 0}, collections.deque([start])
    while queue:
        s = queue.popleft()
        if set(s[1]) == set(layout.targets):
            return seen[s]
        if seen[s] >= limit:
            continue
        for a in ACTIONS:
            t = push(layout, s, a)[0]
            if t not in seen:
                seen[t] = seen[s] + 1
                queue.append(t)
    return -1


@pytest.mark.parametrize("seed", range(12))
def test_the_solver_table_matches_a_forward_search(seed):
    rng = np.random.default_rng(seed)
    size, boxes = [(5, 1), (6, 1), (6, 2)][seed % 3]
    layout, start = parse_level(generate_level(rng, size, boxes))
    table = distance_table(layout)
    states = [start]
    for _ in range(6):  # random walks from the start reach live and dead states alike
        s = start
        for _ in range(8):
            s = push(layout, s, ACTIONS[int(rng.integers(4))])[0]
            states.append(s)
    for s in states:
        assert table.get(s, -1) == _forward_distance(layout, s), s


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from([(5, 1), (6, 1), (6, 2), (7, 2), (8, 2)]))
def test_every_generated_level_is_solved_by_the_solver_plan_in_the_env(seed, shape):
    size, boxes = shape
    room = generate_level(seed, size, boxes)
    assert len(room) == size and all(len(r) == size for r in room)
    assert "".join(room).count("$") + "".join(room).count("*") == boxes
    layout, start = parse_level(room)
    plan = solve(layout, start)
    assert plan is not None and len(plan) == distance_table(layout)[start] >= 2
    env = SokobanEnv()
    run(env.reset(SokobanTask(room=room, max_turns=len(plan))))
    for i, move in enumerate(plan):
        res = run(env.step(f"```{move}```"))
        assert res.info["distance"] == len(plan) - i - 1
    assert res.done and res.info["success"]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from([(5, 1), (6, 2), (7, 2)]))
def test_dead_squares_never_hold_a_box_of_a_solvable_state(seed, shape):
    layout, _ = parse_level(generate_level(seed, *shape))
    dead = dead_squares(layout)
    assert not dead & set(layout.targets)
    for (_, boxes) in distance_table(layout):
        assert not dead & set(boxes)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), moves=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=6))
def test_a_clone_is_independent_of_the_original(seed, moves):
    env = SokobanEnv(invalid_ends_episode=False)
    run(env.reset(SokobanTask(room=generate_level(seed, 6, 2), max_turns=50)))
    before = (env.state, env.turn, env.done)
    twin = env.clone()
    played = []
    for m in moves:
        if twin.done:  # a short level can be solved within the moves
            break
        run(twin.step(f"```{m}```"))
        played.append(m)
    assert (env.state, env.turn, env.done) == before
    for m in played:  # the original replays to the same state the clone reached
        run(env.step(f"```{m}```"))
    assert (env.state, env.turn, env.done) == (twin.state, twin.turn, twin.done)


def test_optimal_moves_lower_the_distance_by_one():
    layout, start = parse_level(("#######", "#@_$_.#", "#_____#"))
    assert optimal_moves(layout, start) == ["Right"]
    assert solve(layout, start) == ["Right", "Right", "Right"]
    env = SokobanEnv()
    run(env.reset(SokobanTask(room=("#######", "#@_$_.#", "#_____#"))))
    assert env.optimal_actions() == ["Right"] and env.distance() == 3


# --- levels ----------------------------------------------------------------------------------------

def test_levels_are_seeded_and_the_held_out_set_is_disjoint():
    a_train, a_eval = make_tasks(7, 60, 16, size=5, boxes=1, max_turns=10)
    b_train, b_eval = make_tasks(7, 60, 16, size=5, boxes=1, max_turns=10)
    assert [t.room for t in a_train] == [t.room for t in b_train] and [t.room for t in a_eval] == [t.room for t in b_eval]
    assert not {t.room for t in a_train} & {t.room for t in a_eval}
    assert len({t.room for t in a_train}) == 60 and all(t.optimal_length >= 2 for t in a_train)
    assert make_tasks(8, 4, 0)[0][0].room != a_train[0].room
    with pytest.raises(ValueError, match="size"):
        generate_level(0, 4, 1)
    with pytest.raises(ValueError, match="boxes"):
        generate_level(0, 6, 4)


# --- the progress scorer ---------------------------------------------------------------------------

def _interaction(i, state, parent=None):
    return Interaction(id=f"i{i}", parent_id=parent, messages=[], output_messages=[], env_state=state, reward=-0.1)


def test_the_scorer_gives_dead_zero_solved_one_and_rises_along_an_optimal_plan():
    assert sokoban_progress_score({"distance": -1, "start_distance": 4, "dead": True}) == 0.0
    assert sokoban_progress_score({"distance": 0, "start_distance": 4, "success": True}) == 1.0
    with pytest.raises(ValueError, match="distance"):
        sokoban_progress_score({"start_distance": 3})
    room = generate_level(3, 6, 2)
    layout, start = parse_level(room)
    env = SokobanEnv()
    run(env.reset(SokobanTask(room=room, max_turns=40)))
    scores = [0.0]
    for move in solve(layout, start):
        scores.append(sokoban_progress_score(run(env.step(f"```{move}```")).info))
    assert all(b > a for a, b in zip(scores, scores[1:])) and scores[-1] == 1.0


def test_delta_mode_scores_the_change_over_the_turn():
    room = ("#####", "#___#", "#_$_#", "#_@_#", "#.__#")
    env = SokobanEnv()
    run(env.reset(SokobanTask(room=room, max_turns=10)))
    first = run(env.step("```Left```")).info   # a step that keeps the level solvable
    second = run(env.step("```Up```")).info    # ...then one that may or may not help
    a, b = _interaction(0, first), _interaction(1, second, "i0")
    ctx = {"branch": [a, b]}
    scorer = SokobanProgressScorer(mode="delta")
    delta = run(scorer.evaluate(b, ctx))
    assert delta == pytest.approx(sokoban_progress_score(second) - sokoban_progress_score(first))
    assert run(SokobanProgressScorer(mode="delta").evaluate(a, {"branch": [a]})) == sokoban_progress_score(first)
    assert SokobanProgressScorer.reward_range("delta") == (-1.0, 1.0)
    with pytest.raises(ValueError, match="mode"):
        SokobanProgressScorer(mode="sum")


# --- the registry ----------------------------------------------------------------------------------

def test_the_registry_names_both_games_and_reads_tasks_from_json():
    assert ENV_NAMES == ("frozenlake", "sokoban")
    spec = get_env("sokoban")
    task = spec.task({"room": ["#####", "#@$.#"], "max_turns": 5})
    assert isinstance(task, SokobanTask) and task.room == ("#####", "#@$.#")
    assert isinstance(spec.factory("full")(), SokobanEnv)
    with pytest.raises(ValueError, match="allowed: \\('frozenlake', 'sokoban'\\)"):
        get_env("sokobann")
    with pytest.raises(ValueError, match="unknown sokoban task keys"):
        spec.task({"desc": ["SFG"]})
    with pytest.raises(ValueError, match="system_prompt"):
        spec.factory("short")


def test_every_cell_is_one_token_for_the_tiny_policy(tiny_tokenizer):
    """The room's rows keep one token a cell (no symbol pair merges), so a cell's column is its
    token's offset in the row, as on FrozenLake's map."""
    tasks, _ = make_tasks(0, 16, 0, size=6, boxes=2)
    for task in tasks:
        for line in render_room(task.room).split("\n"):
            assert len(tiny_tokenizer.encode(line)) == len(line), line
