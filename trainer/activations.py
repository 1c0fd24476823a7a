"""Activation checkpointing of the decoder layers, optionally with each layer's input kept in host memory.

Checkpointing a layer keeps only its input for backward and recomputes the rest; at long sequences those inputs are
what grows with the tokens (a 7B model's 28 layers x 3584 hidden x 2 bytes: 200 KB a token, 19 GB at 96k tokens).
``trainer.activation_offload`` moves them to host memory as they are saved and back when backward recomputes the
layer, so the GPU holds one layer's input at a time instead of all of them.

How: the non-reentrant checkpoint saves its inputs as saved tensors *before* it installs its own hooks, so a
saved-tensor hook installed around the checkpoint sees exactly those inputs (every tensor saved inside the layer goes
to the checkpoint's own hooks).  The hook moves only the layer's hidden states; the rotary tables and masks that every
layer shares stay where they are.  The wrapper is torch's ``CheckpointWrapper``, so parameter names, checkpoints and
published weights are those of plain activation checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _OnHost:
    """A saved tensor's host copy and the device it came from."""

    host: torch.Tensor
    device: torch.device


class _HiddenStatesOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors that are ``target`` are copied to host memory (pinned when they come from a GPU, so that the
    copies are asynchronous on the compute stream); any other saved tensor is kept as it is."""

    def __init__(self, target: torch.Tensor) -> None:
        # weakly: these hooks live as long as the graph, and a strong reference would keep the GPU input alive
        target_ref = weakref.ref(target)

        def pack(t: torch.Tensor) -> Any:
            if t is not target_ref():
                return t
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            # Ordered on the compute stream: the GPU block is reused only by work queued after this copy.
            host.copy_(t, non_blocking=t.is_cuda)
            return _OnHost(host, t.device)

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, _OnHost):
                return saved.host.to(saved.device, non_blocking=saved.host.is_pinned())
            return saved

        super().__init__(pack, unpack)


def _checkpoint_with_input_on_host(fn: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``checkpoint(fn, ...)`` whose first argument (the layer's hidden states) is kept in host memory.

    Only a positional input can move: the checkpoint keeps its keyword arguments in a plain dict beside the graph,
    where no saved-tensor hook sees them.  HF decoder layers take their hidden states positionally; a layer that
    does not is run with plain checkpointing, and says so once."""
    hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if torch.is_grad_enabled():
        if args and isinstance(args[0], torch.Tensor):
            hooks = _HiddenStatesOnHost(args[0])
        else:
            _warn_keyword_input(type(fn).__name__)
    with hooks:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)


@functools.cache
def _warn_keyword_input(layer_class: str) -> None:
    log.warning(
        "trainer.activation_offload: %s takes its hidden states by keyword; its checkpointed inputs stay on the device",
        layer_class,
    )


def kept_layers(n: int, skip: int) -> set[int]:
    """The indices of the ``skip`` decoder layers, of ``n``, that keep their activations instead of being
    checkpointed (``trainer.activation_checkpointing_skip``), spread evenly over the depth.

    Where they sit does not change the peak (every kept layer's activations live from its forward to its backward),
    but spreading them keeps the recompute, and the host copies under ``activation_offload``, evenly interleaved
    with the layers that need none."""
    if not 0 <= skip <= n:
        raise ValueError(
            f"trainer.activation_checkpointing_skip = {skip}: the model has {n} decoder layers; accepted: 0..{n}"
        )
    return {int((j + 0.5) * n / skip) for j in range(skip)}


def checkpoint_layers(layers: nn.ModuleList, *, skip: int = 0, offload: bool = False) -> None:
    """Put every decoder layer of ``layers`` under activation checkpointing (in place), but for ``skip`` of them
    (``kept_layers``): each layer kept saves one layer's forward in backward and holds that layer's activations for
    a whole micro-batch, which is how a step with memory to spare trades it for speed."""
    kept = kept_layers(len(layers), skip)
    for i, layer in enumerate(layers):
        if i not in kept:
            layers[i] = checkpointed(layer, offload=offload)


def checkpointed(layer: nn.Module, *, offload: bool = False) -> nn.Module:
    """``layer`` under non-reentrant activation checkpointing; ``offload``: its saved input in host memory."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if not offload:
        return checkpoint_wrapper(layer)
    return checkpoint_wrapper(layer, checkpoint_fn=_checkpoint_with_input_on_host)
