"""``trainer.fsdp_prefetch`` on 2 torchrun ranks (CPU, gloo): the setting reaches FSDP2, whose profile shows the
forward prefetches it adds, and the step's numbers do not change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardrl.tiny_model import build_tiny_model

from ._fsdp_worker import launch


def test_two_layers_ahead_add_forward_prefetches_and_leave_the_step_as_it_was(tmp_path: Path) -> None:
    # four decoder layers, so that two ahead is more than the next one
    model = build_tiny_model(tmp_path / "model", shape={"num_hidden_layers": 4})
    launch(["prefetch", tmp_path, model], nproc=2)
    report = json.loads((tmp_path / "prefetch.json").read_text())
    own, ahead = report["1"], report["2"]
    # FSDP2's own order gathers the next layer from its hook: no explicit forward prefetch, its backward
    # prefetch only; two ahead: layers 0-2 start the gathers of the next one or two (1+2, 2+3, 3)
    assert own["forward_prefetch"] == 0 and own["backward_prefetch"] > 0
    assert ahead["forward_prefetch"] == 5
    assert ahead["backward_prefetch"] > 0
    assert ahead["loss"] == pytest.approx(own["loss"], rel=1e-6)
    assert ahead["grad_norm"] == pytest.approx(own["grad_norm"], rel=1e-6)
    assert own["grad_norm"] > 0
