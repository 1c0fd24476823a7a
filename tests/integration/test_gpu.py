"""GPU checks (NCCL, bf16): skipped where no CUDA device is visible, as in CI.

The trainer on all visible GPUs (torchrun, NCCL, bf16 compute, compiled layers, checkpointed but for one, two layers'
all-gathers in flight) trains on synthetic shards and publishes weights that load in transformers; the published
bf16 weights give the logits of the trainer's own next version.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buffer import plans, weights

from ._trainer_helpers import command, make_run, metrics, run_ok, synth, trainer_args

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_nccl_trainer_trains_and_publishes_bf16(tmp_path: Path, tiny_model_untied: Path) -> None:
    import torch

    gpus = torch.cuda.device_count()
    # checkpointed layers but one, whose all-gathers run two layers ahead (compiled layers: trainer.kernels is "auto")
    layout = make_run(
        tmp_path / "run",
        tiny_model_untied,
        model__dtype="bfloat16",
        trainer__save_every=2,
        trainer__activation_checkpointing="true",
        trainer__activation_checkpointing_skip="1",
        trainer__fsdp_prefetch="2",
    )
    synth(layout, shards=4, samples=32)
    run_ok(command(gpus, *trainer_args(layout, "--max-steps", 3)), tmp_path / "trainer.log")
    assert sorted(plans.valid_plans(layout)) == [1, 2, 3]
    m = metrics(layout)
    assert [r["step"] for r in m] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in m)
    v = weights.read_latest(layout, checksums=True)
    assert v is not None and v.version == 3 and v.dtype == "bfloat16"
    from transformers import AutoModelForCausalLM

    from buffer.localcache import NodeCache

    # v3 is a delta version (trainer.publish_full_every): the node-local cache rebuilds it into an HF directory
    full = NodeCache(layout, tmp_path / "cache").materialise(3).path
    cfg = json.loads((full / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(full)).to("cuda")
    assert next(model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]], device="cuda")).logits
    assert torch.isfinite(logits).all()
