"""Publish the FSDP2-sharded actor as an HF safetensors directory, written by all ranks in parallel.

Called on every rank (``publish_weights``); nothing is gathered whole on one rank:

1. Every weight (HF name, wrapper prefixes stripped; a tied LM head's alias dropped) is given to one owner rank,
   largest first to the rank with the fewest bytes so far, so each rank writes about 1/world of the bytes.
2. Each rank casts its local shards to the publish dtype *before* any communication, then one ``all_to_all`` per
   bucket (about ``bucket_bytes`` of weights) sends every shard straight to its tensor's owner.  A rank thus receives
   only the rows of the tensors it owns (about model/world bytes) instead of the whole model, as ``full_tensor()`` per
   tensor would do on every rank, and the bytes travel in the (half-size, for bf16) publish dtype.
3. The owner reassembles its tensors into one host buffer (pinned on GPU, reused across publishes), in the order of
   its own ``model-RRRRR-of-WWWWW.safetensors``.  That is the end of the device work (``stage_weights``).
4. Each rank streams its buffer into its file (the header is known from the shapes up front; a writer thread and a
   hashing thread work side by side); rank 0 writes the index, ``config.json`` (dtype set to the publish dtype), the
   generation config and tokenizer files, and calls ``buffer.weights.commit_version`` (manifest last, rename,
   LATEST) with every rank's file digest (``write_staged``).  The trainer's loop runs this half in a thread, over a
   process group of its own, while the next step computes.

With LoRA (``trainer/lora.py``) a version is the adapter alone: ``adapter_config.json`` and
``adapter_model.safetensors`` under peft's names, gathered to rank 0 (a few MB to a few hundred MB: not worth the
parallel writer), committed through the same staging / manifest-last / LATEST protocol with ``kind = adapter``, the
base model's path and ``buffer.weights.base_model_hash``.  A *merged* version (``model.lora.merge_every``, and the
end of a run) is full weights, base + alpha/r * B @ A computed shard by shard on the owning rows (A is gathered, it is
rank x in), written by the parallel writer above, with the same adapter in ``adapter/`` so LoRA workers keep serving
adapters on their unchanged base.

Delta versions (``trainer.publish_full_every`` > 1).  After a full version is committed, each rank keeps a host copy
of the bytes it wrote (its 1/world share of the model: with deltas on, each rank holds that much host memory more).
A later version is then published as a delta against it (``buffer/deltas.py``) when every rank has that base and the
same file header (same tensors, same owners): each rank XORs its new bytes with the kept ones and writes the
compressed result instead of its safetensors file, hashing the full bytes as it goes; rank 0 writes ``delta.json``
with every rank's entry, sealed by the manifest like any file.  A rank without the base (a restarted trainer) makes
every rank publish in full.  Adapter and merged LoRA versions are always full.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from buffer import deltas
from buffer.config import AdapterConfig
from buffer.layout import RunLayout
from buffer.plans import FencedError
from buffer.weights import WeightsError, base_model_hash, commit_version, staging_dir
from trainer import dist as tdist
from trainer import lora as tlora
from trainer.delta_base import DeltaBase
from trainer.model import hf_module, reshard
from trainer.st_files import as_bytes, host_buffer, safetensors_header, write_rank_file

PUBLISH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Name components added by wrappers around HF modules (activation checkpointing, FSDP1, torch.compile).
_WRAPPER_PARTS = {"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"}
# Files of a source model directory that are not copied: the weights (we write our own), their index and config.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIP_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "manifest.json"}
INDEX = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"  # the adapter inside a merged full version


@dataclass
class _Item:
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


def _collect(model: nn.Module, dtype: torch.dtype, tied: bool, world: int) -> list[_Item]:
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
    items: list[_Item] = []
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
        items.append(_Item(name, t.detach(), shape, out_dtype, nbytes, _is_row_sharded(t, world)))
        items[-1].merge = merges.get(name)
    return items


def _full(t: torch.Tensor) -> torch.Tensor:
    return cast(DTensor, t).full_tensor() if isinstance(t, DTensor) else t


def _merged(
    base: torch.Tensor, merge: tuple[torch.Tensor, torch.Tensor, float], b_rows: torch.Tensor
) -> torch.Tensor:
    """``base + scale * B @ A`` in fp32, for ``base`` rows and the matching rows ``b_rows`` of B.  Gathers A: a
    collective, which every rank runs for the same items in the same order."""
    a, _, scale = merge
    a_full = _full(a).float()
    if b_rows.shape[0] != base.shape[0]:
        raise WeightsError(
            f"publish: LoRA B has {b_rows.shape[0]} local rows against {base.shape[0]} of its base"
        )
    return base.float() + scale * (b_rows.float() @ a_full)


def _local(it: _Item) -> torch.Tensor:
    """This rank's rows of a row-sharded item as published (merged with its adapter when it has one)."""
    local = it.tensor.to_local()  # type: ignore[attr-defined]
    if it.merge is None:
        return local
    b = it.merge[1]
    return _merged(local, it.merge, b.to_local() if isinstance(b, DTensor) else b)


