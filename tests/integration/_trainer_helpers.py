"""Builders and process handling shared by the trainer integration tests: runs on the tiny model, synthetic shards,
trainer processes (one plain process or torchrun), and readers for metrics and checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from buffer.config import apply_overrides, validate
from buffer.layout import RunLayout
from buffer.run import open_run
from shardrl.runs import init_run

from ._common import free_port, wait_for

__all__ = ["wait_for"]

REPO = Path(__file__).resolve().parents[2]


def make_run(root: Path, model: Path, **overrides: Any) -> RunLayout:
    """A run on the session's tiny model with settings the trainer tests rely on (not the demo's, which are tuned
    for learning); ``overrides`` are dotted keys written with ``__`` for the dot."""
    settings = {
        "model.path": str(model),
        "reward.function": "max_digit",
        "rollout.sampling.n": "8",
        "rollout.sampling.max_response_length": "6",
        "algorithm.entropy_coef": "0.01",
        "trainer.lr": "1e-3",
        "trainer.samples_per_step": "32",
        "trainer.max_staleness": "1000",
        "trainer.save_every": "10",
        "trainer.tensorboard": "false",
    }
    settings.update({k.replace("__", "."): str(v) for k, v in overrides.items()})
    return init_run(root, validate(apply_overrides({}, settings), "test settings")).layout


def write_groups(layout: RunLayout, worker: str, version: int = 0, groups: int = 2, group: int = 8) -> str:
    """One valid shard of ``groups`` whole groups of ``group`` samples at ``version``; its file name."""
    from buffer.shards import ShardWriter

    w = ShardWriter(layout, open_run(layout.root).run_id, worker)
    for g in range(groups):
        for i in range(group):
            w.add(
                {
                    "group_id": f"{worker}.{w.incarnation}.g{g}",
                    "prompt_ids": [5, 6, 7, 8],
                    "response_ids": [10 + i, 20 + g, 30],
                    "response_logprobs": [-1.0, -2.0, -0.5],
                    "reward": float(i % 2),
                    "policy_version": version,
                    "finish_reason": "stop",
                }
            )
    path = w.flush()
    assert path is not None
    return path.name


def synth(layout: RunLayout, shards: int, samples: int, seed: int = 0) -> None:
    from shardrl.synth import synth_shards

    synth_shards(open_run(layout.root), shards, samples, seed=seed)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    e["OMP_NUM_THREADS"] = "1"
    e["TRANSFORMERS_VERBOSITY"] = "error"
    e["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return e


def command(nproc: int, *args: str | Path) -> list[str]:
    """``python -m trainer ARGS`` as one process, or under torchrun with ``nproc`` ranks."""
    head = [sys.executable]
    if nproc > 1:
        head += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    return [*head, *map(str, args)]


def trainer_args(layout: RunLayout, *extra: str | int) -> list[str | Path]:
    return ["-m", "trainer", "--run-dir", layout.root, *map(str, extra)]


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(cmd, env=env(), stdout=out, stderr=subprocess.STDOUT)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each worker in a session of its own, so a process group
    does not cover them)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process and everything it started, all at once (a node dying), then reap it."""
    if proc.poll() is not None:
        return  # reaped: its pid may belong to someone else by now
    for pid in reversed(_tree(proc.pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def run(cmd: list[str], log: Path, timeout_s: float = 300.0) -> int:
    proc = start(cmd, log)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"{cmd} did not finish in {timeout_s}s:\n{tail(log)}") from None


def run_ok(cmd: list[str], log: Path, timeout_s: float = 300.0) -> None:
    rc = run(cmd, log, timeout_s)
    where = native_crash_site(tail(log, 200_000))
    if rc != 0 and where is not None and COLLECTIVES in where:
        # The one known outside cause: a rank killed by SIGSEGV inside torch's own collectives (seen once in gloo's
        # CPU all-reduce, under load).  Launched again, as a scheduler would requeue it, the trainer resumes from its
        # checkpoint; a second crash fails the test.  Any other crash (in our code, in a model's kernels) fails at
        # once, with its stack.  Every retry is a warning in pytest's summary, with the crashed log kept.
        first = log.with_name(log.name + ".crashed")
        log.replace(first)
        warnings.warn(
            f"{cmd[-3:]}: a rank crashed in {where} (log kept in {first}); launched again", stacklevel=2
        )
        rc = run(cmd, log, timeout_s)
    assert rc == 0, f"{cmd} exited with {rc}:\n{tail(log)}" + (f"\nnative crash in {where}" if where else "")


NATIVE_CRASH = "(SIGSEGV)"  # torchrun's report of a rank killed by signal 11
COLLECTIVES = "torch/distributed/"


def native_crash_site(text: str) -> str | None:
    """The innermost Python frame of the crashing thread of a rank's native crash, as faulthandler printed it
    (``File "...", line N in f`` under ``Current thread``), when the log shows a SIGSEGV; None otherwise."""
    if NATIVE_CRASH not in text and "Segmentation fault" not in text:
        return None
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Segmentation fault" in line]
    for start in starts:
        after = lines[start + 1 :]
        current = next((i for i, line in enumerate(after) if line.startswith("Current thread")), None)
        frames = after[current + 1 :] if current is not None else after
        for frame in frames[:40]:
            if frame.strip().startswith("File "):
                return frame.strip()
    return "(no Python stack in the log)"


def tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def metrics(layout: RunLayout) -> list[dict[str, Any]]:
    """trainer.jsonl records; a line torn by a SIGKILL is skipped."""
    out = []
    path = layout.metrics_file("trainer")
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def trainer_state(layout: RunLayout, step: int) -> dict[str, Any]:
    return json.loads((layout.checkpoint(step) / "trainer_state.json").read_text())


def checkpoint_tensors(layout: RunLayout, step: int, scratch: Path) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint with dotted names (``actor.optim.state.<param>.step``...)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"ckpt-{step}.pt"
    dcp_to_torch_save(str(layout.checkpoint(step)), str(out))
    flat: dict[str, Any] = {}

    def walk(d: dict[str, Any], prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk(torch.load(out, weights_only=False), "")
    out.unlink()
    return flat


def adam_steps(tensors: dict[str, Any], part: str) -> set[int]:
    """The distinct optimizer step counts of one part (one value when every parameter was updated alike)."""
    return {
        int(v) for k, v in tensors.items() if k.startswith(f"{part}.optim.state.") and k.endswith(".step")
    }


def safetensors_dir(path: Path) -> dict[str, Any]:
    """The tensors of a model directory, or of a published weight version: a delta version is rebuilt first, by
    the node-local cache the workers use (``buffer/localcache.py``), into a cache beside the run."""
    from safetensors.torch import load_file

    from buffer.deltas import DELTA_RECORD
    from buffer.localcache import NodeCache

    if (path / DELTA_RECORD).exists():
        layout = RunLayout.of(path.parents[1])
        path = (
            NodeCache(layout, layout.root.parent / f"{layout.root.name}-cache")
            .materialise(int(path.name[1:]))
            .path
        )
    out: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
