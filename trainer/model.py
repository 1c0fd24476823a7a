"""The trainer's models: the actor, the KL reference and the critic, each built from an HF model directory and
sharded over all ranks (``build_actor``, ``build_reference``, ``build_critic``).

The parts they are made of live beside this module: ``trainer/sharding.py`` (HF load, FSDP2 sharding),
``trainer/attention.py`` (attention over packed rows), ``trainer/logprobs.py`` (the ``Actor`` wrapper and chunked
token logprobs) and ``trainer/optim.py`` (optimizer, schedule, gradient clip); their public names are re-exported
here for the code that imports them from ``trainer.model``.

The ``Critic`` is a root wrapper like the ``Actor``: its ``forward`` runs the base model and the value head, so FSDP's
hooks surround both.  Call ``trainer.dist.init()`` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer import sequence_parallel as seqpar
from trainer.attention import (
    PACKED_ATTENTION,
    PackedRow,
    pack,
    packed_row,
    packing_kwargs,
    unpack,
    use_packed_attention,
)
from trainer.logprobs import Actor, batch_logprobs, head_logprobs_and_entropy, token_logprobs_and_entropy
from trainer.lora import maybe_lora
from trainer.optim import Schedule, build_optimizer, build_scheduler, clip_grad_norm_, lr_factor
from trainer.sharding import (
    Kernels,
    ParamDtype,
    decoder_layers,
    load_causal_lm,
    load_once,
    reads_weights,
    reshard,
    resolve_param_dtype,
    shard,
)


def build_actor(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    checkpoint_skip: int = 0,
    cpu_offload: bool = False,
    kernels: Kernels = "eager",
    prefetch: int = 1,
    lora: Any = None,
) -> Actor:
    """The trainable actor, sharded over all ranks, in train mode; ``lora`` (``model.lora``) with rank > 0 puts
    LoRA adapters on a frozen base (``trainer/lora.py``)."""
    lm = load_causal_lm(model_dir, weights=reads_weights())
    return shard_actor(
        maybe_lora(lm, lora, param_dtype, device, "model.lora"),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
        activation_offload=activation_offload,
        checkpoint_skip=checkpoint_skip,
        cpu_offload=cpu_offload,
        kernels=kernels,
        prefetch=prefetch,
    )


def shard_actor(
    lm: Any,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    checkpoint_skip: int = 0,
    cpu_offload: bool = False,
    kernels: Kernels = "eager",
    prefetch: int = 1,
) -> Actor:
    """Wrap an already built HF causal LM (fp32 on CPU or ``device``; on the meta device on ranks other than 0, see
    ``load_once``) as a sharded ``Actor``."""
    actor = Actor(lm)
    load_once(
        actor,
        decoder_layers(lm.base_model),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
        activation_offload=activation_offload,
        checkpoint_skip=checkpoint_skip,
        cpu_offload=cpu_offload,
        kernels=kernels,
        prefetch=prefetch,
    )
    return actor.train()


def build_reference(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    cpu_offload: bool = False,
    kernels: Kernels = "eager",
    prefetch: int = 1,
) -> Actor:
    """A frozen copy of the actor's base (KL reference): sharded like the actor, no grad, eval mode."""
    lm = load_causal_lm(model_dir, weights=reads_weights())
    lm.requires_grad_(False)
    actor = shard_actor(
        lm, device, param_dtype=param_dtype, cpu_offload=cpu_offload, kernels=kernels, prefetch=prefetch
    )
    return actor.eval()


