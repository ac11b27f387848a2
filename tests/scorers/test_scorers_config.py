"""PRMConfig parsing and the load-time validation rules."""

from __future__ import annotations

import math

import pytest
import yaml

from scorers import AdvantageShapingConfig, PRMConfig, ScorerSpec, validate_prm_config

SPEC_YAML = """
enabled: true
advantage_shaping:
  mode: process_weighted
scorers:
  - path: scorers.LengthBudgetScorer
    weight: 1.0
    kwargs:
      max_output_tokens: 128
"""

OK = dict(export_style="concat", token_backed=True, token_rewards_as_adv=True)


def test_yaml_round_trip():
    cfg = PRMConfig.from_dict(yaml.safe_load(SPEC_YAML))
    assert cfg.active
    assert cfg.scorers == (ScorerSpec(path="scorers.LengthBudgetScorer", weight=1.0, enabled=True, kwargs={"max_output_tokens": 128}),)
    assert cfg.advantage_shaping == AdvantageShapingConfig(mode="process_weighted")
    assert PRMConfig.from_dict(cfg.to_dict()) == cfg


def test_defaults_match_the_design():
    s = AdvantageShapingConfig()
    assert (s.mode, s.negative_scale, s.zero_penalty, s.zero_eps) == ("additive", 0.2, 0.4, 1e-6)
    assert PRMConfig.from_dict(None).active is False


@pytest.mark.parametrize(
    "data",
    [
        {"enabled": False, "scorers": [{"path": "scorers.LengthBudgetScorer"}]},
        {"enabled": True, "scorers": []},
        {"enabled": True, "scorers": None},
        {"enabled": True, "scorers": [{"path": "scorers.LengthBudgetScorer", "enabled": False}]},
    ],
)
def test_empty_list_or_disabled_means_inactive_and_skips_pipeline_checks(data):
    cfg = PRMConfig.from_dict(data)
    assert not cfg.active
    # Nothing else is required when scoring is off.
    out = validate_prm_config(
        cfg, export_style="individual", token_backed=False, token_rewards_as_adv=False,
        mask_no_eos_with_zero=True, external_string_backend=True,
    )
    assert out == cfg


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"enable": True}, r"prm: unknown keys \['enable'\]"),
        ({"scorers": [{"path": "x.Y", "wieght": 1}]}, r"prm.scorers\[0\]: unknown keys \['wieght'\]"),
        ({"scorers": [{"weight": 1}]}, r"prm.scorers\[0\].path is required"),
        ({"scorers": [{"path": ""}]}, "path"),
        ({"scorers": [{"path": "x.Y", "weight": math.nan}]}, "finite"),
        ({"advantage_shaping": {"mode": "multiplicative"}}, r"mode='multiplicative'; allowed: \('additive', 'gvpo', 'process_weighted'\)"),
        ({"advantage_shaping": {"negative_scale": -0.1}}, r"negative_scale=-0.1 must be finite and >= 0"),
        ({"advantage_shaping": {"zero_penalty": math.inf}}, r"zero_penalty=inf must be finite"),
        ({"advantage_shaping": {"zero_eps": math.nan}}, r"zero_eps=nan must be finite"),
        ({"advantage_shaping": {"zero_epsilon": 0.1}}, r"unknown keys \['zero_epsilon'\]"),
    ],
)
def test_bad_config_names_the_key(data, match):
    with pytest.raises((ValueError, TypeError), match=match):
        PRMConfig.from_dict(data)


def test_type_errors_name_the_key():
    with pytest.raises(TypeError, match="prm.enabled"):
        PRMConfig.from_dict({"enabled": "yes"})
    with pytest.raises(TypeError, match="prm.scorers"):
        PRMConfig.from_dict({"scorers": "scorers.LengthBudgetScorer"})
    with pytest.raises(TypeError, match=r"prm.advantage_shaping.negative_scale"):
        PRMConfig.from_dict({"advantage_shaping": {"negative_scale": "0.2"}})
    with pytest.raises(TypeError, match="kwargs"):
        PRMConfig.from_dict({"scorers": [{"path": "a.B", "kwargs": [1]}]})


ACTIVE = {"scorers": [{"path": "scorers.LengthBudgetScorer", "kwargs": {"max_output_tokens": 8}}]}


def test_active_config_passes_with_a_concat_token_backed_direct_pipeline():
    cfg = validate_prm_config(ACTIVE, **OK, mask_no_eos_with_zero=True, chat_template_type="concat")
    assert cfg.active


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"export_style": "individual"}, r"export_style='individual'.*allowed: 'concat'"),
        ({"chat_template_type": "hf"}, r"chat_template_type='hf'.*allowed: 'concat'"),
        ({"token_backed": False}, "token-backed"),
        ({"token_rewards_as_adv": False}, r"actor.token_rewards_as_adv=False.*allowed: true"),
        ({"external_string_backend": True}, "external string-only"),
    ],
)
def test_active_scorers_need_the_supported_pipeline(override, match):
    with pytest.raises(ValueError, match=match):
        validate_prm_config(ACTIVE, **{**OK, **override})


def test_process_weighted_refuses_mask_no_eos_with_zero():
    cfg = {**ACTIVE, "advantage_shaping": {"mode": "process_weighted"}}
    with pytest.raises(ValueError, match=r"mask_no_eos_with_zero=true.*process_weighted"):
        validate_prm_config(cfg, **OK, mask_no_eos_with_zero=True)
    assert validate_prm_config(cfg, **OK, mask_no_eos_with_zero=False).advantage_shaping.mode == "process_weighted"
    for mode in ("additive", "gvpo"):
        validate_prm_config({**ACTIVE, "advantage_shaping": {"mode": mode}}, **OK, mask_no_eos_with_zero=True)
