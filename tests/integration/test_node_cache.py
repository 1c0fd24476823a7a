"""The node-local weight cache with real processes: workers of one node that want the same version at the same time
read it from shared storage once between them (counted), a worker started after the run directory lost the version
still loads it from the node's copy, and a real rollout worker (transformers engine) hot-reloads a delta version and
samples from exactly the rebuilt weights."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from buffer import deltas, weights
from buffer.layout import RunLayout

from ._rollout_helpers import ROOT, make_run, ready_rows, spawn, stop, tail, wait_for, worker

# Says it is ready (its imports done), waits for the go file, materialises the version, prints what this process
# built and read from shared storage.
MATERIALISE = """
import json, sys, time
from pathlib import Path
from buffer.layout import RunLayout
from buffer.localcache import NodeCache
run, cache, version, go, ready = sys.argv[1:6]
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.001)
c = NodeCache(RunLayout.of(run), Path(cache))
wv = c.materialise(int(version))
print(json.dumps({"built": c.built, "read": c.shared_bytes_read, "path": str(wv.path)}))
"""


def _materialise_together(
    layout: RunLayout, cache: Path, version: int, n: int, tmp: Path
) -> list[dict[str, Any]]:
    go = tmp / f"go-{version}-{time.monotonic_ns()}"
    ready = [go.with_name(f"{go.name}.ready{i}") for i in range(n)]
    env = {"PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MATERIALISE, str(layout.root), str(cache), str(version), str(go), str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in ready
    ]
    # A barrier, not a sleep: go only once every process has imported and waits on it, however loaded the machine.
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in ready):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
            "a process never got ready"
        )
        time.sleep(0.01)
    go.touch()
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _version_bytes(layout: RunLayout, version: int) -> int:
    return sum(p.stat().st_size for p in layout.weight_version(version).iterdir())


def _save(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(state, metadata={"format": "pt"})


def _publish(
    layout: RunLayout, version: int, state: dict[str, torch.Tensor], model_dir: Path, base: int | None
) -> bytes:
    """``state`` as ``version``: full, or a delta against ``base`` (XOR + zstd, delta.json), sealed like the trainer's."""
    raw = _save(state)
    staging = weights.staging_dir(layout, version)
    shutil.copy(model_dir / "config.json", staging / "config.json")
    record = None
    if base is None:
        (staging / "model.safetensors").write_bytes(raw)
    else:
        (n,) = struct.unpack("<Q", raw[:8])
        with deltas.base_tensors(layout.weight_version(base)) as tensors:
            entry = deltas.encode_file(
                staging / ("model.safetensors" + deltas.DELTA_SUFFIX),
                raw[: 8 + n],
                memoryview(raw)[8 + n :],
                tensors,
            )
        record = deltas.DeltaRecord(
            base=base,
            base_manifest_sha256=deltas.manifest_sha256(layout.weight_version(base)),
            files={"model.safetensors": entry},
        )
    weights.commit_version(layout, version, staging, step=version, dtype="float32", delta=record)
    return raw


def _random_state(shape_mb: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = (shape_mb << 20) // 2
    return {"w": (0.02 * torch.randn(n // 1024, 1024, generator=g)).to(torch.bfloat16), "b": torch.zeros(8)}


@pytest.mark.slow
def test_one_read_per_node_for_full_and_delta_versions(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "run")
    layout.create()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = _random_state(24, 0)
    full1 = _publish(layout, 1, base, model, None)
    stepped = {k: (v.float() + 1e-6 * torch.randn(v.shape).sign()).to(v.dtype) for k, v in base.items()}
    full2 = _publish(layout, 2, stepped, model, base=1)
    cache = tmp_path / "node-cache"

    # three workers of a node want the delta v2 at once: v1 (its base) and v2 are read once, by one of them
    results = _materialise_together(layout, cache, 2, 3, tmp_path)
    builders = [r for r in results if r["built"]]
    assert len(builders) == 1 and sorted(builders[0]["built"]) == [1, 2]
    assert sum(r["read"] for r in results) == _version_bytes(layout, 1) + _version_bytes(layout, 2)
    assert [r["read"] for r in results].count(0) == 2
    assert {r["path"] for r in results} == {str(cache / "v000002")}
    assert (cache / "v000002" / "model.safetensors").read_bytes() == full2
    assert (cache / "v000001" / "model.safetensors").read_bytes() == full1

    # the run directory loses both versions: a worker started now still loads v2 from the node, reading nothing
    shutil.rmtree(layout.weight_version(2))
    shutil.rmtree(layout.weight_version(1))
    (late,) = _materialise_together(layout, cache, 2, 1, tmp_path)
    assert late == {"built": [], "read": 0, "path": str(cache / "v000002")}


def _rows(run: Any, version: int, at_least: int, proc: Any, log: Path) -> list[dict[str, Any]] | None:
    if proc.poll() is not None:
        raise AssertionError(f"worker exited with {proc.returncode}:\n{tail(log)}")
    rows = [r for r in ready_rows(run) if r["policy_version"] == version]
    return rows if len(rows) >= at_least else None


def _max_logprob_diff(model_dir: Path, state: dict[str, torch.Tensor], rows: list[dict[str, Any]]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    diffs = []
    for r in rows:
        prompt, response = r["prompt_ids"], r["response_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        lp = lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        diffs.append((lp - torch.tensor(r["response_logprobs"])).abs().max().item())
    return max(diffs)


@pytest.mark.slow
def test_worker_hot_reloads_a_delta_version(tmp_path: Path, tiny_model_untied: Path) -> None:
    from safetensors.torch import load_file

    model_dir = Path(tiny_model_untied)
    cache = tmp_path / "node-cache"
    run = make_run(
        tmp_path / "run",
        model_dir,
        run={"seed": 3, "heartbeat_interval_s": 0.5},
        rollout={
            "engine": "hf",
            "prompts_per_batch": 4,
            "shard_samples": 8,
            "flush_interval_s": 0.5,
            "weights_poll_s": 0.2,
            "max_backlog_samples": 1_000_000,
            "local_cache_dir": str(cache),
            "sampling": {"n": 2, "temperature": 1.0, "max_response_length": 6},
        },
        data={"max_prompt_length": 32},
    )
    base = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    v1 = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in base.items()}
    v2 = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in v1.items()}
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)
    try:
        wait_for("samples of v0", lambda: _rows(run, 0, 8, proc, log), timeout=300)
        _publish(run.layout, 1, v1, model_dir, None)
        wait_for("samples of v1", lambda: _rows(run, 1, 8, proc, log), timeout=120)
        full2 = _publish(run.layout, 2, v2, model_dir, base=1)
        assert not list(run.layout.weight_version(2).glob("*.safetensors"))  # only the delta is published
        rows = wait_for("samples of v2", lambda: _rows(run, 2, 8, proc, log), timeout=120)
        assert worker(run, "w0")["weights_version"] == 2
        assert (cache / "v000002" / "model.safetensors").read_bytes() == full2
        assert _max_logprob_diff(model_dir, v2, rows) < 2e-3  # sampled from the rebuilt v2 ...
        assert _max_logprob_diff(model_dir, v1, rows) > 0.05  # ... not from its base
        assert "loaded weights v2" in log.read_text() and "node-local copy made" in log.read_text()
        assert stop(proc, timeout=30) == 0, tail(log)
    finally:
        stop(proc)
