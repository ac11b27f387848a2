"""The rollout client and tree builder against the embedded jaxprm server (tiny random model).

Checks the wire contract end to end: both dialects return token-backed turns whose ids and logprobs
the export reproduces exactly, and multi-turn prompts extend each other without drift; the top
logprobs the client asks for come back as per-token entropies (ARPO's branching signal).
"""

import asyncio

import numpy as np
import pytest

serve = pytest.importorskip("jaxprm.serve")
models = pytest.importorskip("jaxprm.models")

from rollout.client import ClientConfig, GenerationClient, SamplingParams  # noqa: E402
from rollout.envs import FrozenLakeEnv, make_tasks  # noqa: E402
from rollout.export import export_groups  # noqa: E402
from rollout.groups import ARPOParams, TreeConfig  # noqa: E402
from rollout.tree import run_group  # noqa: E402


@pytest.fixture(scope="module")
def server():
    from jaxprm.serve.sampler import Sampler

    model, tok = models.load_model("tiny")
    sampler = Sampler(model, eos_token_ids=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                      batch_buckets=(1, 4), prompt_buckets=(512, 1024), new_token_buckets=(8,))
    with serve.ServerHandle.from_sampler(sampler, tok, api_key="k") as h:
        yield h, tok


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_flat_group_against_embedded_server(server, dialect):
    handle, tok = server
    task = make_tasks(0, 1, 0, sizes=(4,), max_turns=3)[0][0]
    cfg = TreeConfig(strategy="flat", group_size=2, max_turns=3, theta=None,
                     sampling=SamplingParams(max_tokens=8, temperature=1.0))

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(handle.url,), dialect=dialect, api_key="k",
                                                 timeout_s=120)) as c:
            return await run_group(task, env_factory=FrozenLakeEnv, client=c, prompts=tok, config=cfg, group_seed=1)

    g = asyncio.run(go())
    assert g.stats.leaves == 2 and g.stats.sampled_actions >= 2
    batch, meta = export_groups([g], row_buckets=(8,), len_buckets=(1024, 2048))
    lp = np.asarray(batch.old_logprobs)
    for m in meta:
        for it in g.tree.branch(m.leaf_id):
            r = it.model_response
            assert 0 < r.output_len <= 8 and np.all(r.output_logprobs <= 0)
            s = r.input_len
            assert np.array_equal(np.asarray(batch.tokens)[m.row, s:s + r.output_len], r.output_tokens)
            assert np.array_equal(lp[m.row, s - 1:s - 1 + r.output_len], r.output_logprobs)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_top_logprob_entropies_from_embedded_server(server, dialect):
    handle, tok = server
    n = 5
    prompt = tok.encode("Move to the goal.")

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(handle.url,), dialect=dialect, api_key="k",
                                                 timeout_s=120)) as c:
            with_top = await c.generate(prompt, SamplingParams(max_tokens=8, seed=3, top_logprobs=n))
            plain = await c.generate(prompt, SamplingParams(max_tokens=8, seed=3))
            return with_top, plain

    gen, plain = asyncio.run(go())
    h = np.asarray(gen.entropies)
    assert plain.entropies is None and h.shape == (gen.response.output_len,) and h.size > 0
    # vLLM's dict also lists the sampled token: at most n + 1 alternatives
    assert np.all(np.isfinite(h)) and np.all(h >= 0) and np.all(h <= np.log(n + 1) + 1e-9)
    assert np.array_equal(gen.response.output_tokens, plain.response.output_tokens)  # same seed, same sample


def test_arpo_group_against_embedded_server(server):
    handle, tok = server
    task = make_tasks(0, 1, 0, sizes=(4,), max_turns=3)[0][0]
    cfg = TreeConfig(strategy="arpo", b0=2, max_branches=4, max_turns=3, theta=None, arpo=ARPOParams(top_logprobs=5),
                     sampling=SamplingParams(max_tokens=8, temperature=1.0))

    async def go():
        async with GenerationClient(ClientConfig(endpoints=(handle.url,), api_key="k", timeout_s=120)) as c:
            return await run_group(task, env_factory=FrozenLakeEnv, client=c, prompts=tok, config=cfg, group_seed=1)

    g = asyncio.run(go())
    assert g.stats.leaves == 4 and g.stats.entropy_mean is not None and g.stats.entropy_mean >= 0
