"""`shardrl export` and `shardrl export-shards` on a real run directory, as separate processes: a published version
becomes a HF model directory that transformers loads with the same weights, a damaged version is refused before
anything is written, and the ready shards become Parquet files that read back as one dataset with every sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
def test_export_from_a_checkpoint_equals_the_version_published_at_its_step(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    """A checkpoint saved by two ranks, exported by one process: the same tensors, to the bit, as the full version
    the trainer published after that step; a step without a complete checkpoint is one line, exit 2."""
    from safetensors.torch import load_file

    from ._trainer_helpers import command, make_run, run_ok, synth, trainer_args

    layout = make_run(tmp_path / "run", tiny_model_tied, trainer__save_every=1, trainer__publish_full_every=1)
    synth(layout, shards=2, samples=32)
    run_ok(command(2, *trainer_args(layout, "--max-steps", 2)), tmp_path / "trainer.log")
    (published,) = [
        d for d in layout.weights.glob("v*") if json.loads((d / "manifest.json").read_text()).get("step") == 2
    ]

    out = tmp_path / "step2"
    p = shardrl("export", str(layout.root), "--step", "2", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"exported the actor of checkpoint step 2 to {out}: "), p.stdout

    def tensors(d: Path) -> dict[str, torch.Tensor]:  # a version holds a file per publishing rank
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    got, want = tensors(out), tensors(published)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    base = tensors(tiny_model_tied)
    assert any(not torch.equal(got[n], base[n]) for n in got)  # trained weights, not the base's
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()

    p = shardrl("export", str(layout.root), "--step", "5", str(tmp_path / "step5"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "not a complete checkpoint; --step takes one of the steps with one (1, 2)" in p.stderr, p.stderr
    assert not (tmp_path / "step5").exists()
