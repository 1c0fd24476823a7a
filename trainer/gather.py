"""Every weight of the FSDP2-sharded actor to one owner rank, and the owner's bytes into one host buffer: the device
half of a publish (``trainer/publish.py`` says the whole protocol).

Each weight (HF name, wrapper prefixes stripped; a tied LM head's alias dropped) goes to one owner, largest first to
the rank with the fewest bytes so far.  Each rank casts its local shards to the publish dtype before any
communication, then one ``all_to_all`` per bucket sends every shard straight to its tensor's owner, so a rank
receives only the rows it owns and the bytes travel in the publish dtype.  A LoRA actor's merged version adds
alpha/r * B @ A on the owning rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from buffer.weights import WeightsError
from trainer import dist as tdist
from trainer import lora as tlora
from trainer.model import hf_module
from trainer.st_files import as_bytes, host_buffer

# Name components added by wrappers around HF modules (activation checkpointing, FSDP1, torch.compile).
_WRAPPER_PARTS = {"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"}


@dataclass
class Item:
    name: str  # HF name
    tensor: torch.Tensor  # a DTensor, or a plain tensor that every rank holds in full
    shape: tuple[int, ...]
    dtype: torch.dtype  # as written
    nbytes: int
    sharded: bool = False  # Shard(0) over all ranks in rank order: takes the all_to_all path
    owner: int = 0
    rows: list[int] = field(default_factory=list)  # sharded: dim-0 rows held by each rank
    merge: tuple[torch.Tensor, torch.Tensor, float] | None = None  # LoRA (A, B, scale) added on publishing

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


def hf_name(name: str) -> str:
    """A parameter name without wrapper components (``layers.0._checkpoint_wrapped_module.mlp`` -> ``layers.0.mlp``)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def shard_file_name(rank: int, world: int) -> str:
    return f"model-{rank + 1:05d}-of-{world:05d}.safetensors"


def assign_owners(sizes: list[int], world: int) -> list[int]:
    """Greedy largest-first: each tensor (in order of decreasing size) goes to the rank with the fewest bytes."""
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


def _is_row_sharded(t: torch.Tensor, world: int) -> bool:
    if not isinstance(t, DTensor) or t.ndim == 0:
        return False
    mesh = t.device_mesh
    return (
        mesh.ndim == 1
        and mesh.mesh.tolist() == list(range(world))
        and len(t.placements) == 1
        and t.placements[0] == Shard(0)
    )