def _whole(it: _Item) -> torch.Tensor:
    """A non-row-sharded item in full, in its publish dtype (collective for DTensors)."""
    if it.merge is None:
        t = it.tensor
        return cast(DTensor, t.to(it.dtype)).full_tensor() if isinstance(t, DTensor) else t
    return _merged(_full(it.tensor), it.merge, _full(it.merge[1])).to(it.dtype)


def _plan(items: list[_Item], world: int, bucket_bytes: int) -> list[list[_Item]]:
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
    buckets: list[list[_Item]] = []
    size = 0
    for it in sharded:
        if not buckets or size + it.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(it)
        size += it.nbytes
    return buckets


def _exchange(bucket: list[_Item], me: int, world: int, device: torch.device) -> torch.Tensor:
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


def _stage_rank_bytes(
    items: list[_Item], buckets: list[list[_Item]], device: torch.device
) -> tuple[list[_Item], torch.Tensor | None]:
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
        block = _exchange(bucket, me, world, device)
        if block.numel():
            put(block)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the copies into pinned memory are asynchronous
    return order, host


def _fresh_staging(layout: RunLayout, version: int) -> Path:
    """The staging directory, emptied by rank 0 (a publisher that died may have left files of another world size).
    A storage error there (a full disk) is raised on every rank alike."""
    error = None
    if tdist.is_main():
        try:
            if layout.weight_version(version).exists():
                error = f"{layout.weight_version(version)}: version {version} is already published"
            else:
                d = staging_dir(layout, version)
                if any(d.iterdir()):
                    shutil.rmtree(d)
        except OSError as e:
            error = f"staging version {version}: {e}"
    error = tdist.broadcast_object(error)
    if error:
        raise WeightsError(error)
    tdist.barrier()
    return staging_dir(layout, version)


def _index(items: list[_Item], world: int) -> dict[str, Any]:
    weight_map = {it.name: shard_file_name(it.owner, world) for it in items}
    return {"metadata": {"total_size": sum(it.nbytes for it in items)}, "weight_map": weight_map}


