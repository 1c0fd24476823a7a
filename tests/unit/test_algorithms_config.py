"""The `[algorithm]` section as a union on `name`: each algorithm has only its own keys, old configs still load, and
a key of another algorithm is refused in one line that names it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from buffer.config import (
    ALGORITHMS,
    AlgorithmConfig,
    ConfigError,
    GrpoConfig,
    PpoConfig,
    ReinforcePPConfig,
    RlooConfig,
    load_toml,
    reference_markdown,
    validate,
)

REPO = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {"reward": {"function": "max_digit"}}


def cfg(algorithm: dict[str, Any] | None = None, **sections: Any) -> Any:
    data = {**BASE, **sections}
    if algorithm is not None:
        data["algorithm"] = algorithm
    return validate(data, "run.toml")


def refused(algorithm: dict[str, Any], **sections: Any) -> str:
    with pytest.raises(ConfigError) as err:
        cfg(algorithm, **sections)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("run.toml: ")
    return msg


def test_grpo_is_the_default_with_or_without_a_name() -> None:
    assert isinstance(cfg().algorithm, GrpoConfig)
    a = cfg({"clip_low": 0.1, "norm_adv_by_std": False}).algorithm
    assert isinstance(a, GrpoConfig) and a.clip_low == 0.1 and a.norm_adv_by_std is False


@pytest.mark.parametrize(
    ("name", "model"),
    [("grpo", GrpoConfig), ("rloo", RlooConfig), ("reinforce_pp", ReinforcePPConfig), ("ppo", PpoConfig)],
)
def test_each_name_picks_its_model_and_round_trips_through_json(name: str, model: type) -> None:
    c = cfg({"name": name, "policy_loss": "gspo", "off_policy_level": "sequence", "loss_agg": "token-sum"})
    assert type(c.algorithm) is model and ALGORITHMS[name] is model
    again = validate(json.loads(json.dumps(c.model_dump(mode="json"))), "config.json")
    assert again == c and type(again.algorithm) is model


def test_gspo_has_no_dual_clip_unless_it_is_set() -> None:
    # GSPO (the paper, verl) clips the sequence ratio only; the token-level PPO default of 3.0 does not carry over.
    assert cfg({"policy_loss": "gspo"}).algorithm.dual_clip is None
    assert cfg({"name": "ppo", "policy_loss": "gspo"}).algorithm.dual_clip is None
    assert cfg({"policy_loss": "gspo", "dual_clip": 2.5}).algorithm.dual_clip == 2.5
    assert cfg({"policy_loss": "ppo"}).algorithm.dual_clip == 3.0 and cfg().algorithm.dual_clip == 3.0
    c = cfg({"policy_loss": "gspo"})
    again = validate(json.loads(json.dumps(c.model_dump(mode="json"))), "config.json")
    assert again.algorithm.dual_clip is None


def test_ppo_keeps_its_keys() -> None:
    a = cfg(
        {
            "name": "ppo",
            "gamma": 0.9,
            "lam": 0.8,
            "value_clip": 0.1,
            "value_coef": 0.3,
            "whiten_advantages": True,
        }
    )
    assert isinstance(a.algorithm, PpoConfig)
    assert (a.algorithm.gamma, a.algorithm.lam, a.algorithm.value_clip) == (0.9, 0.8, 0.1)


@pytest.mark.parametrize(
    ("algorithm", "key", "owner"),
    [
        ({"name": "grpo", "gamma": 0.9}, "gamma", "ppo"),
        ({"gamma": 1.0}, "gamma", "ppo"),  # even the old default: the key has no meaning for grpo
        ({"name": "rloo", "value_clip": 0.2}, "value_clip", "ppo"),
        ({"name": "reinforce_pp", "lam": 0.95}, "lam", "ppo"),
        ({"name": "ppo", "norm_adv_by_std": True}, "norm_adv_by_std", "grpo"),
    ],
)
def test_a_key_of_another_algorithm_is_refused_naming_it(algorithm: dict, key: str, owner: str) -> None:
    msg = refused(algorithm)
    assert "algorithm" in msg and key in msg and repr(owner) in msg


def test_unknown_keys_and_names_are_refused() -> None:
    assert "algorithm.grpo.gama" in refused({"name": "grpo", "gama": 1.0})
    msg = refused({"name": "a2c"})
    assert "'a2c'" in msg and all(repr(n) in msg for n in ALGORITHMS)


def test_rules_between_algorithm_keys() -> None:
    assert "kl_mode" in refused({"name": "grpo", "kl_coef": 0.1, "kl_mode": "reward"})
    assert "kl_mode" in refused({"name": "rloo", "kl_mode": "reward"})
    for name in ("ppo", "reinforce_pp"):
        assert cfg({"name": name, "kl_coef": 0.1, "kl_mode": "reward"}).algorithm.kl_mode == "reward"
    assert "kl_target needs kl_coef > 0" in refused({"kl_target": 0.05})
    assert "off_policy" in refused({"policy_loss": "gspo", "off_policy": "tis"})
    ok = cfg({"kl_coef": 0.1, "kl_target": 0.05, "kl_horizon": 256}, trainer={"samples_per_step": 256})
    assert ok.algorithm.kl_target == 0.05
    msg = refused({"kl_coef": 0.1, "kl_target": 0.05, "kl_horizon": 100}, trainer={"samples_per_step": 256})
    assert "algorithm.kl_horizon" in msg and "trainer.samples_per_step" in msg


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("shardrl/configs/demo.toml", "grpo"),
        ("deploy/configs/qwen2.5-1.5b-grpo.toml", "grpo"),
        ("deploy/configs/qwen2.5-7b-ppo.toml", "ppo"),
    ],
)
def test_the_repository_configs_still_load(path: str, name: str) -> None:
    assert load_toml(REPO / path).algorithm.name == name


def test_reference_has_every_algorithm_and_each_key_only_where_it_exists() -> None:
    text = reference_markdown()
    shared = _keys(_table(text, "**[algorithm]** " + (AlgorithmConfig.__doc__ or "").strip()))
    tables = {name: _table(text, f'**[algorithm]** name = "{name}":') for name in ALGORITHMS}
    for name, model in ALGORITHMS.items():
        keys = _keys(tables[name])
        # the keys every algorithm shares are listed once; each variant's table adds only its own
        assert keys | shared == set(model.model_fields), name
        assert not keys & shared and "name" in keys, name
    assert shared and all(shared <= set(m.model_fields) for m in ALGORITHMS.values())
    assert text.count("`algorithm.clip_low`") == 1
    assert set(AlgorithmConfig.model_fields) <= set(GrpoConfig.model_fields)


def _keys(rows: list[str]) -> set[str]:
    return {line.split("`")[1].removeprefix("algorithm.") for line in rows if line.startswith("| `")}


def _table(text: str, header: str) -> list[str]:
    """The rows of the reference table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("**["):
            break
        rows.append(line)
    return rows