def _merges(hf: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{HF name of a base weight: (lora_A, lora_B, scale)}`` of every LoRA layer (empty without LoRA)."""
    if not tlora.has_adapters(hf):
        return {}
    out = {}
    for name, layer in tlora.lora_layers(hf):
        a = layer.lora_A[tlora.ADAPTER].weight
        b = layer.lora_B[tlora.ADAPTER].weight
        out[hf_name(f"{name}.weight")] = (a.detach(), b.detach(), tlora.adapter_scale(layer))
    return out


def collect(model: nn.Module, dtype: torch.dtype, tied: bool, world: int) -> list[Item]:
    """Every tensor to publish, in module order (the same on every rank); LoRA layers merged into their base."""
    hf = hf_module(model)
    merges = _merges(hf)
    named: list[tuple[str, torch.Tensor]] = list(
        hf.named_parameters()
    )  # shared (tied) parameters appear once
    for mod_name, mod in hf.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                named.append((f"{mod_name}.{b_name}" if mod_name else b_name, b))
    items: list[Item] = []
    seen: set[str] = set()
    for raw, t in named:
        name = tlora.base_name(hf_name(raw))
        if tlora.is_adapter_param(name):
            continue  # merged into its base weight
        if tied and name == "lm_head.weight":
            continue  # the alias of the embedding; HF re-ties it on load
        if name in seen:
            raise WeightsError(f"publish: two tensors map to the HF name {name!r}")
        seen.add(name)
        out_dtype = dtype if t.is_floating_point() else t.dtype
        shape = tuple(int(s) for s in t.shape)
        nbytes = out_dtype.itemsize * (int(torch.Size(shape).numel()))
        items.append(Item(name, t.detach(), shape, out_dtype, nbytes, _is_row_sharded(t, world)))
        items[-1].merge = merges.get(name)
    return items


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    return cast(DTensor, t).full_tensor() if isinstance(t, DTensor) else t


def _merged(
    base: torch.Tensor, merge: tuple[torch.Tensor, torch.Tensor, float], b_rows: torch.Tensor
) -> torch.Tensor:
    """``base + scale * B @ A`` in fp32, for ``base`` rows and the matching rows ``b_rows`` of B.  Gathers A: a
    collective, which every rank runs for the same items in the same order."""
    a, _, scale = merge
    a_full = full_tensor(a).float()
    if b_rows.shape[0] != base.shape[0]:
        raise WeightsError(
            f"publish: LoRA B has {b_rows.shape[0]} local rows against {base.shape[0]} of its base"
        )
    return base.float() + scale * (b_rows.float() @ a_full)


def _local(it: Item) -> torch.Tensor:
    """This rank's rows of a row-sharded item as published (merged with its adapter when it has one)."""
    local = it.tensor.to_local()  # type: ignore[attr-defined]
    if it.merge is None:
        return local
    b = it.merge[1]
    return _merged(local, it.merge, b.to_local() if isinstance(b, DTensor) else b)


def _whole(it: Item) -> torch.Tensor:
    """A non-row-sharded item in full, in its publish dtype (collective for DTensors)."""
    if it.merge is None:
        t = it.tensor
        return cast(DTensor, t.to(it.dtype)).full_tensor() if isinstance(t, DTensor) else t
    return _merged(full_tensor(it.tensor), it.merge, full_tensor(it.merge[1])).to(it.dtype)


def plan_buckets(items: list[Item], world: int, bucket_bytes: int) -> list[list[Item]]:
    """Fill in owners and per-rank rows; return the sharded items grouped into exchange buckets."""
    for item, owner in zip(items, assign_owners([it.nbytes for it in items], world), strict=True):
        item.owner = owner
    sharded = [it for it in items if it.sharded]
    local_rows = [it.tensor.to_local().shape[0] for it in sharded]  # type: ignore[attr-defined]
    all_rows = tdist.all_gather_object(local_rows)
    for i, it in enumerate(sharded):
        it.rows = [all_rows[r][i] for r in range(world)]
        if sum(it.rows) != it.shape[0]:
            raise WeightsError(f"publish: shards of {it.name} have {it.rows} rows, expected {it.shape[0]}")
    buckets: list[list[Item]] = []
    size = 0
    for it in sharded:
        if not buckets or size + it.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(it)
        size += it.nbytes
    return buckets


def exchange(bucket: list[Item], me: int, world: int, device: torch.device) -> torch.Tensor:
    """One all_to_all: every rank sends its rows of each tensor to the tensor's owner.  Returns this rank's owned
    tensors of the bucket, whole and back to back in bucket order, as uint8 on ``device``."""
    by_dst: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for it in bucket:
        # to the device: with trainer.cpu_offload the shards live in host memory, the collective runs on the device
        by_dst[it.owner].append(as_bytes(_local(it), it.dtype).to(device, non_blocking=True))
    in_splits = [sum(b.numel() for b in blocks) for blocks in by_dst]
    mine = [it for it in bucket if it.owner == me]
    out_splits = [sum(it.rows[src] * it.row_bytes for it in mine) for src in range(world)]
    send = torch.cat([b for blocks in by_dst for b in blocks]) if any(in_splits) else None
    if world == 1:
        recv = send if send is not None else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        if send is None:
            send = torch.empty(0, dtype=torch.uint8, device=device)
        recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(recv, send, out_splits, in_splits)
    if not mine:
        return recv
    # recv is grouped by source rank; a tensor's rows are its pieces from rank 0, 1, ... in that order.
    pieces: list[list[torch.Tensor]] = []
    for src, part in enumerate(recv.split(out_splits)):
        pieces.append(list(part.split([it.rows[src] * it.row_bytes for it in mine])))
    return torch.cat([pieces[src][j] for j in range(len(mine)) for src in range(world)])


def stage_rank_bytes(
    items: list[Item], buckets: list[list[Item]], device: torch.device
) -> tuple[list[Item], torch.Tensor | None]:
    """Gather this rank's tensors into host memory, back to back in file order: (those tensors, their bytes).

    Every rank runs the same sequence of collectives, owner or not.  The bytes are a copy (never a view of a
    parameter), so the model may train on while they are written.
    """
    me, world = tdist.rank(), tdist.world()
    loose = [it for it in items if not it.sharded]
    order = [it for it in loose if it.owner == me] + [it for b in buckets for it in b if it.owner == me]
    host = host_buffer(device, sum(it.nbytes for it in order)) if order else None
    offset = 0

    def put(block: torch.Tensor) -> None:
        nonlocal offset
        assert host is not None
        host[offset : offset + block.numel()].copy_(block, non_blocking=True)
        offset += block.numel()

    for it in loose:  # plain tensors (every rank holds them) and DTensors of another layout: rare and small
        full = _whole(it)
        if it.owner == me:
            put(as_bytes(full, it.dtype))
    for bucket in buckets:
        block = exchange(bucket, me, world, device)
        if block.numel():
            put(block)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the copies into pinned memory are asynchronous
    return order, host
