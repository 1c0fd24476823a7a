"""torch.distributed set-up for the trainer: one process per device, under torchrun or alone.

Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) ``init()`` joins the job's process group
through ``env://``.  Started as a plain ``python`` process it builds a one-rank group on an in-process store, so
FSDP2, DCP and every collective below run the same code path at world size 1 and nothing needs a port.

The backend follows the device: NCCL for CUDA tensors (with gloo beside it for CPU tensors and object collectives),
gloo alone on a machine without GPUs.  The helpers also work before ``init()`` (world size 1, no communication), so
single-process tools and unit tests can call them freely.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal, TypeVar, overload

import torch
import torch.distributed as dist

T = TypeVar("T")

DeviceChoice = Literal["auto", "cpu", "cuda"]

_device: torch.device | None = None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init(device: DeviceChoice = "auto", *, timeout_s: float = 1800.0) -> torch.device:
    """Join (or create) the process group and return this rank's device; idempotent.

    ``device="auto"`` takes ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU.
    """
    global _device
    if dist.is_available() and dist.is_initialized():
        return current_device()
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("trainer device: cuda was asked for but torch sees no CUDA device")
    local_rank = _env_int("LOCAL_RANK", 0)
    if use_cuda:
        _device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(_device)
        backend = "cpu:gloo,cuda:nccl"
    else:
        _device = torch.device("cpu")
        backend = "gloo"
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if use_cuda:
        kwargs["device_id"] = (
            _device  # binds NCCL to this device now instead of guessing at the first collective
        )
    if under_torchrun():
        dist.init_process_group(init_method="env://", **kwargs)
    else:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return _device


def teardown() -> None:
    """Leave the process group (after a barrier, so no rank exits while another still talks to it)."""
    global _device
    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
    _device = None


def current_device() -> torch.device:
    """This rank's device: the one ``init`` chose, else what ``init("auto")`` would choose."""
    if _device is not None:
        return _device
    if torch.cuda.is_available():
        return torch.device("cuda", _env_int("LOCAL_RANK", 0) % torch.cuda.device_count())
    return torch.device("cpu")


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _active() else 0


def world() -> int:
    return dist.get_world_size() if _active() else 1


def local_rank() -> int:
    return _env_int("LOCAL_RANK", 0)


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if _active() and world() > 1:
        dist.barrier()


@overload
def all_reduce_sum(value: float) -> float: ...
@overload
def all_reduce_sum(value: torch.Tensor) -> torch.Tensor: ...
def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """Sum over ranks.  A float comes back as a float; a tensor is reduced in place and returned."""
    if isinstance(value, torch.Tensor):
        if _active() and world() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value
    if not (_active() and world() > 1):
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def all_reduce_max(value: float) -> float:
    """Maximum over ranks (e.g. to agree on a micro-batch count so that no rank skips a collective)."""
    if not (_active() and world() > 1):
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def broadcast_object(obj: T, src: int = 0) -> T:
    """``obj`` as rank ``src`` has it, on every rank (picklable objects, small ones)."""
    if not (_active() and world() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj``, indexed by rank."""
    if not (_active() and world() > 1):
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def _collective_device() -> torch.device:
    # The default group has gloo for CPU tensors on every backend we create, so small scalars stay on the CPU.
    return torch.device("cpu")