def _write_metadata(staging: Path, index: dict[str, Any], dtype: str, src_model_dir: Path) -> None:
    """Rank 0: index (weight_map), config.json with the publish dtype, generation config and tokenizer files."""
    (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    src = Path(src_model_dir)
    try:
        config = json.loads((src / "config.json").read_text())
    except FileNotFoundError:
        raise WeightsError(
            f"{src / 'config.json'}: missing; src_model_dir must be the HF base model"
        ) from None
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in sorted(src.iterdir()):
        skip = f.name.startswith(".") or f.name in _SKIP_NAMES or f.name.endswith(_SKIP_SUFFIXES)
        if f.is_file() and not skip:
            shutil.copyfile(f, staging / f.name)


def _gather_adapter(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every adapter tensor under peft's name, gathered to rank 0 (collective) as host copies; None elsewhere."""
    tensors: dict[str, torch.Tensor] = {}
    for raw, p in hf_module(model).named_parameters():
        name = hf_name(raw)
        if tlora.is_adapter_param(name):
            full = _full(p.detach())  # every rank, same order
            if tdist.is_main():
                tensors[tlora.peft_name(name)] = full.to(dtype).cpu().contiguous().clone()
    if not tdist.is_main():
        return None
    if not tensors:
        raise WeightsError("publish: model.lora is on but the model has no LoRA adapter parameters")
    return tensors


def _save_adapter(tensors: dict[str, torch.Tensor], out: Path, lora: AdapterConfig, base: Path) -> None:
    """Rank 0: peft's two files of the adapter into ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    for fname, text in tlora.adapter_files(lora, base).items():
        (out / fname).write_text(text)


@dataclass
class StagedVersion:
    """One rank's part of a weight version, off the device: everything the write needs, nothing of the model."""

    layout: RunLayout
    version: int
    step: int
    dtype: str
    staging: Path
    src_model_dir: Path
    rank_file: Path | None = None  # this rank's safetensors file (None: it owns no tensor)
    header: bytes = b""
    host: torch.Tensor | None = None  # the tensors of rank_file, back to back
    index: dict[str, Any] | None = None  # rank 0, full weights: the safetensors index
    adapter: dict[str, torch.Tensor] | None = None  # rank 0, LoRA: the adapter's tensors
    adapter_dir: str | None = None  # where the adapter goes in the version ("." or ADAPTER_DIR)
    lora: AdapterConfig | None = None
    kind: str = "full"  # "full" | "adapter", as the manifest says
    delta_base: int | None = None  # written as a delta against this full version (every rank agreed)
    base: DeltaBase | None = None  # once committed in full, this rank's bytes are kept here for later deltas

    @property
    def nbytes(self) -> int:
        return (self.host.numel() if self.host is not None else 0) + len(self.header)


class PublishError(RuntimeError):
    """A version could not be written or committed (the same message on every rank); its staging is removed."""


def stage_weights(
    model: nn.Module,
    layout: RunLayout,
    version: int,
    step: int,
    *,
    dtype: str,
    tied: bool,
    src_model_dir: Path,
    bucket_bytes: int = 512 << 20,
    lora: AdapterConfig | None = None,
    merged: bool = False,
    delta_base: int | None = None,
    base: DeltaBase | None = None,
) -> StagedVersion:
    """The device half of a publish (collective): empty the staging directory, exchange every tensor to its owner
    rank and copy it to host memory.  ``write_staged`` does the rest, possibly in another thread while the model
    trains on.  Arguments as ``publish_weights``; ``delta_base`` asks for a delta against that version (full when
    a rank's ``base`` does not hold it), ``base`` keeps a full version as the base of later deltas (full weights
    only)."""
    if dtype not in PUBLISH_DTYPES:
        raise WeightsError(f"publish dtype {dtype!r} is not one of {', '.join(PUBLISH_DTYPES)}")
    world, me = tdist.world(), tdist.rank()
    device = tdist.current_device()
    full = lora is None or merged
    reshard(model)  # parameters must be the sharded DTensors, not a root's gathered copies
    staging = _fresh_staging(layout, version)
    staged = StagedVersion(
        layout,
        version,
        step,
        dtype,
        staging,
        Path(src_model_dir),
        lora=lora,
        kind="full" if full else "adapter",
    )
    with torch.no_grad():
        if lora is not None:
            staged.adapter_dir = ADAPTER_DIR if merged else "."
            staged.adapter = _gather_adapter(model, PUBLISH_DTYPES[dtype])
        if full:
            items = _collect(model, PUBLISH_DTYPES[dtype], tied, world)
            buckets = _plan(items, world, bucket_bytes)
            order, staged.host = _stage_rank_bytes(items, buckets, device)
            if order:
                staged.rank_file, staged.header = (
                    staging / shard_file_name(me, world),
                    safetensors_header(order),
                )
            staged.index = _index(items, world) if me == 0 else None
            staged.base = base if lora is None else None
            if delta_base is not None and staged.base is not None:
                name = staged.rank_file.name if staged.rank_file is not None else None
                agreed = tdist.all_gather_object(staged.base.holds(delta_base, name, staged.header))
                staged.delta_base = delta_base if all(agreed) else None
    return staged


def _write_rank0_files(staged: StagedVersion) -> None:
    if staged.adapter is not None and staged.lora is not None and staged.adapter_dir is not None:
        _save_adapter(staged.adapter, staged.staging / staged.adapter_dir, staged.lora, staged.src_model_dir)
    if staged.index is not None:
        _write_metadata(staged.staging, staged.index, staged.dtype, staged.src_model_dir)


def _commit(staged: StagedVersion, digests: list[Any]) -> None:
    """Rank 0: seal the version; ``digests`` has each rank's file digest, or for a delta each rank's DeltaFile
    (None: a rank without a file)."""
    world = len(digests)
    delta = None
    if staged.delta_base is not None:
        files = {shard_file_name(r, world): d for r, d in enumerate(digests) if d is not None}
        base_dir = staged.layout.weight_version(staged.delta_base)
        try:
            base_sha = deltas.manifest_sha256(base_dir)
        except FileNotFoundError:
            raise WeightsError(f"{base_dir}: the base of this delta is gone") from None
        delta = deltas.DeltaRecord(base=staged.delta_base, base_manifest_sha256=base_sha, files=files)
        digests = []
    known = {shard_file_name(r, world): d for r, d in enumerate(digests) if d is not None}
    base = (
        {}
        if staged.lora is None
        else {"base_model": str(staged.src_model_dir), "base_sha256": base_model_hash(staged.src_model_dir)}
    )
    commit_version(
        staged.layout,
        staged.version,
        staged.staging,
        step=staged.step,
        dtype=staged.dtype,
        known_digests=known,
        kind=staged.kind,
        adapter=staged.adapter_dir,
        delta=delta,
        **base,
    )


def _gather_objects(obj: Any, group: Any) -> list[Any]:
    if tdist.world() == 1:
        return [obj]
    out: list[Any] = [None] * tdist.world()
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group: Any) -> Any:
    if tdist.world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def write_staged(
    staged: StagedVersion, group: Any = None, before_commit: Callable[[], None] | None = None
) -> None:
    """The host half of a publish, on every rank (collective over ``group``, which may be a process group of its
    own so that this runs in a thread beside the training collectives): each rank writes its file, rank 0 the
    metadata, then rank 0 runs ``before_commit`` (a fence check) and commits (manifest last, rename, LATEST).

    Any failure (a full disk on any rank) raises PublishError with one message on every rank, after rank 0 removed
    the staging directory; FencedError from ``before_commit`` is raised as such on every rank.
    """
    error = None
    sha: str | deltas.DeltaFile | None = None
    try:
        if staged.rank_file is not None and staged.delta_base is not None:
            assert staged.base is not None and staged.host is not None
            sha = staged.base.encode(
                staged.staging / (staged.rank_file.name + deltas.DELTA_SUFFIX), staged.header, staged.host
            )
        elif staged.rank_file is not None:
            sha = write_rank_file(staged.rank_file, staged.header, staged.host)
        if tdist.is_main():
            _write_rank0_files(staged)
    except Exception as e:  # any rank's failure must reach rank 0's decision, or the ranks would part ways
        error = f"rank {tdist.rank()}: {e}"
    results = _gather_objects((sha, error), group)
    outcome: tuple[str, str] | None = None
    if tdist.is_main():
        failed = [e for _, e in results if e]
        outcome = ("error", failed[0]) if failed else None
        if outcome is None:
            try:
                if before_commit is not None:
                    before_commit()
                _commit(staged, [d for d, _ in results])
            except FencedError as e:
                outcome = ("fenced", str(e))
            except (OSError, WeightsError) as e:
                outcome = ("error", str(e))
        if outcome is not None:
            shutil.rmtree(staged.staging, ignore_errors=True)  # a full disk gets its space back
    outcome = _broadcast(outcome, group)
    if outcome is not None:
        kind, message = outcome
        if kind == "fenced":
            raise FencedError(message)
        raise PublishError(f"publishing v{staged.version}: {message}")
    if staged.base is not None and staged.delta_base is None:
        name = staged.rank_file.name if staged.rank_file is not None else None
        staged.base.keep(staged.version, name, staged.header, staged.host)


def publish_weights(
    model: nn.Module,
    layout: RunLayout,
    version: int,
    step: int,
    *,
    dtype: str,
    tied: bool,
    src_model_dir: Path,
    bucket_bytes: int = 512 << 20,
    lora: AdapterConfig | None = None,
    merged: bool = False,
    delta_base: int | None = None,
    base: DeltaBase | None = None,
) -> None:
    """Publish ``model`` (an ``Actor`` or HF model, FSDP2-sharded or not) as weight version ``version``.

    Collective: call on every rank.  ``dtype`` is the publish dtype (float32, bfloat16, float16); ``tied`` drops the
    ``lm_head.weight`` alias; ``src_model_dir`` is the base model whose config and tokenizer files ride along.
    With ``lora`` (``model.lora`` of a model that carries adapters) the version is the adapter alone, or with
    ``merged`` the merged full weights plus the adapter in ``adapter/``.  ``delta_base``/``base``: see
    ``stage_weights``.
    Returns once LATEST points at the new version on every rank.  (The trainer's loop runs the two halves,
    ``stage_weights`` and ``write_staged``, apart: the write overlaps the next step.)
    """
    staged = stage_weights(
        model,
        layout,
        version,
        step,
        dtype=dtype,
        tied=tied,
        src_model_dir=src_model_dir,
        bucket_bytes=bucket_bytes,
        lora=lora,
        merged=merged,
        delta_base=delta_base,
        base=base,
    )
    write_staged(staged)
