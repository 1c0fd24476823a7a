"""DCP checkpoints: saved at 2 ranks and resumed at 1, saved at 1 and resumed at 2; the commit record decides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from buffer.fsio import write_json_atomic
from buffer.layout import RunLayout
from buffer.weights import latest_version, verify_version
from trainer.checkpoint import complete_checkpoints, latest_complete_checkpoint, prune_checkpoints

from ._fsdp_worker import launch


def _fake_checkpoint(layout: RunLayout, step: int, committed: bool) -> None:
    layout.checkpoint(step).mkdir(parents=True)
    (layout.checkpoint(step) / "__0_0.distcp").write_bytes(b"partial")
    if committed:
        write_json_atomic(layout.checkpoint_commit(step), {"step": step})


def test_commit_record_decides_and_pruning(tmp_path: Path) -> None:
    layout = RunLayout.of(tmp_path / "run")
    assert latest_complete_checkpoint(layout) is None  # no checkpoints directory at all
    layout.create()
    for step, committed in [(1, True), (2, False), (3, True), (4, True), (6, False)]:
        _fake_checkpoint(layout, step, committed)
    (layout.checkpoints / "step-junk").mkdir()
    write_json_atomic(layout.checkpoint_commit(6).with_name("COMMITTED.tmp"), {"step": 6})
    assert complete_checkpoints(layout) == [1, 3, 4]
    assert latest_complete_checkpoint(layout) == 4  # step 6 has no commit record
    write_json_atomic(layout.checkpoint_commit(4), {"step": 5})  # a record that names another step
    assert latest_complete_checkpoint(layout) == 3
    write_json_atomic(layout.checkpoint_commit(4), {"step": 4})

    assert prune_checkpoints(layout, keep=2) == [1, 2]  # older complete, and the interrupted save before 4
    assert complete_checkpoints(layout) == [3, 4]
    assert layout.checkpoint(
        6
    ).exists()  # an incomplete save newer than the newest complete one is left alone
    assert (layout.checkpoints / "step-junk").exists()


def _load_dump(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    return load_file(str(path.with_suffix(".safetensors"))), json.loads(path.with_suffix(".json").read_text())


def _assert_same_state(saved: Path, loaded: Path) -> dict:
    """Parameters and optimizer state bit for bit, LR and scheduler position, and the RNG stream."""
    a, a_info = _load_dump(saved)
    b, b_info = _load_dump(loaded)
    assert a.keys() == b.keys()
    assert any(k.startswith("optim/") and k.endswith("/exp_avg_sq") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for k in ("step", "lr", "last_epoch", "rand"):
        assert a_info[k] == b_info[k], k
    return b_info


@pytest.mark.slow
def test_checkpoint_reshards_between_world_sizes(tmp_path: Path, tiny_model_tied: Path) -> None:
    model = tiny_model_tied
    layout = RunLayout.of(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()

    # 2 ranks: train 2 steps, checkpoint after each.
    launch(["train-save", layout.root, model, out, "save2", 2], nproc=2)
    assert complete_checkpoints(layout) == [1, 2]
    _fake_checkpoint(layout, 0, committed=False)  # an interrupted save, older than the newest complete one
    _fake_checkpoint(layout, 7, committed=False)  # an interrupted save that would be the newest
    assert latest_complete_checkpoint(layout) == 2

    # 1 plain process: resume step 2, compare, then train and checkpoint step 3 and publish from one rank.
    launch(["resume", layout.root, model, out, "load1", 1], nproc=1)
    info = _assert_same_state(out / "save2", out / "load1")
    assert info["extra"] == {"next_version": 3, "tag": "save2"}
    assert complete_checkpoints(layout) == [2, 3]  # keep=2 pruned step 1...
    assert not layout.checkpoint(0).exists()  # ...and the interrupted save older than step 3
    assert layout.checkpoint(7).exists()
    trainer_state = json.loads((layout.checkpoint(3) / "trainer_state.json").read_text())
    assert trainer_state["world_size"] == 1 and len(trainer_state["rng"]) == 1

    # The one-rank publish holds the trained weights.
    from safetensors.torch import load_file

    assert latest_version(layout) == 1
    published = load_file(
        str(verify_version(layout, 1, checksums=True).path / "model-00001-of-00001.safetensors")
    )
    params, _ = _load_dump(out / "load1-after")
    assert "lm_head.weight" not in published
    for k, v in published.items():
        assert torch.equal(v, params[f"param/lm.{k}"]), k

    # 2 ranks: resume step 3 (saved by 1 rank) and compare.
    launch(["resume", layout.root, model, out, "load2"], nproc=2)
    info = _assert_same_state(out / "load1-after", out / "load2")
    assert info["extra"] == {"next_version": 4, "tag": "load1"}
