"""Trainer config: YAML + dotted overrides, typed conversion, validation errors that name the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxprm.train.config import ConfigError, TrainConfig, config_hash, dump_yaml, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_defaults_load_and_roundtrip(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.name == "tiny" and cfg.rollout.strategy == "flat" and not cfg.prm.active
    f = tmp_path / "c.yaml"
    f.write_text(dump_yaml(cfg))
    again = load_config(f)
    assert again == cfg and config_hash(again) == config_hash(cfg)


def _prm_tokenizer(tmp_path) -> str:
    """A real tokenizer.json for ``configs/patr_prm.yaml`` (it ships with a placeholder path)."""
    from rollout.testing import make_test_tokenizer

    f = tmp_path / "tokenizer.json"
    make_test_tokenizer().tokenizer.save(str(f))
    return f"rollout.branch_scorer.kwargs.tokenizer={f}"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_configs_load(path, tmp_path):
    overrides = []
    if path.name == "patr_prm.yaml":  # its scorer is built at load: the placeholder tokenizer path is refused
        with pytest.raises(ConfigError, match=r"rollout.branch_scorer.kwargs: scorers.PRMModelScorer could not be "
                                              r"built: ValueError: tokenizer='/path/to/prm/tokenizer.json'"):
            load_config(path)
        overrides = [_prm_tokenizer(tmp_path)]
    cfg = load_config(path, overrides)
    assert cfg.run_dir


def test_expected_example_configs_exist(tmp_path):
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "default_prm.yaml", "flat_grpo.yaml", "tree_random.yaml",
            "smollm2_frozenlake.yaml", "external_server.yaml", "sokoban.yaml", "smollm2_sokoban.yaml",
            "agent_sokoban.yaml"} <= names
    assert load_config(ROOT / "configs/default_prm.yaml").prm.active
    progress = load_config(ROOT / "configs/progress_prm.yaml")
    assert progress.prm.active and progress.prm.scorers[0].kwargs == {"mode": "delta"}
    assert load_config(ROOT / "configs/default.yaml").env.system_prompt == "compact"
    assert load_config(ROOT / "configs/smollm2_sokoban.yaml").env.system_prompt == "full"  # no warm start
    smollm2 = load_config(ROOT / "configs/smollm2_frozenlake.yaml")  # the CPU recipe: LoRA + SFT warm start
    assert smollm2.model.lora.rank > 0 and smollm2.warm_start.enabled and smollm2.env.system_prompt == "compact"
    judge = load_config(ROOT / "configs/patr_judge.yaml").rollout.branch_scorer
    assert judge.path == "scorers.LLMJudgeScorer" and judge.kwargs["judge_weight"] == 0.7
    prm = load_config(ROOT / "configs/patr_prm.yaml", [_prm_tokenizer(tmp_path)]).rollout.branch_scorer
    assert prm.path == "scorers.PRMModelScorer"


def test_overrides_parse_yaml_scalars():
    cfg = load_config(None, ["optimizer.lr=3e-4", "rollout.strategy=flat", "ppo.c_clip=3",
                             "ppo.eps_clip_higher=null", "server.urls=[http://a:1, http://b:2]",
                             "model.overrides={layers: 3}", "progress=false"])
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.rollout.strategy == "flat"
    assert cfg.ppo.c_clip == 3.0 and isinstance(cfg.ppo.c_clip, float)
    assert cfg.ppo.eps_clip_higher is None
    assert cfg.server.urls == ["http://a:1", "http://b:2"]
    assert cfg.model.overrides == {"layers": 3}
    assert cfg.progress is False


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"rollout": {"strategy": "tree_random", "b0": 2}, "steps": 7}))
    cfg = load_config(f, ["steps=9"])
    assert cfg.rollout.strategy == "tree_random" and cfg.rollout.b0 == 2 and cfg.steps == 9
    assert cfg.rollout.m == 2  # untouched defaults survive a partial section


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["rolout.strategy=flat"], "did you mean 'rollout'"),
        (["rollout.strategey=flat"], "did you mean 'strategy'"),
        (["rollout.strategy=patrr"], "allowed values: 'flat', 'tree_random', 'patr', 'arpo', 'dapo'; did you mean 'patr'"),
        (["optimizer.lr=-1"], "optimizer.lr"),
        (["optimizer.lr=abc"], "optimizer.lr: expected a number"),
        (["steps=1.5"], "steps: expected an integer"),
        (["progress=maybe"], "progress: expected true or false"),
        (["ppo.c_clip=0.5"], "ppo.c_clip"),
        (["mesh.data=-1", "mesh.fsdp=-1"], "mesh"),
        (["server.kind=external"], "server.urls"),
        (["advantage.adv_mean_level=token"], "advantage.adv_mean_level"),
        (["noequals"], "key.sub=value"),
        (["rollout.export=individual"], "rollout.export: got 'individual'; allowed values: 'concat'"),
        (["server.window_factor=1"], "server.window_factor"),
        (["server.batch_buckets=[]"], "server.batch_buckets"),
        (["ppo.packed_len_buckets=[0]"], "ppo.packed_len_buckets"),
        (["ppo.behave_cap=0"], "ppo.behave_cap"),
        (["ppo.target_kl=-0.1"], "ppo.target_kl"),
        (["ppo.behave_mode=clip"], "ppo.behave_mode: got 'clip'"),
        (["ppo.decoupled=true", "ppo.behave_mode=mask_sequence"], "mask_sequence needs rollout.export: concat"),
        # the sections the libraries declare and validate (rollout.groups.TreeParams / ARPOParams,
        # jaxprm.AdvantageParams), named by their full key
        (["rollout.alpha=-1"], "rollout.alpha: must be >= 0, got -1"),
        (["rollout.strategy=patr", "rollout.m=1"], "rollout.m: an expansion needs at least 2 children"),
        (["rollout.theta=1"], "rollout.theta: must be >= 2 or null"),
        (["rollout.strategy=patr", "rollout.b0=9"], "rollout.max_branches: the branch budget (8) must be >= b0 (9)"),
        (["rollout.arpo.beam_size=1"], "rollout.arpo.beam_size: must be >= 2"),
        (["rollout.arpo.top_logprobs=21"], "rollout.arpo.top_logprobs: must be in [1, 20]"),
        (["rollout.keep=best"], "rollout.keep: got 'best'; allowed values: 'keep_all', 'best_n'"),
        (["advantage.gamma=2"], "advantage.gamma: must be in [0, 1], got 2"),
        (["advantage.reward_clip=0"], "advantage.reward_clip: must be a finite number > 0"),
        (["advantage.gae_method=fast"], "advantage.gae_method: got 'fast'; allowed values: 'auto', 'scan'"),
        # the client's and the engine's own checks (rollout.ClientConfig / jaxprm.serve.ServeConfig),
        # named by the server section's keys
        (["server.concurrency=0"], "server.concurrency: must be >= 1, got 0"),
        (["server.timeout_s=0"], "server.timeout_s: must be > 0"),
        (["server.max_retries=-1"], "server.max_retries: must be >= 0"),
        (["server.max_batch=0"], "server.max_batch: must be >= 1"),
        (["server.max_prefill_tokens=32"], "server.max_prefill_tokens: must be >= prefill_chunk (64), got 32"),
        (["server.kind=external", "server.urls=[http://a:1, ftp://b]"], "server.urls[1]: must start with http://"),
        (["server.batch_window_ms=-1"], "server.batch_window_ms: must be >= 0"),
        (["server.warn_behavior_kl=2"], "server.warn_behavior_kl: must be <= max_behavior_kl (1.0)"),
        # the environment and what must match it
        (["env.name=soko"], "env.name: got 'soko'; allowed values: 'frozenlake', 'sokoban'"),
        (["env.name=sokoban"], "env.size: a Sokoban room is 5 to 10 cells a side, got 4"),
        (["env.name=sokoban", "env.size=5", "env.boxes=4"], "env.boxes: must be in [1, 3]"),
        (["env.name=sokoban", "env.size=5", "rollout.strategy=patr"], "rollout.branch_scorer.path: scorers.FrozenLakeProgressScorer reads "
                                                                       "frozenlake states, but env.name is sokoban"),
        (["env.name=sokoban", "env.size=5", "rollout.strategy=flat", "prm.enabled=true", "rollout.export=concat",
          "prm.scorers=[{path: scorers.FrozenLakeProgressScorer}]"], "prm.scorers[0].path: scorers.FrozenLakeProgressScorer"),
        (["rollout.source=agent", "rollout.strategy=flat", "advantage.estimator=leaf_grpo", "agent.workflow=rollout.agents.grid_chat:run",
          "agent.kwargs={env: sokoban}"], "agent.workflow: rollout.agents.grid_chat:run plays sokoban, but env.name is frozenlake"),
        (["token_budget=0"], "token_budget: must be > 0"),
        (["eval.token_fractions=[0.5]"], "eval.token_fractions: needs token_budget"),
        (["token_budget=100", "eval.token_fractions=[0.5, 1.5]"], "eval.token_fractions: must be a non-empty list"),
        # tree credit
        (["advantage.estimator=tree"], "advantage.estimator: got 'tree'; allowed values: 'leaf_grpo', 'tree_value', "
                                       "'sibling', 'anchor_state'; did you mean 'tree_value'?"),
        (["advantage.anchor_gamma=1.5"], "advantage.anchor_gamma: must be in [0, 1]"),
        (["advantage.anchor_weight=-1"], "advantage.anchor_weight: must be a finite number >= 0"),
        (["rollout.source=agent", "rollout.strategy=flat", "advantage.estimator=anchor_state"],
         "advantage.estimator: rollout.source 'agent' exports rows without their turns' tree"),
    ],
)
def test_bad_values_name_the_key(overrides, fragment):
    with pytest.raises(ConfigError, match=None) as ei:
        load_config(None, overrides)
    assert fragment in str(ei.value)


def test_typo_in_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optimizer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="optimizer.learning_rate"):
        load_config(f)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


PRM_ON = ["prm.enabled=true", "prm.scorers=[{path: scorers.LengthBudgetScorer, kwargs: {max_output_tokens: 8}}]"]


@pytest.mark.parametrize(
    "extra, key",
    [
        (["advantage.token_rewards_as_adv=false"], "advantage.token_rewards_as_adv"),
        (["rollout.export=individual"], "rollout.export"),
        (["server.token_backed=false"], "server.token_backed"),
        (["prm.advantage_shaping.mode=process_weighted", "advantage.mask_no_eos_with_zero=true"],
         "advantage.mask_no_eos_with_zero"),
        (["prm.advantage_shaping.zero_penalty=-1"], "prm.advantage_shaping.zero_penalty"),
        (["prm.advantage_shaping.negative_scale=.inf"], "prm.advantage_shaping.negative_scale"),
    ],
)
def test_process_reward_rules(extra, key):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [*PRM_ON, *extra])
    assert key in str(ei.value)


def test_inactive_prm_relaxes_rules():
    # enabled: false or an empty scorer list disables scoring, and with it the PRM-only rules
    load_config(None, ["prm.enabled=false", "advantage.token_rewards_as_adv=false"])
    load_config(None, ["prm.enabled=true", "prm.scorers=[]", "server.token_backed=false"])
    cfg = load_config(None, [*PRM_ON, "prm.advantage_shaping.mode=gvpo"])
    assert cfg.prm.active and cfg.prm.scorers[0].kwargs == {"max_output_tokens": 8}


def test_cli_print_config_and_typo():
    env_py = sys.executable
    out = subprocess.run([env_py, "-m", "jaxprm.train", "--print-config", "rollout.strategy=flat"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["rollout"]["strategy"] == "flat"
    bad = subprocess.run([env_py, "-m", "jaxprm.train", "--print-config", "optimzer.lr=1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "did you mean 'optimizer'" in bad.stderr


def test_env_default_is_gymnasium_layout():
    from rollout.envs.frozenlake import make_tasks

    e = load_config().env
    assert e.random_start_goal is False
    train, _ = make_tasks(e.seed, 4, 0, sizes=(e.size,), p_frozen=e.p, random_start_goal=e.random_start_goal)
    assert all(t.desc[0][0] == "S" and t.desc[-1][-1] == "G" for t in train)
    assert load_config(None, ["env.random_start_goal=true"]).env.random_start_goal is True


def test_a_library_section_is_declared_once_and_composed():
    """The rollout and advantage sections are the libraries' configs (inherited, not mirrored):
    the same defaults, and the trainer's tree and advantage configs carry every field over."""
    import dataclasses

    import jaxprm
    from jaxprm.train import adapters
    from rollout.groups import TreeConfig, TreeParams

    cfg = load_config(None, ["rollout.alpha=0.08", "rollout.keep=best_n", "rollout.arpo.entropy_weight=0.3",
                             "rollout.theta_at=checkpoint", "advantage.gae_method=cumsum", "advantage.kl_ctl=0.01"])
    assert isinstance(cfg.rollout, TreeParams) and isinstance(cfg.advantage, jaxprm.AdvantageParams)
    for f in dataclasses.fields(TreeParams):
        assert getattr(TrainConfig().rollout, f.name) == getattr(TreeParams(), f.name), f.name
    tree = adapters.tree_config(cfg, max_context=None)
    assert isinstance(tree, TreeConfig)
    assert all(getattr(tree, f.name) == getattr(cfg.rollout, f.name) for f in dataclasses.fields(TreeParams))
    adv = adapters.advantage_config(cfg)
    assert all(getattr(adv, f.name) == getattr(cfg.advantage, f.name)
               for f in dataclasses.fields(jaxprm.AdvantageParams))
    # the one default the trainer changes, on purpose: GRPO groups are normalized
    assert TrainConfig().advantage.group_reward_norm and not jaxprm.AdvantageConfig().group_reward_norm
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.alpha = 0.5


