"""Exports out of a run directory, for use outside shardrl.

``shardrl export RUN --version V OUT`` copies a published weight version into a standalone HF model directory (what
``from_pretrained`` and vLLM load); the version is verified against its manifest, checksums included, before
anything is copied, and every copied file is checked again against the manifest.  ``shardrl export RUN --step N
OUT`` writes the actor of the trainer's checkpoint of step N the same way, for a version retention deleted.  ``shardrl export-shards RUN
--format parquet OUT`` writes one Parquet file per ready shard into OUT (a directory that pyarrow, pandas, polars and
DuckDB read as one dataset; docs/DATA.md); each shard is validated first, and shards already exported are skipped,
so running it again exports only what is new.

Both only read the run: rollout workers and the trainer may keep running.  Outputs appear whole or not at all
(tmp -> fsync -> rename).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from buffer.config import ConfigError
from buffer.fsio import fsync_dir, tmp_name
from buffer.layout import RunLayout
from buffer.run import Run, open_run
from buffer.shards import SUFFIX, ShardError, list_ready, read_shard
from buffer.weights import (
    MANIFEST,
    WeightsError,
    digest_as,
    latest_version,
    manifest_of,
    published_versions,
    verify_version,
)

# Files a HF tokenizer directory may hold; copied from the run's tokenizer when a version carries none.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class ExportError(ConfigError):
    """A user-caused export problem (no such version, OUT not empty, a damaged file); one line."""


def _fresh_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: already exists and is not an empty directory; choose a new OUT")
    out.parent.mkdir(parents=True, exist_ok=True)


def _copy_checked(src: Path, dest: Path, entry: dict[str, Any] | None) -> None:
    """Copy ``src`` to ``dest`` (fsynced), then check the copy against its manifest ``entry``: a file replaced or
    damaged meanwhile is an ExportError."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        shutil.copyfileobj(fin, fout, 8 << 20)
        fout.flush()
        os.fsync(fout.fileno())
    if entry is not None and digest_as(dest, entry.get("chunk_bytes")) != entry["sha256"]:
        raise ExportError(
            f"{src}: changed while copying (its digest does not match {MANIFEST}); run the export again"
        )


def resolve_version(layout: RunLayout, version: str) -> int:
    """``latest`` or a version number -> a published version number (not 0, the base model)."""
    v = latest_version(layout) if version == "latest" else int(version) if version.isdigit() else None
    if v is None:
        raise ExportError(f"command line: --version {version!r}: expected a version number or `latest`")
    if v == 0:
        raise ExportError(
            f"{layout.weights}: no published version yet (version 0 is the base model, model.path in the config)"
        )
    kept = published_versions(layout)
    if v not in kept:
        # Retention deletes all but the newest run.keep_weight_versions (and the milestones): say what is left.
        have = ", ".join(map(str, kept[-8:])) or "none"
        raise ExportError(
            f"command line: --version {version}: {layout.weight_version(v)} is not in the run (never published, or "
            f"deleted by retention, run.keep_weight_versions); versions kept: {have}; or --version latest"
        )
    return v


@dataclass
class VersionExport:
    out: Path
    version: int
    step: int
    files: list[str]


