"""The config's cross-field rules, command-line overrides typed by their field, the engine-dependent vLLM section,
and the one spelling of the run directory; all on configs in memory or in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from buffer.config import (
    VERIFIERS_REWARD,
    ConfigError,
    ShardRLConfig,
    apply_overrides,
    coerce,
    flatten,
    load_run_config,
    load_toml,
    reference_markdown,
    refuse_sections,
    resolve_dtype,
    split_overrides,
    validate,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "shardrl" / "configs" / "demo.toml"
TOMLS = [DEMO, *sorted((ROOT / "deploy" / "configs").glob("*.toml"))]


def config(**dotted: Any) -> dict[str, Any]:
    """A config as TOML data: a reward plus ``dotted`` keys (``rollout__sampling__n=4``)."""
    data: dict[str, Any] = {"reward": {"function": "max_digit"}}
    for key, value in dotted.items():
        node = data
        *parents, leaf = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        validate(data, "cfg.toml")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------------------ the rules


def test_defaults_and_shipped_configs_pass_every_rule() -> None:
    validate(config(), "defaults")
    for path in TOMLS:
        load_toml(path)


def test_a_backlog_that_cannot_fill_a_step_is_refused_with_the_exact_line() -> None:
    deadlock = config(
        rollout__max_backlog_samples=64,
        rollout__prompts_per_batch=4,
        rollout__sampling__n=8,
        trainer__samples_per_step=256,
    )
    assert refused(deadlock) == (
        "cfg.toml: rollout.max_backlog_samples (64) + one worker batch (rollout.prompts_per_batch x "
        "rollout.sampling.n = 32) must reach trainer.samples_per_step (256), or workers pause before a step can fill"
    )
    deadlock["rollout"]["max_backlog_samples"] = 224  # 224 + 32 = 256: one worker fills the step exactly
    validate(deadlock, "cfg.toml")


@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_group_algorithms_take_whole_groups(name: str) -> None:
    msg = refused(config(algorithm__name=name, rollout__sampling__n=8, trainer__samples_per_step=100))
    assert msg == (
        f"cfg.toml: trainer.samples_per_step (100) must be a multiple of rollout.sampling.n (8) with "
        f"algorithm.name = '{name}': a step takes whole groups, so it would train on 104 samples"
    )
    validate(config(algorithm__name=name, rollout__sampling__n=8, trainer__samples_per_step=104), "ok")


def test_ppo_has_no_groups() -> None:
    validate(config(algorithm__name="ppo", rollout__sampling__n=8, trainer__samples_per_step=100), "ok")


def test_workers_may_not_be_staler_than_the_trainer_drops() -> None:
    msg = refused(config(rollout__max_staleness=3, trainer__max_staleness=2))
    assert msg == (
        "cfg.toml: rollout.max_staleness (3) must not exceed trainer.max_staleness (2) with "
        "algorithm.staleness_mode = 'drop': workers would produce samples the trainer drops"
    )
    keep = {"staleness_mode": "keep", "off_policy": "tis"}
    validate(config(rollout__max_staleness=3, trainer__max_staleness=2, algorithm=keep), "ok")


def test_kept_stale_samples_need_a_correction() -> None:
    msg = refused(config(algorithm={"staleness_mode": "keep", "off_policy": "none"}))
    assert "algorithm.staleness_mode = 'keep' needs algorithm.off_policy = 'tis' or 'decoupled'" in msg


def test_prompt_and_response_must_fit_the_engine_context() -> None:
    msg = refused(
        config(
            data__max_prompt_length=48,
            rollout__sampling__max_response_length=32,
            rollout__vllm__max_model_len=64,
        )
    )
    assert msg.startswith(
        "cfg.toml: data.max_prompt_length (48) + rollout.sampling.max_response_length (32) = 80 must fit "
        "rollout.vllm.max_model_len (64)"
    )
    ok = validate(config(data__max_prompt_length=32, rollout__sampling__max_response_length=32), "ok")
    assert ok.context_length() == 64  # no max_model_len: the prompt + response budget, for vllm and hf alike
    hf = validate(config(rollout__engine="hf", data__max_prompt_length=30), "ok")
    assert hf.context_length() == 30 + 1024


def test_kl_as_a_reward_needs_token_rewards() -> None:
    msg = refused(config(algorithm={"name": "grpo", "kl_coef": 0.1, "kl_mode": "reward"}))
    assert "kl_mode" in msg
    validate(config(algorithm={"name": "ppo", "kl_coef": 0.1, "kl_mode": "reward"}), "ok")


def test_initial_workers_within_the_bound() -> None:
    assert refused(config(run__initial_workers=5, run__max_workers=4)) == (
        "cfg.toml: run.initial_workers (5) must not exceed run.max_workers (4)"
    )


def test_several_broken_rules_are_still_one_line() -> None:
    msg = refused(config(run__initial_workers=5, run__max_workers=4, rollout__max_staleness=9))
    assert msg.endswith("(and 1 more)")


def verifiers_config(**dotted: Any) -> dict[str, Any]:
    """A run of a verifiers environment: no reward section, the environment's tasks as prompts."""
    data = config(**{"data__task": "env", "env__verifiers": "my_taskset", **dotted})
    if data["reward"] == {"function": "max_digit"}:
        del data["reward"]
    return data


