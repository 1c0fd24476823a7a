"""The trainer's models: HF load, FSDP2 sharding, chunked token logprobs, reference and critic, optimizer helpers.

Sharding follows one order: activation checkpointing on each decoder layer, then ``fully_shard`` on each decoder
layer, then on the root.  Every unit gets the same ``MixedPrecisionPolicy`` (mixing policies fails with a dtype
mismatch).  Embeddings, the final norm and the LM head stay in the root unit, which keeps a tied LM head with its
embedding (sharding them apart raises on torch >= 2.13 and silently unties on 2.11).

The root is a thin wrapper (``Actor``/``Critic``) whose ``forward`` runs the base model *and* the head, so FSDP's
forward/backward hooks surround both: the LM head is applied chunk by chunk over the tokens inside that forward and
never materialises a [tokens x vocab] fp32 tensor.  Parameter names below the wrapper stay the HF names
(``Actor.lm`` is the HF model); ``trainer/publish.py`` writes them without the wrapper prefixes.

Call ``trainer.dist.init()`` first: the builders shard over all ranks of the default process group, which exists
also for a single process started without torchrun.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ParamDtype = Literal["auto", "float32", "bfloat16"]
Schedule = Literal["constant", "cosine"]


# ------------------------------------------------------------------------------------------------ loading/sharding


def resolve_param_dtype(param_dtype: ParamDtype, device: torch.device) -> torch.dtype:
    """The FSDP compute dtype: ``auto`` is bf16 on GPU and fp32 on CPU (master weights are always fp32)."""
    if param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if param_dtype == "float32":
        return torch.float32
    if param_dtype == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"param_dtype: {param_dtype!r} is not one of auto, float32, bfloat16")


def load_causal_lm(model_dir: str | Path) -> nn.Module:
    """An HF causal LM from ``model_dir`` in fp32 on the CPU (FSDP moves each unit's shard to the device)."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not an HF model directory (no config.json); check model.path")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def decoder_layers(base: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF base model (``Qwen2Model.layers`` and every Llama-like model)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(base).__name__}: no `layers` ModuleList; cannot shard it per decoder layer")
    return layers


def shard(
    root: nn.Module,
    layers: nn.ModuleList,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
) -> None:
    """Apply activation checkpointing, then ``fully_shard`` per layer, then on ``root``, over all ranks (in place)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("trainer.model: call trainer.dist.init() before building a sharded model")
    if activation_checkpointing:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=resolve_param_dtype(param_dtype, device), reduce_dtype=torch.float32
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit (the root keeps them after a forward without backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ------------------------------------------------------------------------------------------- logprobs and entropy


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] hidden states -> (logprob of ``targets`` [n], entropy [n]), both fp32; logits live only in here."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def head_logprobs_and_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    input_ids: torch.Tensor,
    want: torch.Tensor,
    *,
    chunk: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the LM head chunk by chunk to the positions that predict the tokens marked in ``want``.

    ``hidden`` [B, T, H] final hidden states, ``input_ids`` and ``want`` [B, T] -> (logp, entropy) [B, T] fp32,
    zero where ``want`` is false or t = 0.  With grad, each chunk runs under ``torch.utils.checkpoint``: only its
    [n, H] input is kept and its logits are recomputed in backward, so at most one chunk of logits is alive.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    want = want.bool().clone()
    want[:, 0] = False  # nothing predicts the first token
    src = torch.zeros_like(want)
    src[:, :-1] = want[:, 1:]  # token t is predicted from the hidden state at t - 1
    h = hidden[src]  # [N, H], row-major order, which matches input_ids[want]
    targets = input_ids[want]
    weight = cast(torch.Tensor, head.weight)
    bias = cast("torch.Tensor | None", getattr(head, "bias", None))
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        args = (h[s : s + chunk], weight, bias, targets[s : s + chunk], temperature, with_entropy)
        lp, en = checkpoint(_head_chunk, *args, use_reentrant=False) if grad else _head_chunk(*args)
        logps.append(lp)
        ents.append(en)
    zeros = torch.zeros(want.shape, dtype=torch.float32, device=hidden.device)
    if not logps:
        return zeros, zeros.clone()
    return zeros.masked_scatter(want, torch.cat(logps)), zeros.masked_scatter(want, torch.cat(ents))


def _lm_logprobs_and_entropy(
    lm: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    chunk: int,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = lm.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    if response_mask is not None:
        want = response_mask
    elif attention_mask is not None:
        want = attention_mask
    else:
        want = torch.ones_like(input_ids, dtype=torch.bool)
    return head_logprobs_and_entropy(
        out.last_hidden_state,
        lm.get_output_embeddings(),
        input_ids,
        want,
        chunk=chunk,
        temperature=temperature,
        with_entropy=with_entropy,
    )


class Actor(nn.Module):
    """An HF causal LM (``self.lm``) whose forward returns (token logprobs, entropies); the root FSDP unit."""

    def __init__(self, lm: Any):
        super().__init__()
        self.lm: Any = lm

    @property
    def config(self) -> Any:
        return self.lm.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        *,
        chunk: int = 1024,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _lm_logprobs_and_entropy(
            self.lm, input_ids, attention_mask, position_ids, response_mask, chunk, temperature, with_entropy
        )


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs and entropies of ``input_ids`` under ``model`` (an ``Actor`` or a plain HF causal LM).

    ``input_ids`` [B, T]; ``attention_mask`` [B, T] (1 = real token) and/or ``position_ids`` [B, T] as the HF model
    takes them; ``response_mask`` [B, T] marks the tokens whose logprob is wanted (default: every attended token).
    Returns ``(logp, entropy)``, both [B, T] fp32: ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` at
    ``temperature``, ``entropy[b, t]`` the entropy of that next-token distribution; 0 at t = 0 and wherever the
    token is not wanted.  The LM head runs over ``chunk`` tokens at a time (see ``head_logprobs_and_entropy``).
    """
    if isinstance(model, Actor):
        out = model(
            input_ids,
            attention_mask,
            position_ids,
            response_mask,
            chunk=chunk,
            temperature=temperature,
            with_entropy=with_entropy,
        )
        if not torch.is_grad_enabled():
            reshard(model)  # no backward will free the root's gathered weights
        return out
    return _lm_logprobs_and_entropy(
        model, input_ids, attention_mask, position_ids, response_mask, chunk, temperature, with_entropy
    )


# --------------------------------------------------------------------------------------------------- the builders


def build_actor(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
) -> Actor:
    """The trainable actor, sharded over all ranks, in train mode."""
    return shard_actor(
        load_causal_lm(model_dir),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
    )


def shard_actor(
    lm: Any,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
) -> Actor:
    """Wrap an already built HF causal LM (fp32, CPU or ``device``) as a sharded ``Actor``."""
    actor = Actor(lm)
    shard(
        actor,
        decoder_layers(lm.base_model),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
    )
    return actor.train()


def build_reference(
    model_dir: str | Path, device: torch.device, *, param_dtype: ParamDtype = "auto"
) -> Actor:
    """A frozen copy of the actor's base (KL reference): sharded like the actor, no grad, eval mode."""
    lm = load_causal_lm(model_dir)
    lm.requires_grad_(False)
    actor = shard_actor(lm, device, param_dtype=param_dtype)
    return actor.eval()


class Critic(nn.Module):
    """A value model: an HF base model and a ``Linear(hidden, 1)`` head on its last hidden state; the root unit."""

    def __init__(self, base: Any, hidden_size: int):
        super().__init__()
        self.base: Any = base
        self.value_head = nn.Linear(hidden_size, 1)
        # Values start at 0: early advantages are then the returns themselves, not a random head's noise.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.base(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        v = self.value_head(h).squeeze(-1).float()
        # Aligned with token_logprobs_and_entropy: values[b, t] is the value of the state in which token t is chosen
        # (the prefix before t), so it reads the hidden state at t - 1; nothing precedes t = 0.
        return F.pad(v[:, :-1], (1, 0))

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T] fp32 values (see ``forward``); with FSDP call this, not ``self.base``, so the hooks run."""
        out = self(input_ids, attention_mask, position_ids)
        if not torch.is_grad_enabled():
            reshard(self)
        return out


def build_critic(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
) -> Critic:
    """A critic on a copy of the base model in ``model_dir`` (its LM head dropped), sharded over all ranks."""
    lm: Any = load_causal_lm(model_dir)
    base = lm.base_model
    critic = Critic(base, int(lm.config.hidden_size))
    del lm
    shard(
        critic,
        decoder_layers(base),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
    )
    return critic.train()


def hf_module(model: nn.Module) -> nn.Module:
    """The HF model inside an ``Actor`` (the model itself otherwise): the module whose names are HF names."""
    return model.lm if isinstance(model, Actor) else model


# ------------------------------------------------------------------------------------------------ optimization


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (1-d) get no weight decay."""
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
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


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


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """Clip gradients to a global norm over all ranks' shards; returns the norm before clipping.

    FSDP2 gradients are DTensors: the per-tensor norms combine into a partial DTensor, and ``full_tensor()`` reduces
    it across ranks, so every rank scales by the same global norm.  A non-finite norm is returned as is (the
    caller decides to skip the step); the gradients are then scaled by a NaN/0 factor.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total.item())