class Critic(nn.Module):
    """A value model: an HF base model and a ``Linear(hidden, 1)`` head on its last hidden state; the root unit."""

    def __init__(self, base: Any, hidden_size: int):
        super().__init__()
        self.base: Any = base
        use_packed_attention(base)
        # on the base's device: the meta device on ranks that receive their weights from rank 0 (``load_once``)
        self.value_head = nn.Linear(hidden_size, 1, device=next(base.parameters()).device)
        # Values start at 0: early advantages are then the returns themselves, not a random head's noise.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        packed: PackedRow | None = None,
        shard: seqpar.Shard | None = None,
    ) -> torch.Tensor:
        if shard is not None:  # this rank's chunk of a packed row; the other inputs are not read
            h = self.base(
                input_ids=shard.ids,
                position_ids=shard.positions,
                use_cache=False,
                **packing_kwargs(self.base.config, shard.positions, shard.row),
            ).last_hidden_state
            # gathered before the shift below, which crosses chunk boundaries
            v = seqpar.gather_positions(self.value_head(h).squeeze(-1).float(), shard)
            return F.pad(v[:, :-1], (1, 0)).masked_fill(shard.positions_full == 0, 0.0)
        h = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **packing_kwargs(self.base.config, position_ids, packed),
        ).last_hidden_state
        v = self.value_head(h).squeeze(-1).float()
        # Aligned with token_logprobs_and_entropy: values[b, t] is the value of the state in which token t is chosen
        # (the prefix before t), so it reads the hidden state at t - 1; nothing precedes t = 0 (nor, in a packed row,
        # a position id 0: the state before it belongs to another sequence).
        v = F.pad(v[:, :-1], (1, 0))
        return v if position_ids is None else v.masked_fill(position_ids == 0, 0.0)

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        packed: PackedRow | None = None,
        shard: seqpar.Shard | None = None,
    ) -> torch.Tensor:
        """[B, T] fp32 values (see ``forward``); with FSDP call this, not ``self.base``, so the hooks run."""
        out = self(input_ids, attention_mask, position_ids, packed, shard)
        if not torch.is_grad_enabled():
            reshard(self)
        return out


def batch_values(
    critic: Critic, batch: dict[str, torch.Tensor], sp: seqpar.SPGroup | None = None
) -> torch.Tensor:
    """The critic's values of a collated micro-batch, packed or padded: [B, T] in the padded layout, 0 on padding
    when packed (with or without grad).  ``sp``: the sequence-parallel group of a packed micro-batch (every rank
    returns the whole micro-batch's values)."""
    if "packed_ids" not in batch:
        return critic.values(batch["input_ids"], batch["attention_mask"])
    if sp is not None:
        # the critic keeps a value at every position: ``want`` is not read
        want = pack(batch["response_mask"], batch)
        shard = seqpar.split(batch["packed_ids"], batch["packed_positions"], want, packed_row(batch), sp)
        return unpack(critic.values(shard.ids, shard=shard), batch)
    v = critic.values(batch["packed_ids"], None, batch["packed_positions"], packed_row(batch))
    return unpack(v, batch)


def build_critic(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    checkpoint_skip: int = 0,
    cpu_offload: bool = False,
    kernels: Kernels = "eager",
    prefetch: int = 1,
    lora: Any = None,
) -> Critic:
    """A critic on a copy of the base model in ``model_dir`` (its LM head dropped), sharded over all ranks;
    ``lora`` (``trainer.critic_lora``) with rank > 0: LoRA adapters on its frozen base, the value head trains."""
    lm: Any = load_causal_lm(model_dir, weights=reads_weights())
    lm = maybe_lora(lm, lora, param_dtype, device, "trainer.critic_lora")
    base = lm.base_model
    critic = Critic(base, int(lm.config.hidden_size))
    del lm
    load_once(
        critic,
        decoder_layers(base),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
        activation_offload=activation_offload,
        checkpoint_skip=checkpoint_skip,
        cpu_offload=cpu_offload,
        kernels=kernels,
        prefetch=prefetch,
    )
    return critic.train()


def hf_module(model: nn.Module) -> nn.Module:
    """The HF model inside an ``Actor`` (the model itself otherwise): the module whose names are HF names."""
    return model.lm if isinstance(model, Actor) else model


__all__ = [  # the names importers of trainer.model use, wherever they now live
    "PACKED_ATTENTION",
    "Actor",
    "Critic",
    "PackedRow",
    "ParamDtype",
    "Schedule",
    "batch_logprobs",
    "batch_values",
    "build_actor",
    "build_critic",
    "build_optimizer",
    "build_reference",
    "build_scheduler",
    "clip_grad_norm_",
    "decoder_layers",
    "head_logprobs_and_entropy",
    "hf_module",
    "load_causal_lm",
    "load_once",
    "lr_factor",
    "pack",
    "packed_row",
    "reads_weights",
    "reshard",
    "resolve_param_dtype",
    "shard",
    "shard_actor",
    "token_logprobs_and_entropy",
    "unpack",
    "use_packed_attention",
]
