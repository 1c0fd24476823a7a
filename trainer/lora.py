"""LoRA in the trainer: peft adapters injected into the HF model before FSDP2 shards it, on a frozen base.

``apply_lora`` runs between building the HF model and ``fully_shard`` (``trainer.model.build_actor`` /
``build_critic``): peft's LoRA layers go into the targeted linear layers *in place* (``inject_adapter_in_model``, no
``PeftModel`` wrapper), so the model keeps its class and its HF names: a targeted layer's weight moves to
``<layer>.base_layer.weight`` and the adapter adds ``<layer>.lora_A.default.weight`` / ``lora_B``.  Everything
but the adapters is frozen and stored in the trainer's compute dtype (bf16 on GPU): a base that never changes needs
no fp32 master copy, no gradient and no optimizer state, while the adapters keep fp32 masters for AdamW.  FSDP2
shards the frozen and the trainable parameters of a decoder layer in the same unit; only the adapters' gradients are
reduced.

The KL reference is the same model with its adapters switched off (``AdaptersOff``): no second copy of the base.

Published adapters (``trainer/publish.py``) carry peft's own file names (``peft_name``) and an
``adapter_config.json`` from peft's ``LoraConfig`` (``adapter_files``), so ``PeftModel.from_pretrained`` and vLLM's
``LoRARequest`` load them as they load any peft adapter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from buffer.config import AdapterConfig, ConfigError
from trainer.logprobs import Actor
from trainer.sharding import reshard, resolve_param_dtype

ADAPTER = "default"  # peft's name of the one adapter the trainer trains
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")


def peft_config(settings: AdapterConfig, base_model: str | Path | None = None) -> Any:
    """peft's ``LoraConfig`` for ``settings`` (the trainer's and the published ``adapter_config.json``'s)."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        # peft types alpha as int; a whole number is written as one, so the config reads like peft's own
        lora_alpha=cast(int, int(settings.alpha) if settings.alpha.is_integer() else settings.alpha),
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=None if base_model is None else str(base_model),
        inference_mode=True,
    )


def apply_lora(model: nn.Module, settings: AdapterConfig, frozen_dtype: torch.dtype, what: str) -> nn.Module:
    """Inject LoRA adapters into ``model`` (in place) and freeze the rest in ``frozen_dtype``; returns ``model``.

    ``what`` names the config section in errors (``model.lora`` / ``trainer.critic_lora``).  A head added after
    this call (the critic's value head) stays trainable.
    """
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(peft_config(settings), model, adapter_name=ADAPTER)
    except ValueError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{what}.target_modules {settings.target_modules}: {first}") from None
    for name, p in model.named_parameters():
        trainable = is_adapter_param(name)
        p.requires_grad_(trainable)
        if not trainable and p.is_floating_point():
            p.data = p.data.to(frozen_dtype)
    return model


def maybe_lora(
    model: nn.Module, settings: AdapterConfig | None, param_dtype: str, device: torch.device, what: str
) -> nn.Module:
    """``apply_lora`` when ``settings`` turns LoRA on (rank > 0), the base frozen in the trainer's compute dtype
    (``trainer.param_dtype`` on ``device``); ``model`` unchanged otherwise."""
    if settings is None or not settings.enabled:
        return model
    return apply_lora(model, settings, resolve_param_dtype(param_dtype, device), what)  # type: ignore[arg-type]


def is_adapter_param(name: str) -> bool:
    return any(part in name for part in _ADAPTER_PARTS)


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter_param(n) for n, _ in model.named_parameters())


def peft_name(name: str) -> str:
    """An adapter parameter's HF-side name -> its name in peft's ``adapter_model.safetensors``
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def base_name(name: str) -> str:
    """A base parameter's name with peft's wrapper removed (``q_proj.base_layer.weight`` -> ``q_proj.weight``)."""
    return name.replace(".base_layer.", ".")


def adapter_scale(module: nn.Module) -> float:
    """alpha / rank of a LoRA layer (what multiplies ``lora_B @ lora_A``)."""
    return float(module.scaling[ADAPTER])  # type: ignore[index]


def lora_layers(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(name, layer) of every LoRA layer of ``model`` (peft's ``LoraLayer``)."""
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every LoRA layer skips its adapter.  Flips peft's flag only: peft's own
    ``enable_adapters`` also toggles ``requires_grad``, which an FSDP2-sharded model must not see change."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m._disable_adapters = was


class AdaptersOff(Actor):
    """The KL reference of a LoRA actor: the actor's forward with its adapters disabled (the frozen base).

    It holds the actor without registering it as a submodule: the reference has no parameters of its own, and
    checkpoints, optimizers and ``parameters()`` never see the actor twice.
    """

    def __init__(self, actor: Actor):
        nn.Module.__init__(self)
        self._actor = [actor]  # a list: not a registered submodule

    @property
    def lm(self) -> Any:  # type: ignore[override]
        return self._actor[0].lm

    @property
    def config(self) -> Any:
        return self._actor[0].config

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        actor = self._actor[0]
        with torch.no_grad(), adapters_disabled(actor):
            out = actor(*args, **kwargs)
        reshard(actor)  # the root keeps its gathered weights after a forward without backward
        return out


def adapter_files(settings: AdapterConfig, base_model: Path) -> dict[str, str]:
    """``adapter_config.json`` as peft writes it (its ``save_pretrained`` of the config), by file name."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        peft_config(settings, base_model).save_pretrained(tmp)
        return {"adapter_config.json": (Path(tmp) / "adapter_config.json").read_text()}