def export_version(run_dir: Path, version: str, out: Path) -> VersionExport:
    """Copy the verified weight version ``version`` of the run to ``out`` (a new directory): what was written."""
    run = open_run(run_dir)
    v = resolve_version(run.layout, version)
    try:
        wv = verify_version(run.layout, v, checksums=True)
    except WeightsError as e:
        raise ExportError(str(e)) from None
    _fresh_out(out)
    scratch = tmp_name(out.parent / f"{out.name}-delta")
    try:
        return _export_dir(run, lambda: _full_files(run.layout, wv.path, v, scratch), out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def export_checkpoint(run_dir: Path, step: int, out: Path) -> VersionExport:
    """The actor of the trainer's complete checkpoint of ``step`` as a standalone HF directory at ``out``: for a
    version that retention deleted, or a step no version was published at.  The trainer's own models are built in
    this process on the CPU (one rank), the checkpoint is loaded into them (DCP reshards whatever world size saved
    it), and the actor goes through the trainer's own publish path (LoRA adapters merged) into a scratch run; that
    version is copied out as ``export_version`` copies one."""
    from trainer import checkpoint as ckpt

    run = open_run(run_dir)
    if not ckpt.is_complete(run.layout, step):
        have = ", ".join(map(str, ckpt.complete_checkpoints(run.layout))) or "none"
        raise ExportError(
            f"{run.layout.checkpoint(step)}: not a complete checkpoint; --step takes one of the steps with one "
            f"({have})"
        )
    _fresh_out(out)
    scratch = RunLayout.of(tmp_name(out.parent / f"{out.name}-checkpoint"))
    try:
        return _export_dir(run, lambda: _publish_checkpoint(run, step, scratch), out)
    finally:
        shutil.rmtree(scratch.root, ignore_errors=True)


def _publish_checkpoint(run: Run, step: int, scratch: RunLayout) -> Path:
    """Load checkpoint ``step`` into the trainer's models and publish the actor as version 1 of ``scratch``."""
    from buffer.config import resolve_dtype
    from trainer import checkpoint as ckpt
    from trainer import dist as tdist
    from trainer.loop import build_models
    from trainer.publish import publish_weights

    cfg = run.config
    # Built on this machine's CPU in float32, whatever devices, offload and recomputation the training used: none of
    # them changes the weights a checkpoint holds.
    trainer = cfg.trainer.model_copy(
        update={"cpu_offload": False, "activation_checkpointing": False, "param_dtype": "float32"}
    )
    tdist.init("cpu")
    try:
        models = build_models(replace(run, config=cfg.model_copy(update={"trainer": trainer})))
        try:
            ckpt.load_checkpoint(run.layout, step, *models.parts())
        except ckpt.CheckpointError as e:
            raise ExportError(str(e)) from None
        scratch.create()
        lora = cfg.model.lora if cfg.model.lora.enabled else None
        publish_weights(
            models.actor,
            scratch,
            1,
            step,
            dtype=resolve_dtype(cfg.model.dtype, cuda=False),
            tied=bool(getattr(models.actor.config, "tie_word_embeddings", False)),
            src_model_dir=run.model_dir,
            lora=lora,
            merged=lora is not None,
        )
    finally:
        tdist.teardown()
    return scratch.weight_version(1)


def _export_dir(run: Run, source: Callable[[], Path], out: Path) -> VersionExport:
    """Copy the full HF version directory that ``source()`` gives into ``out``, every file checked against its
    manifest, the run's tokenizer added where the version carries none; ``out`` appears whole or not at all."""
    tmp = tmp_name(out)
    tmp.mkdir()
    try:
        src = source()
        manifest = manifest_of(src)
        files = manifest["files"]
        written = [*files, MANIFEST]
        for rel, meta in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            _copy_checked(src / rel, tmp / rel, meta)
        _copy_checked(src / MANIFEST, tmp / MANIFEST, None)  # provenance: version, step, every file's sha256
        if not any(name in files for name in TOKENIZER_FILES):
            for name in TOKENIZER_FILES:
                if (run.tokenizer_dir / name).is_file():
                    _copy_checked(run.tokenizer_dir / name, tmp / name, None)
                    written.append(name)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except FileNotFoundError as e:
        raise ExportError(
            f"{e.filename}: deleted while copying (garbage collection keeps run.keep_weight_versions); "
            "export a newer version, or a checkpoint with --step"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return VersionExport(out, int(manifest.get("version", 0)), int(manifest.get("step", 0)), sorted(written))


def _full_files(layout: RunLayout, path: Path, version: int, scratch: Path) -> Path:
    """The directory of ``version`` as full HF files: ``path`` itself, or for a delta version (XOR against a base,
    ``buffer/deltas.py``) its reconstruction under ``scratch``, checked against the digests the delta records."""
    from buffer.deltas import DELTA_RECORD

    if not (path / DELTA_RECORD).is_file():
        return path
    from buffer.localcache import NodeCache

    try:
        return NodeCache(layout, scratch).materialise(version).path
    except WeightsError as e:
        raise ExportError(str(e)) from None


@dataclass
class ShardExport:
    written: list[Path] = field(default_factory=list)
    already: int = 0  # exported by an earlier run of the command
    bad: list[str] = field(default_factory=list)  # "<shard>: <reason>" of shards that failed validation
    rows: int = 0  # samples in the files written now


def parquet_name(shard_name: str) -> str:
    return shard_name.removesuffix(SUFFIX) + ".parquet"


def export_shards(run_dir: Path, out: Path) -> ShardExport:
    """Each validated ready shard of the run as ``OUT/<shard name>.parquet``; existing ones are kept."""
    import pyarrow.parquet as pq

    run = open_run(run_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; OUT is the directory of Parquet files")
    out.mkdir(parents=True, exist_ok=True)
    report = ShardExport()
    for shard in list_ready(run.layout):
        dest = out / parquet_name(shard.name)
        if dest.exists():
            report.already += 1
            continue
        try:
            table = read_shard(
                run.layout.ready_shard(shard.name), run.config.model.vocab_size, run_id=run.run_id
            )
        except ShardError as e:
            report.bad.append(str(e))
            continue
        except FileNotFoundError:  # quarantined by a reader meanwhile
            continue
        tmp = tmp_name(dest)  # a hidden name: dataset readers skip it
        try:
            pq.write_table(table, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.rename(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        report.written.append(dest)
        report.rows += table.num_rows
    fsync_dir(out)
    return report


def main(cmd: str, run_dir: Path, out: Path, version: str | None, step: int | None = None) -> int:
    """The two subcommands' output lines; exit 1 when a shard failed validation."""
    if cmd == "export" and step is not None:
        done = export_checkpoint(run_dir, step, out)
        print(
            f"exported the actor of checkpoint step {done.step} to {done.out}: {len(done.files)} files "
            f"({', '.join(done.files)})"
        )
        return 0
    if cmd == "export":
        done = export_version(run_dir, str(version), out)
        print(
            f"exported weights v{done.version} (step {done.step}) to {done.out}: {len(done.files)} files "
            f"({', '.join(done.files)})"
        )
        return 0
    rep = export_shards(run_dir, out)
    for line in rep.bad:
        print(f"SKIPPED {line}")
    print(
        f"wrote {len(rep.written)} Parquet file(s) ({rep.rows} samples) to {out} ({rep.already} already there, "
        f"{len(rep.bad)} bad)"
    )
    return 1 if rep.bad else 0
