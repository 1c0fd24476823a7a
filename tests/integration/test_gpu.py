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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-chunks", "compiled-chunks"])
def test_the_fused_head_on_cuda_matches_the_recomputing_head_in_bf16(compiled: bool) -> None:
    """``trainer.fused_head`` at a real head's size (Qwen2.5-1.5B's hidden size and vocabulary, one micro-batch of
    16,384 tokens): the loss and both gradients of the recomputing head within bf16 rounding (1e-2 relative), and
    chunks of logits alive, never the whole [tokens x vocab] in fp32 (10 GB here); with ``trainer.compile_head``
    too (Triton kernels)."""
    import torch

    from trainer.fused_head import HeadLoss
    from trainer.logprobs import head_logprobs_and_entropy

    device, n, hid, vocab = torch.device("cuda"), 16384, 1536, 151936
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n + 1, hid, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, hid, generator=g) / hid**0.5).to(device, torch.bfloat16)
    ids = torch.randint(0, vocab, (1, n + 1), generator=g).to(device)
    want = torch.ones(1, n + 1, dtype=torch.bool, device=device)
    old, adv = (-torch.rand(n, generator=g) * 3).to(device), torch.randn(n, generator=g).to(device)

    def loss_of(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        ratio = torch.exp(logp[0, 1:] - old)
        return (torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) - 0.01 * ent[0, 1:]).mean()

    results = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_()
        head = torch.nn.Linear(hid, vocab, bias=False, device=device, dtype=torch.bfloat16)
        head.weight.data.copy_(weight)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn = HeadLoss(loss_of, compiled) if fused else None
        logp, ent = head_logprobs_and_entropy(h, head, ids, want, chunk=1024, loss=fn)
        loss = loss_of(logp, ent)
        (fn.carrier if fn is not None and fn.carrier is not None else loss).backward()
        peak = torch.cuda.max_memory_allocated(device) - base
        results.append((loss.item(), h.grad, head.weight.grad, peak))
    (loss_r, dh_r, dw_r, _), (loss_f, dh_f, dw_f, peak_f) = results
    assert loss_f == pytest.approx(loss_r, rel=1e-2)
    for got, want_grad in ((dh_f, dh_r), (dw_f, dw_r)):
        assert got is not None and want_grad is not None
        assert float((got.float() - want_grad.float()).norm() / want_grad.float().norm()) < 1e-2
    # a chunk's fp32 [1024 x V] tensors (two, three for a moment), the bf16 gradients of the weight and the input:
    # ~2.4 GB, against 10 GB for the whole logits in fp32 alone
    assert peak_f < n * vocab * 4 / 2, f"{peak_f / 2**30:.2f} GiB at the peak: more than a few chunks' logits"