def test_data_task_env_and_env_verifiers_go_together() -> None:
    assert refused(config(data__task="env")) == (
        "cfg.toml: data.task = 'env' needs env.verifiers: the prompts are the tasks of the environment it names"
    )
    assert refused(verifiers_config(data__task="max_digit")) == (
        "cfg.toml: env.verifiers ('my_taskset') needs data.task = 'env' (not 'max_digit'): its tasks are the prompts"
    )


def test_env_verifiers_is_exclusive_with_tools_and_agent() -> None:
    line = (
        "cfg.toml: field env: Value error, env.verifiers is exclusive with env.agent and env.tools: the environment "
        "runs its own agent and tools; set one of them"
    )
    assert refused(verifiers_config(env__agent="pkg.mod:agent")) == line
    assert refused(verifiers_config(env__tools=["pkg.mod:tool"])) == line


def test_a_verifiers_run_is_scored_by_its_rubric_alone(tmp_path: Path) -> None:
    args = {"taskset": {"num_tasks": 100}, "agent": {"runtime": {"type": "subprocess"}}}
    cfg = validate(verifiers_config(env__verifiers_args=args, env__verifiers_max_tasks=100), "cfg.toml")
    assert cfg.reward.function == VERIFIERS_REWARD and cfg.env.verifiers_args == args
    path = tmp_path / "config.json"  # the resolved config reopens as it was written
    path.write_text(cfg.model_dump_json())
    assert load_run_config(path) == cfg
    assert refused(verifiers_config(reward={"function": "exact_match"})) == (
        "cfg.toml: reward.function ('exact_match') is not used with env.verifiers ('my_taskset'): the "
        "environment's rubric scores every episode; leave reward.function unset"
    )
    assert "is the rubric of env.verifiers, which is not set" in refused(
        config(reward__function=VERIFIERS_REWARD)
    )
    assert "field env.verifiers_max_tasks: Input should be greater than or equal to 1" in refused(
        verifiers_config(env__verifiers_max_tasks=0)
    )
    assert "'pkg.mod:' is neither a taskset id nor `package.module:function`" in refused(
        verifiers_config(env__verifiers="pkg.mod:")
    )


def test_every_process_start_checks_the_rules_again(tmp_path: Path) -> None:
    """A config.json edited by hand after `shardrl init` is refused when a process opens the run."""
    path = tmp_path / "config.json"
    data = validate(config(), "ok").model_dump(mode="json")
    data["trainer"]["samples_per_step"] = 100_000
    path.write_text(json.dumps(data))
    with pytest.raises(
        ConfigError, match=r"config.json \+ command line: rollout.max_backlog_samples \(4096\)"
    ):
        load_run_config(path)


# ------------------------------------------------------------------------------------------------- the engine


def test_vllm_settings_only_with_a_vllm_engine(tmp_path: Path) -> None:
    assert refused(config(rollout__engine="hf", rollout__vllm__max_model_len=2048)) == (
        "cfg.toml: rollout.vllm is set but rollout.engine is 'hf', which does not use it: remove the "
        "[rollout.vllm] section or set rollout.engine = 'vllm' or 'auto'"
    )
    assert validate(config(rollout__engine="hf"), "ok").rollout.vllm is None
    for engine in ("vllm", "auto"):
        vllm = validate(config(rollout__engine=engine), "ok").rollout.vllm
        assert vllm is not None and vllm.enforce_eager is False  # real-run default: CUDA graphs on


def test_engine_hf_on_the_command_line_replaces_the_files_vllm_section(tmp_path: Path) -> None:
    cfg = load_toml(DEMO, {"rollout.engine": "hf"})  # demo.toml has a [rollout.vllm] section
    assert cfg.rollout.engine == "hf" and cfg.rollout.vllm is None
    with pytest.raises(ConfigError, match=r"rollout\.vllm is set"):
        load_toml(DEMO, {"rollout.engine": "hf", "rollout.vllm.max_model_len": "64"})


