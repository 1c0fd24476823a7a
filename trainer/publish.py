"""Publish the FSDP2-sharded actor as an HF safetensors directory, written by all ranks in parallel.

Called on every rank (``publish_weights``); nothing is gathered whole on one rank.  Steps 1-3 are
``trainer/gather.py``'s, an adapter's files ``trainer/adapter_files.py``'s; this module stages and commits:

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from buffer import deltas
from buffer.config import AdapterConfig
from buffer.layout import RunLayout
from buffer.plans import FencedError
from buffer.weights import WeightsError, base_model_hash, commit_version, staging_dir
from trainer import dist as tdist
from trainer.adapter_files import gather_adapter, save_adapter
from trainer.delta_base import DeltaBase
from trainer.gather import (
    Item,
    assign_owners,
    collect,
    hf_name,
    plan_buckets,
    shard_file_name,
    stage_rank_bytes,
)
from trainer.model import reshard
from trainer.st_files import safetensors_header, write_rank_file

__all__ = [  # what callers and tests import from here; the device half lives in trainer/gather.py
    "PUBLISH_DTYPES",
    "PublishError",
    "StagedVersion",
    "assign_owners",
    "hf_name",
    "publish_weights",
    "stage_weights",
    "write_staged",
]

PUBLISH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of a source model directory that are not copied: the weights (we write our own), their index and config.
_SKIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_SKIP_NAMES = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "manifest.json"}
INDEX = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"  # the adapter inside a merged full version


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


def _index(items: list[Item], world: int) -> dict[str, Any]:
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
            staged.adapter = gather_adapter(model, PUBLISH_DTYPES[dtype])
        if full:
            items = collect(model, PUBLISH_DTYPES[dtype], tied, world)
            buckets = plan_buckets(items, world, bucket_bytes)
            order, staged.host = stage_rank_bytes(items, buckets, device)
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
        save_adapter(staged.adapter, staged.staging / staged.adapter_dir, staged.lora, staged.src_model_dir)
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
