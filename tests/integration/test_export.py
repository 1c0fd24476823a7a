"""`shardrl export` and `shardrl export-shards` on a real run directory, as separate processes: a published version
becomes a HF model directory that transformers loads with the same weights, a damaged version is refused before
anything is written, and the ready shards become Parquet files that read back as one dataset with every sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from buffer import shards
from buffer.config import ShardRLConfig
from buffer.run import Run
from buffer.weights import sha256_file

from ._common import publish_model, shardrl


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    from shardrl.runs import init_run

    cfg = ShardRLConfig.model_validate(
        {"model": {"path": "tiny"}, "reward": {"function": "max_digit"}, "rollout": {"sampling": {"n": 4}}}
    )
    return init_run(tmp_path_factory.mktemp("export") / "run", cfg)


def test_export_writes_a_loadable_model_and_refuses_a_damaged_version(run: Run, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    publish_model(run.layout, run.model_dir, 1, step=1)  # no tokenizer: export takes the run's
    out = tmp_path / "v1"
    p = shardrl("export", str(run.layout.root), "--version", "1", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"exported weights v1 (step 1) to {out}: "), p.stdout
    for name in ("config.json", "manifest.json", "model.safetensors", "tokenizer.json"):
        assert name in p.stdout.split(": ", 1)[1], p.stdout
    assert sha256_file(out / "model.safetensors") == sha256_file(run.model_dir / "model.safetensors")
    assert json.loads((out / "manifest.json").read_text())["version"] == 1
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(run.model_dir)
    for (name, a), b in zip(model.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    tok = AutoTokenizer.from_pretrained(out)  # copied from the run's tokenizer
    assert (
        tok.chat_template
        and tok("max(3,9)=")["input_ids"]
        == AutoTokenizer.from_pretrained(run.model_dir)("max(3,9)=")["input_ids"]
    )

    # a flipped byte of the same size: the manifest's checksum catches it and nothing is written
    publish_model(run.layout, run.model_dir, 2, step=2)
    weights = run.layout.weight_version(2) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    for version in ("2", "latest"):
        p = shardrl("export", str(run.layout.root), "--version", version, str(tmp_path / "v2"))
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert f"{weights}: sha256 does not match the manifest" in p.stderr
    assert not (tmp_path / "v2").exists()
    for version, message in (
        ("7", "versions kept: 1, 2; or --version latest"),
        ("x", "expected a version number or `latest`"),
    ):
        p = shardrl("export", str(run.layout.root), "--version", version, str(tmp_path / "v7"))
        assert p.returncode == 2 and message in p.stderr and p.stderr.count("\n") == 1, p.stderr
    p = shardrl("export", str(run.layout.root), "--version", "1", str(out))
    assert p.returncode == 2 and "already exists and is not an empty directory" in p.stderr


def test_export_shards_to_parquet_reads_back_as_one_dataset(run: Run, tmp_path: Path) -> None:
    import pyarrow.dataset as ds

    from shardrl.synth import synth_shards

    synth_shards(run, 3, 8, worker_id="a")
    ready = shards.list_ready(run.layout)
    out = tmp_path / "parquet"
    p = shardrl("export-shards", str(run.layout.root), "--format", "parquet", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"wrote 3 Parquet file(s) (24 samples) to {out} (0 already there, 0 bad)"
    table = ds.dataset(out, format="parquet").to_table()
    expected = {sid for s in ready for sid in shards.sample_ids(run.layout, s.name)}
    assert table.num_rows == 24 and set(table.column("sample_id").to_pylist()) == expected
    one = shards.read_shard(run.layout.ready_shard(ready[0].name))
    back = ds.dataset(out / ready[0].name.replace(".arrow", ".parquet"), format="parquet").to_table()
    assert back.select(one.schema.names).to_pylist() == one.to_pylist()

    # again: only new shards are written; a damaged one is skipped and reported
    synth_shards(run, 1, 8, worker_id="b")
    bad = next(s for s in shards.list_ready(run.layout) if s.worker_id == "b")
    path = run.layout.ready_shard(bad.name)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    p = shardrl("export-shards", str(run.layout.root), "--format", "parquet", str(out))
    assert p.returncode == 1
    assert p.stdout.splitlines()[0].startswith(f"SKIPPED {bad.name}: checksum mismatch")
    assert (
        p.stdout.splitlines()[-1] == f"wrote 0 Parquet file(s) (0 samples) to {out} (3 already there, 1 bad)"
    )
