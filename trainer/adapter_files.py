"""A LoRA actor's adapter as a published version: every adapter tensor gathered to rank 0 under peft's name, and
peft's two files written from them (``trainer/publish.py`` commits them like any version)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from buffer.config import AdapterConfig
from buffer.weights import WeightsError
from trainer import dist as tdist
from trainer import lora as tlora
from trainer.gather import full_tensor, hf_name
from trainer.model import hf_module


def gather_adapter(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every adapter tensor under peft's name, gathered to rank 0 (collective) as host copies; None elsewhere."""
    tensors: dict[str, torch.Tensor] = {}
    for raw, p in hf_module(model).named_parameters():
        name = hf_name(raw)
        if tlora.is_adapter_param(name):
            full = full_tensor(p.detach())  # every rank, same order
            if tdist.is_main():
                tensors[tlora.peft_name(name)] = full.to(dtype).cpu().contiguous().clone()
    if not tdist.is_main():
        return None
    if not tensors:
        raise WeightsError("publish: model.lora is on but the model has no LoRA adapter parameters")
    return tensors


def save_adapter(tensors: dict[str, torch.Tensor], out: Path, lora: AdapterConfig, base: Path) -> None:
    """Rank 0: peft's two files of the adapter into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    for fname, text in tlora.adapter_files(lora, base).items():
        (out / fname).write_text(text)