def test_the_server_section_builds_the_client_and_engine_configs():
    """``server`` keys reach ``ClientConfig`` and ``ServeConfig`` under their library names, once."""
    s = load_config(None, ["server.concurrency=7", "server.model_name=m", "server.token_backed=false",
                           "server.timeout_s=9", "server.max_retries=2", "server.dialect=sglang",
                           "server.batch_window_ms=20", "server.prefill_chunk=128", "server.max_prefill_tokens=512",
                           "server.window_factor=2", "server.max_batch=16"]).server
    c = s.client_config(["http://a:1/"], api_key="k")
    assert (c.endpoints, c.max_concurrency, c.model, c.require_tokens, c.timeout_s, c.max_retries, c.dialect,
            c.api_key) == (("http://a:1",), 7, "m", False, 9, 2, "sglang", "k")
    v = s.serve_config(api_key="k")
    assert (v.collect_window_s, v.prefill_chunk, v.max_prefill_tokens, v.window_factor, v.max_batch, v.api_key,
            v.model_name) == (0.02, 128, 512, 2, 16, "k", "jaxprm")


def test_env_name_allows_exactly_the_registered_games():
    import typing

    from jaxprm.train.config import EnvConfig
    from rollout.envs import ENV_NAMES

    assert typing.get_args(typing.get_type_hints(EnvConfig)["name"]) == ENV_NAMES
