"""PaTR with the real FrozenLakeProgressScorer as its branch scorer and export of PRMRunner rewards."""

import asyncio

import numpy as np
import pytest

fl = pytest.importorskip("scorers.frozenlake")
runner_mod = pytest.importorskip("scorers.runner")

from rollout.client import ClientConfig, GenerationClient, SamplingParams  # noqa: E402
from rollout.envs import FrozenLakeEnv, make_tasks  # noqa: E402
from rollout.export import export_groups  # noqa: E402
from rollout.testing import ServerScript, frozenlake_policy  # noqa: E402
from rollout.groups import TreeConfig  # noqa: E402
from rollout.tree import run_group  # noqa: E402


def test_patr_with_frozenlake_progress_scorer_and_prm_export(serve, tok, prompts):
    srv = serve(ServerScript(policy=frozenlake_policy(tok, p_good=0.5)))
    task = make_tasks(7, 1, 0, sizes=(5,), max_turns=10)[0][0]
    cfg = TreeConfig(strategy="patr", b0=4, k=2, max_turns=10, max_branches=8, sampling=SamplingParams(max_tokens=16))
    scorer = fl.FrozenLakeProgressScorer()

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(srv.url,), dialect="sglang")) as c:
            g = await run_group(task, env_factory=FrozenLakeEnv, client=c, prompts=prompts, config=cfg,
                                scorer=scorer)
        runner = runner_mod.PRMRunner({"enabled": True}, scorers=[scorer])
        sess = await runner.score_branches(g.tree)
        await runner.aclose()
        return g, sess

    g, sess = asyncio.run(go())
    assert g.stats.leaves == 8 and g.stats.checkpoints
    for c in g.stats.checkpoints:
        assert all(0.0 <= s <= 1.0 for s in c.scores)
    batch, meta = export_groups([g.with_process_rewards(sess.token_rewards)])
    proc = np.asarray(batch.process_rewards)
    mask = np.asarray(batch.loss_mask)
    assert np.all(proc[mask == 0] == 0)
    for m in meta:
        leaf = g.tree.get(m.leaf_id)
        s = leaf.model_response.input_len
        expected = sess.token_rewards[m.leaf_id][leaf.id]
        assert np.allclose(proc[m.row, s - 1:s - 1 + leaf.output_len], expected)
        if leaf.env_state["success"]:
            assert np.allclose(expected, 1.0)
