"""Metrics files: appending, reading, tailing without reading the whole file, and the sinks."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from buffer import metrics


def test_append_then_read_all_skips_a_line_being_written(tmp_path: Path) -> None:
    path = tmp_path / "m" / "trainer.jsonl"
    for s in range(1, 4):
        metrics.append(path, {"step": s, "reward": s / 10})
    with open(path, "a") as f:
        f.write('{"step": 4, "rew')  # the writer is mid-line
    assert [r["step"] for r in metrics.read_all(path)] == [1, 2, 3]
    assert metrics.read_all(tmp_path / "absent.jsonl") == []


def test_a_writer_killed_mid_line_costs_only_its_own_record(tmp_path: Path) -> None:
    path = tmp_path / "trainer.jsonl"
    metrics.append(path, {"step": 1})
    with open(path, "a") as f:
        f.write('{"step": 2, "rew')  # killed here
    metrics.append(path, {"step": 3})  # the restarted writer
    assert [r["step"] for r in metrics.read_all(path)] == [1, 3]
    assert metrics.last(path) == {"step": 3}


def test_tail_reads_only_the_end_of_a_large_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "trainer.jsonl"
    with open(path, "wb") as f:
        f.truncate(1 << 28)  # 256 MiB of earlier history (sparse: costs nothing to make)
        f.seek(0, 2)
        f.write(
            b"\n" + b"".join(json.dumps({"step": s, "pad": "x" * 50}).encode() + b"\n" for s in range(5000))
        )
        f.write(b'{"step": 50')  # being appended
    read: list[int] = []
    real_pread = os.pread

    def counting_pread(fd: int, n: int, offset: int) -> bytes:
        read.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting_pread)
    assert [r["step"] for r in metrics.tail(path, 3)] == [4997, 4998, 4999]
    assert [r["step"] for r in metrics.tail(path, 2500)][::1000] == [2500, 3500, 4500]
    assert sum(read) < 2 * 2500 * 70 + 4 * metrics.TAIL_BLOCK  # never near the 256 MiB in front
    assert metrics.last(path) == {"step": 4999, "pad": "x" * 50}


def test_tail_joins_lines_cut_by_block_edges_and_handles_short_files(tmp_path: Path) -> None:
    path = tmp_path / "trainer.jsonl"
    for s in range(1, 201):
        metrics.append(path, {"step": s, "pad": "y" * (s % 13)})
    for block in (7, 64, 1000):  # lines longer than a block, and blocks that cut lines anywhere
        assert [r["step"] for r in metrics.tail(path, 50, block=block)] == list(range(151, 201))
    assert [r["step"] for r in metrics.tail(path, 10_000)] == list(range(1, 201))
    assert metrics.tail(path, 0) == [] and metrics.tail(tmp_path / "absent.jsonl", 5) == []
    assert metrics.last(tmp_path / "absent.jsonl") is None


class _Recorder:
    def __init__(self) -> None:
        self.got: list[tuple[dict[str, Any], int]] = []
        self.closed = False

    def log(self, m: Any, step: int) -> None:
        self.got.append((dict(m), step))

    def close(self) -> None:
        self.closed = True


def test_sinks_share_one_log_interface_and_say_when_tensorboard_is_off(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as on a machine without torch/tensorboard
    path = tmp_path / "trainer.jsonl"
    with caplog.at_level(logging.INFO, logger="shardrl.metrics"):
        sinks = metrics.open_sinks(path, tensorboard_dir=tmp_path / "tb")
    off = [r.getMessage() for r in caplog.records if "TensorBoard sink off" in r.getMessage()]
    assert len(off) == 1 and "pip install tensorboard" in off[0]
    assert [type(s) for s in sinks.sinks] == [metrics.JsonlSink]
    extra = _Recorder()
    sinks.sinks.append(extra)
    sinks.log({"reward_mean": 0.5, "samples": 8}, step=3)
    sinks.close()
    (rec,) = metrics.read_all(path)
    assert rec["step"] == 3 and rec["reward_mean"] == 0.5 and rec["samples"] == 8 and "time" in rec
    assert extra.got == [({"reward_mean": 0.5, "samples": 8}, 3)] and extra.closed
    assert not (tmp_path / "tb").exists()


def _target(tmp_path: Path) -> metrics.WandbTarget:
    return metrics.WandbTarget(
        project="shardrl-test", group="20260101-000000-abcdef", name="trainer", dir=tmp_path / "logs"
    )


def test_wandb_sink_says_once_when_wandb_is_absent(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where the wandb extra is not installed
    path = tmp_path / "trainer.jsonl"
    with caplog.at_level(logging.INFO, logger="shardrl.metrics"):
        sinks = metrics.open_sinks(path, wandb=_target(tmp_path))
    off = [r.getMessage() for r in caplog.records if "W&B sink off" in r.getMessage()]
    assert len(off) == 1 and "shardrl[wandb]" in off[0]
    assert [type(s) for s in sinks.sinks] == [metrics.JsonlSink]
    sinks.log({"reward_mean": 0.5}, step=1)
    assert metrics.read_all(path)[0]["reward_mean"] == 0.5


@pytest.mark.proc
def test_wandb_sink_offline_groups_the_run_and_logs_numbers(tmp_path: Path, monkeypatch) -> None:
    import wandb  # in the dev extra: this test runs in every default run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = metrics.open_sinks(tmp_path / "trainer.jsonl", wandb=_target(tmp_path))
    (_, wb) = sinks.sinks
    assert isinstance(wb, metrics.WandbSink)
    assert wb.run.group == "20260101-000000-abcdef" and wb.run.id == "20260101-000000-abcdef-trainer"
    sinks.log({"reward_mean": 0.25, "worker_id": "w0", "done": True}, step=2)
    sinks.log({"reward_mean": 0.5}, step=3)
    assert wb.run.summary["reward_mean"] == 0.5 and wb.run.summary["step"] == 3
    assert not {"worker_id", "done"} & set(wb.run.summary.keys())  # numbers only
    sinks.close()
    assert wandb.run is None
    (offline,) = (tmp_path / "logs" / "wandb").glob("offline-run-*")
    assert list(offline.glob("*.wandb"))


def test_step_metrics_are_only_what_was_measured() -> None:
    from trainer.data import Sample
    from trainer.metrics import step_line
    from trainer.step import sample_metrics

    def sample(n: int, reward: float) -> Sample:
        return Sample("s", "g", [1, 2], [5] * n, [0.0] * n, reward, 0)

    m = sample_metrics([sample(2, 1.0), sample(4, 0.0), sample(4, 0.5)], max_response_length=4)
    assert m["response_len_mean"] == 10 / 3 and m["response_len_max"] == 4
    assert m["truncated_frac"] == 2 / 3
    assert m["reward_mean"] == 0.5 and abs(m["reward_std"] - (1 / 6) ** 0.5) < 1e-12
    assert sample_metrics([], 4) == {}
    line = step_line(3, {"samples": 3, "loss": 0.1, "reward_mean": 0.5})  # no reference model, truncated IS
    assert "kl" not in line.replace("kl_", "") and "clip" not in line
    line = step_line(3, {"samples": 3, "kl_ref": 0.002, "clip_frac": 0.25})
    assert "kl 0.0020" in line and "clip 0.250" in line
