"""What a new user meets on a first run, without engines: config rules vLLM would enforce at start, the engine's root
cause out of a worker log, a status that says why, a second trainer that asks first, metrics with one row per step,
commands that behave alike, and typos answered with the closest key."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from buffer import heartbeats, metrics, status
from buffer.config import ConfigError, ShardRLConfig, load_run_config, load_toml, refuse_sections
from buffer.control import init_state
from buffer.records import TrainerStatus, write_record
from rollout_worker.engines.vllm import llm_kwargs, root_cause
from shardrl import cli
from shardrl.report import eval_label
from shardrl.status_view import render

from .buffer_helpers import make_layout

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "shardrl" / "configs" / "demo.toml"


# ---------------------------------------------------------------------------------------------- 1: vLLM on CPU


def test_token_budget_below_what_vllm_checks_at_start_is_refused_at_init() -> None:
    with pytest.raises(
        ConfigError, match=r"max_num_batched_tokens \(256\) must be at least rollout.vllm.max_num_seqs"
    ):
        load_toml(DEMO, {"rollout.vllm.max_num_batched_tokens": "256"})  # demo: max_num_seqs 512
    with pytest.raises(ConfigError, match=r"at least rollout.vllm.max_model_len \(64\).*chunked prefill"):
        load_toml(DEMO, {"rollout.vllm.max_num_batched_tokens": "48", "rollout.vllm.max_num_seqs": "16"})
    # the reproduction: a budget below one batch's prefill is fine without chunked prefill
    assert load_toml(DEMO, {"rollout.vllm.max_num_batched_tokens": "512"}).rollout.vllm is not None


def test_cpu_engine_runs_without_chunked_prefill() -> None:
    kwargs = llm_kwargs(Path("m"), dtype="float32", seed=0, max_model_len=64, options={}, cpu=True)
    assert kwargs["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in llm_kwargs(
        Path("m"), dtype="float32", seed=0, max_model_len=64, options={}
    )


WORKER_LOG = """\
=== 2026-12-01 19:05:41 w0 started by vm-3885
(Worker pid=4351) ERROR 12-01 19:06:39 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=4351) ERROR 12-01 19:06:39 [multiproc_executor.py:1063]     gen.set_offset(gen.get_offset() - 4)
(Worker pid=4351) ERROR 12-01 19:06:39 [multiproc_executor.py:1063] RuntimeError: CPU Generator does not use offset
(EngineCore pid=4319) ERROR 12-01 19:06:39 [core.py:1512]     raise RuntimeError(
(EngineCore pid=4319) ERROR 12-01 19:06:39 [core.py:1512] RuntimeError: Worker failed with error 'CPU Generator \
does not use offset', please check the stack trace above for the root cause
Traceback (most recent call last):
  File "/work/main/rollout_worker/worker.py", line 163, in serve
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
"""


def test_root_cause_is_the_first_exception_that_is_not_a_see_above_wrapper() -> None:
    assert root_cause(WORKER_LOG) == "RuntimeError: CPU Generator does not use offset"
    init_failure = (
        "  File \"x.py\", line 1, in <module>\nImportError: cannot import name 'x' from 'y'\n"
        "Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace "
        "for root cause.\nRuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert root_cause(init_failure) == "ImportError: cannot import name 'x' from 'y'"
    assert root_cause("EngineDeadError: EngineCore encountered an issue. See stack trace (above)\n") is None


# ---------------------------------------------------------------------------------------------- 3: status says why


def _layout_with_settings(tmp_path: Path) -> Any:
    layout = make_layout(tmp_path)
    layout.config_json.write_text(
        json.dumps(
            {"run": {"lease_timeout_s": 10.0}, "rollout": {"max_backlog_samples": 64, "max_staleness": 2}}
        )
    )
    return layout


def _text(snap: dict[str, Any]) -> str:
    con = Console(file=io.StringIO(), record=True, width=250, color_system=None)
    render(snap, con)
    return con.export_text()


def test_status_says_why_fewer_workers_run_than_desired(tmp_path: Path) -> None:
    layout = _layout_with_settings(tmp_path)
    init_state(layout, 2)
    heartbeats.worker_status(layout, "w0", slot=0).update(state="running", weights_version=0)
    heartbeats.supervisor_status(layout, "sup-a", capacity=1).update(state="running", slots=[0], workers={})
    snap = status.snapshot(layout)
    assert (snap["desired_workers"], snap["running_workers"]) == (2, 1)
    assert snap["workers_why"].startswith(
        "no supervisor has a free slot: 1 supervisor(s) hold 1 slot(s) in all"
    )
    assert "running workers 1 of 2: no supervisor has a free slot" in _text(snap)

    layout2 = _layout_with_settings(tmp_path / "none")
    init_state(layout2, 1)
    assert "no node supervisor is running" in status.snapshot(layout2)["workers_why"]


def test_a_crashed_worker_being_restarted_is_restarting_with_its_whole_error(tmp_path: Path) -> None:
    layout = _layout_with_settings(tmp_path)
    init_state(layout, 1)
    error = "EngineDied: vLLM engine died: RuntimeError: CPU Generator does not use offset" + " (more)" * 20
    heartbeats.worker_status(layout, "w0", slot=0).update(state="failed", last_error=error)
    workers = {"0": {"worker_id": "w0", "pid": None, "state": "restarting", "restarts": 2, "device": "cpu"}}
    heartbeats.supervisor_status(layout, "sup-a", capacity=1).update(
        state="running", slots=[0], workers=workers
    )
    snap = status.snapshot(layout)
    (w,) = snap["workers"]
    assert (w["state"], w["restarts"]) == ("restarting", 2)
    text = _text(snap)
    assert f"w0 restarting (restarts 2): {error}" in " ".join(text.split())

    # given up by its supervisor: failed
    heartbeats.worker_status(layout, "w0", slot=0).update(
        state="failed", last_error=error, gave_up="5 restarts"
    )
    heartbeats.supervisor_status(layout, "sup-a", capacity=1).update(
        state="running", slots=[], workers={}, failed_slots={"0": error}
    )
    snap = status.snapshot(layout)
    assert snap["workers"][0]["state"] == "failed"
    assert "1 slot(s) failed" in snap["workers_why"]


def test_status_counts_reward_failures_with_the_first_error(tmp_path: Path) -> None:
    layout = _layout_with_settings(tmp_path)
    init_state(layout, 2)
    first = "math_answer: answer is None (the row has no data.answer_field)"
    for i, (groups, err) in enumerate(((3, first), (1, "later"))):
        heartbeats.worker_status(layout, f"w{i}", slot=i).update(
            state="running",
            dropped_reward_groups=groups,
            dropped_reward_samples=8 * groups,
            first_reward_error=err,
            last_error="newest",
        )
    snap = status.snapshot(layout)
    assert snap["reward_failures"] == {
        "groups": 4,
        "samples": 32,
        "workers": ["w0", "w1"],
        "first_error": first,
    }
    assert (
        f"reward failed for 4 group(s) (32 samples, dropped whole) on w0, w1; first error: {first}"
        in _text(snap)
    )


def test_staleness_pause_says_it_counts_versions_still_to_be_trained(tmp_path: Path) -> None:
    layout = _layout_with_settings(tmp_path)
    heartbeats.worker_status(layout, "w0", slot=0).update(
        state="paused", paused_reason="stale", weights_version=13, latest_version=13
    )
    (w,) = status.snapshot(layout)["workers"]
    assert "versions still to be trained" in w["paused_why"]
    assert "serving v13 (latest v13)" in w["paused_why"] and "rollout.max_staleness 2" in w["paused_why"]


def _prompts_config(tmp_path: Path, rows: list[dict[str, Any]]) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'[model]\npath = "{model}"\n[data]\ntask = "file"\nprompts_file = "{prompts}"\n'
        'answer_field = "reward_model.ground_truth"\n[reward]\nfunction = "math_answer"\n'
    )
    return toml


def test_init_warns_with_a_count_and_the_first_row_lacking_the_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows: list[dict[str, Any]] = [
        {"prompt": "1+1?", "reward_model": {"ground_truth": "2"}},
        {"prompt": "2+2?", "reward_model": {}},
        {"prompt": "3+3?"},
    ]
    assert cli.main(["init", str(tmp_path / "run"), "--config", str(_prompts_config(tmp_path, rows))]) == 0
    err = capsys.readouterr().err
    assert "2 of 3 rows have no answer at 'reward_model.ground_truth'" in err
    assert "the first is row 2: '2+2?'" in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------- 4: second trainer


def _trainer_run(tmp_path: Path) -> Any:
    layout = make_layout(tmp_path)
    cfg = ShardRLConfig.model_validate({"reward": {"function": "max_digit"}, "run": {"lease_timeout_s": 2.0}})
    return SimpleNamespace(layout=layout, config=cfg)


def _trainer_record(run: Any, **fields: Any) -> None:
    base = {"host": "h", "pid": 1, "beat": 1, "updated_at": time.time(), "state": "training", "epoch": 1}
    write_record(run.layout.trainer_status, TrainerStatus(**{**base, **fields}))


@pytest.mark.proc
def test_a_live_trainer_makes_a_second_one_refuse_without_takeover(tmp_path: Path) -> None:
    from buffer.fsio import HOST
    from trainer.takeover import live_trainer, refuse_live_trainer

    run = _trainer_run(tmp_path)
    assert refuse_live_trainer(run, takeover=False) is None  # no trainer yet
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _trainer_record(run, host=HOST, pid=sleeper.pid, step=11)
        refusal = refuse_live_trainer(run, takeover=False)
        assert refusal is not None and f"pid {sleeper.pid}" in refusal and "pass --takeover" in refusal
        assert "training at step 11" in refusal
        assert refuse_live_trainer(run, takeover=True) is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert refuse_live_trainer(run, takeover=False) is None  # its process is gone: a crash, resume
    _trainer_record(run, host=HOST, pid=os.getppid(), state="stopped")
    assert refuse_live_trainer(run, takeover=False) is None  # stopped cleanly

    # another host: alive while its record changes, not when it stays still
    clock = [0.0]

    def still(seconds: float) -> None:
        clock[0] += seconds

    _trainer_record(run, host="elsewhere", pid=7, beat=5)
    assert live_trainer(run, sleep=still, clock=lambda: clock[0]) is None

    def beating(seconds: float) -> None:
        still(seconds)
        _trainer_record(run, host="elsewhere", pid=7, beat=6)

    _trainer_record(run, host="elsewhere", pid=7, beat=5)
    live = live_trainer(run, sleep=beating, clock=lambda: clock[0])
    assert live is not None and "keeps changing" in live


def test_metrics_readers_keep_the_last_row_of_a_replayed_step(tmp_path: Path) -> None:
    path = tmp_path / "trainer.jsonl"
    for step, epoch in ((10, 1), (11, 1), (12, 1), (11, 2), (12, 2), (13, 2)):
        metrics.append(path, {"step": step, "epoch": epoch})
    rows = metrics.one_per_step(metrics.read_all(path))
    assert [(r["step"], r["epoch"]) for r in rows] == [(10, 1), (11, 2), (12, 2), (13, 2)]

    logged: list[dict[str, Any]] = []
    fake = SimpleNamespace(define_metric=lambda *a, **k: None, log=logged.append)
    sink = metrics.WandbSink(
        fake, logged_through=12
    )  # W&B cannot replace a row: a replay is not logged twice
    for step in (11, 12, 13):
        sink.log({"loss": 1.0}, step)
    assert logged == [{"loss": 1.0, "step": 13}]


def test_report_eval_legend_shows_the_recorded_prompt_count() -> None:
    assert eval_label([{"accuracy": 0.5, "prompts": 37}]) == "greedy accuracy (37 prompts)"
    assert eval_label([{"accuracy": None, "reward_mean": 0.2, "prompts": 5}]) == "greedy reward (5 prompts)"


# ---------------------------------------------------------------------------------------------- 5: alike commands


def test_export_commands_take_the_run_like_every_other(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Path, Path]] = []

    def record(args: Any, _: dict[str, str]) -> int:
        seen.append((args.run, args.out))
        return 0

    monkeypatch.setitem(cli.COMMANDS, "export", record)
    monkeypatch.setitem(cli.COMMANDS, "export-shards", record)
    assert cli.main(["export", "R", "--version", "3", "O"]) == 0
    assert cli.main(["export", "--run-dir", "R", "--version", "latest", "O"]) == 0
    assert cli.main(["export-shards", "--run-dir", "R", "O"]) == 0
    monkeypatch.setenv("SHARDRL_RUN", "R")
    assert cli.main(["export-shards", "O"]) == 0
    assert seen == [(Path("R"), Path("O"))] * 4


def test_rollout_once_without_eval_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_worker.__main__ import main

    assert main(["--run-dir", str(tmp_path), "--once"]) == 2
    assert "--once is an option of --eval" in capsys.readouterr().err


@pytest.mark.proc
def test_tiny_model_help_does_not_talk_about_a_runs_config() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "tiny-model", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    assert "tiny Qwen2" in out and "config.json" not in out and "RUN" not in out


def test_a_hub_id_as_model_path_is_refused_and_a_failed_init_leaves_no_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert (
        cli.main(["init", str(run), "--config", str(DEMO), "--model.path", "Qwen/Qwen2.5-1.5B-Instruct"]) == 2
    )
    err = capsys.readouterr().err
    assert (
        "command line: --model.path: 'Qwen/Qwen2.5-1.5B-Instruct'" in err
        and "hub ids are not supported" in err
    )
    missing = tmp_path / "no-such-model"
    assert cli.main(["init", str(run), "--config", str(DEMO), "--model.path", str(missing)]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    assert not run.exists()


def test_the_supervisor_says_where_a_run_wide_trainer_setting_goes() -> None:
    hint = "pass it to the trainer (python -m trainer)"
    with pytest.raises(ConfigError, match=r"run-wide setting, fixed in RUN/config\.json by `shardrl init`"):
        refuse_sections({"trainer.lr": "1e-6"}, ("trainer",), "shardrl-rollout", hint)
    with pytest.raises(ConfigError, match=r"pass it to the trainer \(python -m trainer\)"):
        refuse_sections({"trainer.max_steps": "3"}, ("trainer",), "shardrl-rollout", hint)


# ---------------------------------------------------------------------------------------------- 6: typos


def test_an_unknown_key_names_the_closest_one_and_the_flag_it_came_from(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[reward]\nfunction = "max_digit"\n[trainer]\nlrr = 1e-6\n')
    with pytest.raises(ConfigError) as e:
        load_toml(toml)
    assert str(e.value).startswith(
        f"{toml}: field trainer.lrr: not a config key (did you mean lr?); accepted keys"
    )
    with pytest.raises(ConfigError) as e:
        load_toml(DEMO, {"algorithm.clip_lo": "0.1"})
    assert str(e.value).startswith(
        "command line: --algorithm.clip_lo: algorithm.clip_lo is not a config key (did "
        "you mean clip_low?); accepted keys here: "
    )
    with pytest.raises(
        ConfigError,
        match=r"^command line: --trainr.lr: trainr is not a config key \(did you mean "
        r"trainer\?\)",
    ):
        load_toml(DEMO, {"trainr.lr": "1"})
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(load_toml(DEMO).model_dump(mode="json")))
    with pytest.raises(ConfigError, match=r"^command line: --trainer.max_step: .*did you mean max_steps\?"):
        load_run_config(config_json, {"trainer.max_step": "3"})


def test_the_data_docs_export_example_survives_retention() -> None:
    docs = (ROOT / "docs" / "DATA.md").read_text()
    assert "shardrl export runs/demo --version latest" in docs and "--version 3 exports" not in docs


def test_sampled_logprobs_read_vllms_flat_container_and_its_list_of_dicts_alike() -> None:
    """The engines ask vLLM for flat logprobs (lists, not a dict a token): read from its lists when it holds the
    sampled tokens alone, looked up per position when it holds more, the same values as the older list of dicts."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from rollout_worker.engines.vllm import sampled_logprobs

    ids = [5, 9, 2]
    positions = [{5: Logprob(-0.5, 1)}, {9: Logprob(-1.25, 3)}, {2: Logprob(-2.0, 1)}]
    flat = FlatLogprobs()
    for p in positions:
        flat.append(p)
    assert sampled_logprobs(flat, ids) == sampled_logprobs(positions, ids) == [-0.5, -1.25, -2.0]
    # a top-2 container (the sampled token and one other at each position): found by id, not by place
    wide = FlatLogprobs()
    for (t, lp), other in zip((p.popitem() for p in positions), (7, 8, 6), strict=True):
        wide.append({other: Logprob(-0.1, 1), t: lp})
    assert sampled_logprobs(wide, ids) == [-0.5, -1.25, -2.0]


def test_an_engine_built_without_a_tokenizer_refuses_stop_strings_in_one_line() -> None:
    """A run that can carry no stop string builds vLLM without its tokenizer; a request with one is refused before
    vLLM fails deep inside it, naming the setting."""
    from rollout_worker.engines import EngineError, SamplingSpec
    from rollout_worker.engines.vllm import refuse_stops

    refuse_stops(SamplingSpec(stop=["\n"]), detokenize=True)
    refuse_stops(SamplingSpec(), detokenize=False)
    with pytest.raises(
        EngineError, match=r"^rollout\.sampling\.stop: stop strings need the engine's tokenizer"
    ) as e:
        refuse_stops(SamplingSpec(stop=["\n"]), detokenize=False)
    assert "\n" not in str(e.value)
