"""Export: process rewards stitched at the generated positions, prm_stats and its metrics, the
discount, individual export, HTTP rows -> jaxprm.Batch, __hitl__ and set_reward transitions."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest

import jaxprm
from rollout.proxy import ProxyRow, prm_stats_metrics, rows_from_json
from rollout.proxy.export import discounted_rewards
from scorers import LengthBudgetScorer

from . import proxy_scorers as ps
from .conftest import ADMIN, admin_headers, running_proxy

SYS = {"role": "system", "content": "FrozenLake: reach G."}
USER = {"role": "user", "content": "Map:\nP _\n_ G\nWhat is your move?"}


async def _episode(srv, session, turns: int, reward: float | None = 1.0):
    async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=session.api_key, max_retries=0) as client:
        msgs = [SYS, USER]
        for i in range(turns):
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8)
            msgs = [*msgs, r.choices[0].message.model_dump(), {"role": "user", "content": f"obs {i}"}]
    if reward is not None:
        srv.proxy.set_reward(session, {"reward": reward})


def test_scored_export_stitches_token_rewards_and_reports_prm_stats(upstream):
    ps.reset()

    async def go():
        async with running_proxy(upstream, scorers=[ps.TurnIndexScorer(weight=2.0),
                                                    LengthBudgetScorer(max_output_tokens=4)]) as srv:
            gid, sessions = srv.proxy.start_session("sc", group_size=2)
            await asyncio.gather(_episode(srv, sessions[0], 3, 1.0), _episode(srv, sessions[1], 2, 0.0))
            recs = {s.id: list(s.records.values()) for s in sessions}
            async with httpx.AsyncClient(timeout=60) as http:
                r = await http.post(srv.url + "/export_trajectories",
                                    json={"session_ids": [s.id for s in sessions], "group_id": gid},
                                    headers=admin_headers())
            return recs, r

    recs, r = asyncio.run(go())
    assert r.status_code == 200, r.text
    out = r.json()
    assert "rejected" not in out and len(out["rows"]) == 2
    for row in out["rows"]:
        chain = recs[row["session_id"]]
        pr = np.asarray(row["process_rewards"], np.float32)
        mask = np.asarray(row["loss_mask"])
        assert np.all(pr[mask == 0] == 0)
        for j, rec in enumerate(chain):
            s, n = rec.response.input_len, rec.response.output_len
            length_ok = 1.0 if n <= 4 else 0.0  # LengthBudgetScorer: 1 within budget, else 0 (weight 1)
            assert np.allclose(pr[s:s + n], 2.0 * j + length_ok)
    stats = out["prm_stats"]
    assert stats["namespace"] == "rollout" and set(stats["sessions"]) == {"sc-0", "sc-1"}
    assert len(stats["sessions"]["sc-0"]["turn_results"]) == 3 * 2  # 3 turns x 2 scorers
    acc = prm_stats_metrics(stats)
    summary = acc.summary()
    # turn_index: weighted turn rewards 0, 2, 4 (session 0) and 0, 2 (session 1): mean 8/5
    assert summary["rollout/prm_turn_reward/turn_index"] == pytest.approx(8 / 5)
    assert acc.stat("prm_turn_reward/turn_index").count == 5
    assert summary["rollout/prm_trajectory_reward/turn_index"] == pytest.approx((6 + 2) / 2)


def test_rows_become_a_batch_through_the_learner_path(upstream):
    async def go():
        async with running_proxy(upstream, scorers=[ps.TurnIndexScorer()]) as srv:
            gid, sessions = srv.proxy.start_session("b", group_size=2)
            await asyncio.gather(_episode(srv, sessions[0], 2, 1.0), _episode(srv, sessions[1], 1, 0.0))
            ids = [s.id for s in sessions]
            result = await srv.proxy.export({"session_ids": ids, "group_id": gid})  # in-process: no JSON
            return result

    result = asyncio.run(go())
    rows = result.rows
    assert all(isinstance(r, ProxyRow) for r in rows)
    again = rows_from_json([r.to_json() for r in rows])  # the HTTP shape round-trips exactly
    for a, b in zip(rows, again):
        for f in ("tokens", "loss_mask", "logprobs", "turn_ids", "versions", "process_rewards"):
            assert np.array_equal(getattr(a, f), getattr(b, f))
    batch = jaxprm.pad_rows([r.to_row_data(0) for r in rows])
    assert isinstance(batch, jaxprm.Batch)
    for i, r in enumerate(rows):
        L = len(r.tokens)
        # prediction positions: entry t is about token t+1 (one shift at the edge)
        assert np.array_equal(np.asarray(batch.loss_mask)[i, :L - 1], r.loss_mask[1:])
        assert np.allclose(np.asarray(batch.old_logprobs)[i, :L - 1], r.logprobs[1:])
        assert np.allclose(np.asarray(batch.process_rewards)[i, :L - 1], r.process_rewards[1:])
        assert float(batch.outcome_rewards[i]) == r.outcome_reward
    adv = jaxprm.compute_advantages(batch, jaxprm.AdvantageConfig(shaping_mode="additive"))
    assert np.isfinite(np.asarray(adv.advantages)).all()


def test_discount_and_individual_export(upstream):
    async def go():
        async with running_proxy(upstream) as srv:
            _, (s,) = srv.proxy.start_session("ind")
            await _episode(srv, s, 3, reward=None)
            recs = list(s.records.values())
            srv.proxy.set_reward(s, {"rewards": {recs[0].id: 1.0, recs[2].id: 2.0}})
            return recs, await srv.proxy.export({"session_ids": [s.id], "style": "individual", "discount": 0.5})

    recs, result = asyncio.run(go())
    # R2 = 2, R1 = 0 + 0.5 * 2 = 1, R0 = 1 + 0.5 * 1 = 1.5
    assert [r.outcome_reward for r in result.rows] == [1.5, 1.0, 2.0]
    for rec, row in zip(recs, result.rows):
        n_in = rec.response.input_len
        assert row.interaction_ids == (rec.id,) and row.loss_mask[:n_in].sum() == 0 and row.loss_mask[n_in:].all()
    assert discounted_rewards(recs, 1.0) == {recs[0].id: 3.0, recs[1].id: 2.0, recs[2].id: 2.0}


def test_set_reward_transitions_and_hitl_survives_export(upstream):
    async def go():
        async with running_proxy(upstream) as srv:
            admin = openai.AsyncOpenAI(base_url=srv.base_url, api_key=ADMIN, max_retries=0)
            r1 = await admin.chat.completions.create(model="m", messages=[SYS, USER], max_tokens=8)
            async with httpx.AsyncClient(timeout=60) as http:
                a1 = (await http.post(srv.url + "/rl/set_reward", json={"reward": 0.5}, headers=admin_headers())).json()
                a2 = (await http.post(srv.url + "/rl/set_reward", json={"reward": 0.7}, headers=admin_headers())).json()
                msgs = [SYS, USER, r1.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
                r2 = await admin.chat.completions.create(model="m", messages=msgs, max_tokens=8)
                ex1 = (await http.post(srv.url + "/export_trajectories", json={"session_ids": ["__hitl__"]},
                                       headers=admin_headers())).json()
                a3 = (await http.post(srv.url + "/rl/set_reward", json={"reward": 1.0}, headers=admin_headers())).json()
                ex2 = (await http.post(srv.url + "/export_trajectories", json={"session_ids": ["__hitl__"]},
                                       headers=admin_headers())).json()
            await admin.close()
            return r1, r2, a1, a2, a3, ex1, ex2, srv.proxy.store.hitl

    r1, r2, a1, a2, a3, ex1, ex2, hitl = asyncio.run(go())
    assert a1["trajectory_id"] == 0 and a1["ready_transition"] and a1["session_id"] == "__hitl__"
    assert a2["trajectory_id"] == 0 and not a2["ready_transition"] and a2["trajectory_ready"]  # nothing new
    (row1,) = ex1["rows"]
    assert row1["leaf_id"] == r1.id and row1["outcome_reward"] == 0.7  # the second set_reward re-set it
    # r2 arrived after trajectory 0 was ready: it survived the export and forms trajectory 1
    assert a3["trajectory_id"] == 1 and a3["ready_transition"]
    (row2,) = ex2["rows"]
    assert row2["leaf_id"] == r2.id and row2["trajectory_id"] == 1
    rec2 = hitl.records[r2.id]
    assert rec2.parent is hitl.records[r1.id]  # concat on the already exported parent: tokens extend it
    assert row2["tokens"][:len(row1["tokens"])] == row1["tokens"]
    assert sum(row2["loss_mask"]) == rec2.response.output_len  # the exported parent's turn is context here


def test_a_child_that_does_not_extend_its_parent_masks_the_parent_and_counts_a_warning():
    from rollout.proxy.export import concat_rows
    from rollout.proxy.sessions import Session
    from rollout.types import ModelResponse

    s = Session("w-0", "k", task_id="w", group_id="w")
    a = s.begin([SYS, USER], concat=True)
    s.complete(a, ModelResponse(input_tokens=[1, 2, 3], output_tokens=[7, 8], output_logprobs=[-0.1, -0.2]), "a")
    b = s.begin([SYS, USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}], concat=True)
    # b's prompt was re-rendered (token 9 where a generated 7): a's tokens are not in b's row
    s.complete(b, ModelResponse(input_tokens=[1, 2, 3, 9, 8, 4], output_tokens=[5], output_logprobs=[-0.3]), "b")
    assert b.parent is a
    s.set_reward(reward=1.0)
    (row,) = concat_rows("w-0", "w", 0, list(s.records.values()), discount=1.0, token_rewards=None)
    assert row.masked_turns == 1 and row.tokens.tolist() == [1, 2, 3, 9, 8, 4, 5]
    assert row.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1] and row.turn_ids.tolist() == [-1] * 6 + [1]


def test_two_upstreams_sticky_sessions_and_one_selected_trajectory():
    """``--upstream`` twice: concurrent sessions spread over both, each session's turns stay on its
    server (its prefix cache); ``trajectory_id`` exports one ready trajectory and leaves the other."""
    from rollout.client import ClientConfig
    from rollout.proxy import ProxyConfig, ProxyServer
    from rollout.testing import ScriptedServer, ServerScript, fixed_text_policy, make_test_tokenizer

    tok = make_test_tokenizer()
    scripts = [ServerScript(policy=fixed_text_policy(tok, "```Left```"), delay_s=0.1, record_prompts=True)
               for _ in range(2)]

    async def go():
        with ScriptedServer(scripts[0], tok) as a, ScriptedServer(scripts[1], tok) as b:
            cfg = ProxyConfig(upstream=ClientConfig(endpoints=(a.url, b.url), dialect="sglang"), admin_key=ADMIN,
                              default_max_tokens=8)
            async with await ProxyServer.start(cfg, tok) as srv:
                _, sessions = srv.proxy.start_session("two", group_size=2)

                async def chats(i, session, turns):
                    async with openai.AsyncOpenAI(base_url=srv.base_url, api_key=session.api_key,
                                                  max_retries=0) as client:
                        msgs = [SYS, {"role": "user", "content": f"Agent {i}. Map:\nP G"}]
                        for t in range(turns):
                            r = await client.chat.completions.create(model="m", messages=msgs)
                            msgs = [*msgs, r.choices[0].message.model_dump(), {"role": "user", "content": f"o{t}"}]

                await asyncio.gather(*(chats(i, s, 3) for i, s in enumerate(sessions)))
                s0 = sessions[0]
                first = srv.proxy.set_reward(s0, {"reward": 1.0})  # trajectory 0: the first episode
                await chats(0, s0, 1)  # trajectory 1: one more chat (a sibling of the first turn)
                srv.proxy.set_reward(s0, {"reward": 0.5})
                only_1 = await srv.proxy.export({"session_ids": [s0.id], "trajectory_id": 1, "remove_session": False})
                rest = await srv.proxy.export({"session_ids": [s0.id]})
                return sessions, first, only_1, rest

    sessions, first, only_1, rest = asyncio.run(go())
    assert [sc.requests for sc in scripts] in ([4, 3], [3, 4])  # one session per server (+1 turn of s0)
    for sc in scripts:  # sticky: every prompt a server saw extends its first one (one conversation)
        head = sc.prompts[0]
        assert all(p[:len(head)] == head for p in sc.prompts)
    assert scripts[0].prompts[0] != scripts[1].prompts[0]
    assert first["trajectory_id"] == 0
    assert [r.trajectory_id for r in only_1.rows] == [1] and only_1.rows[0].outcome_reward == 0.5
    assert [r.trajectory_id for r in rest.rows] == [0] and rest.rows[0].outcome_reward == 1.0
