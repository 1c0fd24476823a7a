"""The optimizer side of a step: AdamW groups, the LR schedule, and a global gradient-norm clip over FSDP shards."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer import dist as tdist

Schedule = Literal["constant", "cosine"]


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (1-d) get no weight decay.

    On the GPU the update is the fused kernel: the default multi-tensor path builds temporaries as large as a
    group's parameters (sqrt of the second moment, the step), 4 bytes per parameter on top of AdamW's 16, which is
    what kept a 7B full-weight step from one H200.  Elsewhere (CPU training, parameters offloaded to the host) the
    default path stays."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": ps, "weight_decay": wd}
        for ps, wd in ((decay, weight_decay), (no_decay, 0.0))
        if ps  # an empty group would make the state-dict layout depend on the model
    ]
    on_gpu = bool(decay or no_decay) and all(p.device.type == "cuda" for p in (*decay, *no_decay))
    return torch.optim.AdamW(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True if on_gpu else None
    )


def lr_factor(
    step: int, *, warmup_steps: int, schedule: Schedule, total_steps: int, min_lr_ratio: float = 0.0
) -> float:
    """The multiplier of the base LR at optimizer step ``step`` (0-based): linear warmup, then constant/cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    schedule: Schedule,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``lr_factor``; its state dict is plain numbers (checkpointed as JSON)."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule: {schedule!r} is not one of constant, cosine")

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=warmup_steps,
            schedule=schedule,
            total_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients to their global L2 norm over all ranks' shards; returns the norm before clipping.

    Works on each rank's local shards as plain tensors, wherever they live (the device, or host memory with
    ``trainer.cpu_offload``): the squared norms are summed across ranks on the collective device, and every rank
    scales its shards by the same factor.  A non-finite norm is returned as is (the caller skips the step); the
    gradients are then scaled by a NaN/0 factor.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squared = torch.nn.utils.get_total_norm(local, norm_type=2.0).double() ** 2
    if any(isinstance(g, DTensor) for g in grads) and dist.is_initialized() and dist.get_world_size() > 1:
        squared = tdist.all_reduce_sum(squared.cpu())
    total = squared.sqrt()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in local:
        g.mul_(factor.to(device=g.device, dtype=g.dtype))
    return float(total.item())
