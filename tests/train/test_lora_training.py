"""LoRA in the trainer (``model.lora``): the embedded server serves the merged weights exactly (its
greedy tokens equal the LoRA forward's, and every train row's ``behavior_kl`` is ~0), checkpoints and
the optimizer state hold only adapters, ``--resume`` restores them, and the exported model is the
merged plain model."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprm.models import load_model
from jaxprm.train.config import ConfigError, load_config
from jaxprm.train.generation import Generation
from jaxprm.train.loop import train
from jaxprm.train.resume import latest_config_file
from jaxprm.train.rundir import Checkpointer, read_metrics
from jaxprm.train.setup import load_policy
from rollout.dialects import SamplingParams

TINY = ["env.train_tasks=16", "env.eval_tasks=2", "eval.num_tasks=2", "eval.samples=2", "eval.at_start=false",
        "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.b0=2", "rollout.top_k=1", "rollout.strategy=flat",
        "warm_start.enabled=false", "progress=false", "plots=false", "model.lora.rank=4", "model.lora.alpha=8"]


def _greedy(policy, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with the learner's LoRA forward (the whole sequence re-run per token)."""
    tokens = list(prompt)
    for _ in range(n):
        ids = jnp.asarray([tokens], jnp.int32)
        logits = policy.apply_fn(policy.params, ids, jnp.arange(len(tokens))[None])
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens[len(prompt):]


def test_the_server_greedy_tokens_equal_the_lora_forward(tmp_path):
    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}"])
    policy = load_policy(cfg)
    assert policy.is_lora
    # trained-looking adapters: b != 0, so the merge matters
    policy.params = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.key(x.size), x.shape, x.dtype),
                                 policy.params)
    gen = Generation(cfg, policy, tmp_path, lambda _m: None)
    prompt = [3, 17, 9, 4, 22, 8]

    async def serve():
        await gen.start()
        try:
            await gen.sync(1)
            out = await gen.client.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
            return [int(t) for t in out.response.output_tokens]
        finally:
            await gen.aclose()

    served = asyncio.run(serve())
    assert len(served) == 12 and served == _greedy(policy, prompt, 12)


@pytest.mark.slow
def test_a_lora_run_checkpoints_adapters_resumes_and_exports_merged(tmp_path):
    run = tmp_path / "run"
    # an entropy bonus: a gradient even when a random policy's groups all fail (zero advantages)
    cfg = load_config(None, [*TINY, "steps=2", "checkpoint.every_steps=1", "ppo.entropy_coef=0.05", f"run_dir={run}"])
    train(cfg, log=lambda _m: None)
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["behavior_kl"]) < 1e-5 for r in rows), [r["behavior_kl"] for r in rows]
    assert all(r["grad_norm"] > 0 for r in rows)  # the adapters did move

    ckpt = Checkpointer(run / "checkpoints")
    shapes = ckpt.saved_shapes(2)
    # params and optimizer moments: adapters only (the rest are counters and the RNG)
    assert sorted(p for p in shapes if "lora" not in p) == [
        "rng", "train.opt_state.1.0.count", "train.opt_state.1.2.count", "train.step"]

    # resume: steps 1..3 exactly once, the restored adapters served (behavior_kl ~0 at step 3)
    cfg3 = load_config(latest_config_file(run), ["steps=3"])
    train(cfg3, resume=True, log=lambda _m: None)
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3] and abs(rows[-1]["behavior_kl"]) < 1e-5

    # the export is the plain model with the adapters merged: its logits are the LoRA forward's
    exported, _ = load_model(str(run / "policy"))
    assert exported.layers.lora is None
    policy = load_policy(cfg3)
    restored = jax.tree.map(jnp.asarray, _saved_state(ckpt, 3)["train"]["params"])
    assert jax.tree.structure(restored) == jax.tree.structure(policy.params)
    base = policy.base["layers"]
    assert not np.array_equal(exported.layers.q_proj[...], base["q_proj"])  # trained adapters, merged
    np.testing.assert_array_equal(exported.embed[...], policy.base["embed"])  # untargeted: the base's own
    tokens = jnp.asarray([[3, 17, 9, 4, 22, 8]], jnp.int32)
    pos = jnp.arange(6)[None]
    np.testing.assert_allclose(exported(tokens, pos)[0], policy.apply_fn(restored, tokens, pos), rtol=1e-5, atol=1e-5)


def _saved_state(ckpt: Checkpointer, step: int) -> dict:
    """A checkpoint's arrays as saved (nested dicts), without a target to restore into."""
    import orbax.checkpoint as ocp

    out = ckpt.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return out["state"]


def test_lora_config_is_checked_and_frozen_on_resume(tmp_path):
    cfg = load_config(None, ["model.lora.rank=8", "model.lora.targets=[q_proj,v_proj]"])
    assert cfg.model.lora.enabled and cfg.model.lora.scale == 4.0 and cfg.model.lora.targets == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match="model.lora.targets"):
        load_config(None, ["model.lora.rank=8", "model.lora.targets=[qkv]"])
    with pytest.raises(ConfigError, match="model.lora.rank"):
        load_config(None, ["model.lora.rank=-2"])
