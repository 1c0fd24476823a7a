"""Loading an HF causal LM and sharding it with FSDP2 over every rank of the default process group.

Sharding follows one order: the decoder layers' forwards compiled (``trainer.kernels``), activation checkpointing on
each decoder layer, then ``fully_shard`` on each decoder layer, then on the root.  Every unit gets the same
``MixedPrecisionPolicy`` (mixing policies fails with a dtype mismatch).  Embeddings, the final norm and the LM head stay in the root unit, which keeps a tied LM head with its
embedding (sharding them apart raises on torch >= 2.13 and silently unties on 2.11).

Call ``trainer.dist.init()`` first: ``shard`` uses the default process group, which exists also for a single process
started without torchrun.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from trainer.activations import checkpoint_layers

log = logging.getLogger(__name__)
ParamDtype = Literal["auto", "float32", "bfloat16"]
Kernels = Literal["auto", "eager", "compile"]


def resolve_param_dtype(param_dtype: ParamDtype, device: torch.device) -> torch.dtype:
    """The FSDP compute dtype: ``auto`` is bf16 on GPU and fp32 on CPU (master weights are always fp32)."""
    if param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if param_dtype == "float32":
        return torch.float32
    if param_dtype == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"param_dtype: {param_dtype!r} is not one of auto, float32, bfloat16")


def resolve_kernels(kernels: Kernels, device: torch.device) -> Literal["eager", "compile"]:
    """``auto`` compiles on CUDA (Triton kernels) and stays eager elsewhere: on a CPU the compile (about 11 s for the
    tiny model, and again at the second length) costs more than a CPU run's short steps would save.

    Compiled kernels are built with the node's C compiler: without one, ``auto`` stays eager (and says so) and
    ``compile`` is refused in one line, before the first step would fail deep inside the compiler."""
    if kernels == "eager" or (kernels == "auto" and device.type != "cuda"):
        return "eager"
    if shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc") or shutil.which("clang"):
        return "compile"
    if kernels == "compile":
        raise RuntimeError(
            'trainer.kernels = "compile" needs a C compiler on this node (cc, gcc or clang; Triton and inductor '
            'build kernels with it): install one or set trainer.kernels = "eager"'
        )
    log.warning("trainer.kernels = auto: no C compiler on this node (cc, gcc or clang), eager kernels")
    return "eager"


def compile_layers(layers: nn.ModuleList) -> None:
    """Compile each decoder layer's forward in place (inductor fuses RMSNorm, the SwiGLU MLP's elementwise product
    and the rotary embedding into a few kernels each).

    The layer's own ``forward`` is replaced, not the module: parameter names stay those of the HF model (a wrapping
    ``OptimizedModule`` would prefix them ``_orig_mod.``, breaking checkpoints and published weights), and the FSDP
    unit and the checkpoint wrapper built around the layer afterwards keep their hooks outside the compiled code.
    Lengths change with every packed micro-batch: the second length seen recompiles once with dynamic shapes."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]


def load_causal_lm(model_dir: str | Path, *, weights: bool = True) -> nn.Module:
    """An HF causal LM from ``model_dir`` in fp32 on the CPU (FSDP moves each unit's shard to the device);
    ``weights=False``: the same model built from its config on the meta device (nothing read, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not an HF model directory (no config.json); check model.path")
    if weights:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)


def reads_weights() -> bool:
    """Whether this rank reads model weights from disk: only rank 0 does; the others build on the meta device and
    receive their shards from it (``load_once``), so a node holds one host copy of a model, not one per rank."""
    return not dist.is_initialized() or dist.get_rank() == 0


def load_once(root: nn.Module, layers: nn.ModuleList, device: torch.device, **sharding: Any) -> None:
    """``shard`` (with ``sharding``, its keyword arguments) a model that holds its weights on rank 0 and is on the
    meta device elsewhere, then give every rank its shards from rank 0's full state dict.

    Buffers are broadcast too: non-persistent ones (rotary ``inv_freq``) are in no state dict, and a meta rank's
    ``to_empty`` leaves them uninitialised.
    """
    single = dist.get_world_size() == 1
    # rank 0's weights as they are (fp32; a frozen LoRA base in the compute dtype)
    full = root.state_dict() if reads_weights() and not single else None
    shard(root, layers, device, **sharding)
    if single:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in root.parameters()):  # offloaded shards live in host memory
        root.to_empty(device="cpu" if sharding.get("cpu_offload") else device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(root, full or {}, options=options)
    del full
    for buf in root.buffers():
        dist.broadcast(buf, src=0)


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
    activation_offload: bool = False,
    checkpoint_skip: int = 0,
    cpu_offload: bool = False,
    kernels: Kernels = "eager",
    prefetch: int = 1,
) -> None:
    """Compile the layers (``kernels``, see ``compile_layers``), apply activation checkpointing (with each layer's
    saved input in host memory when ``activation_offload``, and ``checkpoint_skip`` layers left out, see
    ``trainer/activations.py``), then ``fully_shard``
    per layer, then on ``root``, over all ranks (in place).

    ``cpu_offload``: every unit keeps its shards (parameters, gradients, hence the optimizer state) in host memory,
    pinned on GPU so the copies around each unit's compute are asynchronous; the optimizer steps on the CPU.
    ``prefetch``: decoder layers whose all-gathers are in flight ahead of the one computing (``set_prefetch``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("trainer.model: call trainer.dist.init() before building a sharded model")
    if resolve_kernels(kernels, device) == "compile":
        compile_layers(layers)
    if activation_checkpointing:
        checkpoint_layers(layers, skip=checkpoint_skip, offload=activation_offload)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=resolve_param_dtype(param_dtype, device), reduce_dtype=torch.float32
    )
    # CPU-only machines cannot pin memory
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(root, mesh=mesh, mp_policy=policy, offload_policy=offload)
    set_prefetch(list(layers), prefetch)


def set_prefetch(units: list[Any], depth: int) -> None:
    """Have each sharded decoder layer start the all-gathers of the ``depth`` layers after it in forward, and of the
    ``depth`` layers before it in backward, as soon as its own gather has landed (``trainer.fsdp_prefetch``).

    ``depth`` 1 keeps FSDP2's own order, which already overlaps one gather with compute: the next layer's gather is
    issued when that layer's hook runs. Issuing earlier matters where the CPU runs behind the GPU (hooks,
    checkpointing, small layers), and each extra layer in flight holds its gathered parameters until used.
    A recompute under activation checkpointing prefetches nothing: FSDP2 skips the hook's prefetch in backward."""
    if depth <= 1:
        return
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        unit.set_modules_to_backward_prefetch(units[max(0, i - depth) : i][::-1])


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit (the root keeps them after a forward without backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