def test_engine_is_a_per_process_override_in_both_directions(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(load_toml(DEMO).model_dump_json())
    hf = load_run_config(path, {"rollout.engine": "hf"})
    assert hf.rollout.vllm is None and hf.context_length() == 32 + 1
    path.write_text(hf.model_dump_json())  # an hf run: "vllm": null in config.json
    vllm = load_run_config(path, {"rollout.engine": "vllm"})
    assert vllm.rollout.vllm is not None and vllm.rollout.vllm.max_model_len is None
    with pytest.raises(ConfigError, match="run-wide"):
        load_run_config(path, {"rollout.vllm.max_model_len": "64", "rollout.engine": "vllm"})


# ---------------------------------------------------------------------------------------------- the overrides


def test_overrides_are_typed_by_their_field() -> None:
    assert coerce("model.tokenizer", "2024") == "2024"
    assert coerce("model.tokenizer", "null") is None
    assert coerce("reward.function", "1e3") == "1e3"
    assert coerce("trainer.lr", "1e-6") == 1e-6
    assert coerce("trainer.samples_per_step", "64") == 64
    assert coerce("trainer.tensorboard", "false") is False
    assert coerce("trainer.betas", "[0.9, 0.95]") == [0.9, 0.95]
    assert coerce("trainer.step_wait_timeout_s", "null") is None
    assert coerce("rollout.sampling.stop", '["</answer>"]') == ["</answer>"]
    assert coerce("rollout.engine", "hf") == "hf"
    assert coerce("algorithm.clip_low", "0.1") == 0.1  # a field of the algorithm variants
    assert coerce("algorithm.name", "ppo") == "ppo"


def test_typed_overrides_reach_the_config() -> None:
    overrides = {"model.tokenizer": "2024", "trainer.lr": "1e-6", "trainer.betas": "[0.9, 0.95]"}
    cfg = validate(apply_overrides(config(), overrides), "cmd")
    assert cfg.model.tokenizer == "2024" and cfg.trainer.lr == 1e-6 and cfg.trainer.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match=r"^cmd: field trainer.lr: Input should be a valid number"):
        validate(apply_overrides(config(), {"trainer.lr": "fast"}), "cmd")


def test_a_bad_override_value_names_the_flag_not_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_toml(DEMO, {"trainer.lr": "abc"})
    assert str(e.value).startswith("command line: --trainer.lr abc: Input should be a valid number")
    with pytest.raises(ConfigError, match=r"^command line: --algorithm.clip_low x: "):
        load_toml(DEMO, {"algorithm.clip_low": "x"})  # a key of the algorithm variants
    path = tmp_path / "config.json"
    path.write_text(load_toml(DEMO).model_dump_json())
    with pytest.raises(ConfigError, match=r"config.json \+ command line: --rollout.cpu_workers zero: "):
        load_run_config(path, {"rollout.cpu_workers": "zero"})


def test_an_unreadable_config_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[model]\n")
    for name, says in (("dir.toml", "cannot read the config file"), ("bin.toml", "not UTF-8")):
        with pytest.raises(ConfigError, match=f"^{tmp_path / name}: {says}"):
            load_toml(tmp_path / name)


def test_overrides_are_split_from_positionals_wherever_they_stand() -> None:
    argv = ["init", "--config", "c.toml", "--trainer.lr", "0.5", "RUN", "--rollout.engine=hf"]
    overrides, rest = split_overrides(argv)
    assert overrides == {"trainer.lr": "0.5", "rollout.engine": "hf"}
    assert rest == ["init", "--config", "c.toml", "RUN"]
    with pytest.raises(ConfigError, match="needs a value"):
        split_overrides(["--trainer.lr"])


def test_a_process_refuses_the_other_processs_section() -> None:
    refuse_sections({"rollout.engine": "hf"}, ("trainer",), "shardrl-rollout", "hint")
    with pytest.raises(ConfigError, match=r"^command line: --trainer.max_steps is a trainer setting"):
        refuse_sections({"trainer.max_steps": "3"}, ("trainer",), "shardrl-rollout", "hint")


def test_rollout_supervisor_refuses_trainer_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from rollout_worker.__main__ import main

    assert main(["--run-dir", str(tmp_path), "--trainer.max_steps", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--trainer.max_steps is a trainer setting" in err


# ------------------------------------------------------------------------------------------- defaults, dtype, docs


def test_library_defaults_are_for_real_runs_and_the_demo_sets_its_own() -> None:
    with pytest.raises(ConfigError, match="reward"):
        validate({}, "cfg.toml")  # no reward named
    d = validate(config(), "defaults")
    assert (d.model.dtype, d.rollout.sampling.max_response_length) == ("auto", 1024)
    demo = tomllib_flat(DEMO)
    for key in ("model.dtype", "reward.function", "data.task", "rollout.sampling.max_response_length"):
        assert key in demo, f"demo.toml must set {key} itself"
    assert demo["rollout.vllm.enforce_eager"] is True


def tomllib_flat(path: Path) -> dict[str, Any]:
    import tomllib

    return flatten(tomllib.loads(path.read_text()))


def test_auto_dtype_follows_the_device() -> None:
    assert resolve_dtype("auto", cuda=True) == "bfloat16"
    assert resolve_dtype("auto", cuda=False) == "float32"
    assert resolve_dtype("float16", cuda=True) == "float16"


def test_reference_lists_per_process_settings_and_each_algorithm_variant() -> None:
    ref = reference_markdown()
    assert ref.startswith("Per-process settings") and "`trainer.max_steps`" in ref.splitlines()[0]
    assert '**[algorithm]** name = "ppo":' in ref and "`rollout.vllm.max_model_len`" in ref


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_toml(DEMO)
    assert ShardRLConfig.model_validate(json.loads(cfg.model_dump_json())) == cfg
