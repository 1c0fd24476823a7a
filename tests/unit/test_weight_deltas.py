"""Delta weight versions: XOR + zstd against a full base, rebuilt bit for bit in the node-local cache; a damaged
delta, a missing or replaced base are refused with their reason; retention keeps bases; the trainer's publisher
writes deltas between full versions."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save

from buffer import deltas, weights
from buffer.localcache import NodeCache
from buffer.records import WeightsManifest

from .buffer_helpers import make_layout

FILE = "model.safetensors"


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (0.02 * torch.randn(512, 256, generator=g)).to(torch.bfloat16),
        "layer.weight": (0.02 * torch.randn(256, 256, generator=g)).to(torch.bfloat16),
        "norm.weight": torch.ones(256, dtype=torch.bfloat16),
        "steps": torch.arange(7),
    }


def _stepped(state: dict[str, torch.Tensor], lr: float = 1e-6, seed: int = 1) -> dict[str, torch.Tensor]:
    """What one small step does to bf16 weights kept as fp32 masters: every master moves by lr, and the bf16 copy
    changes only where that crosses a rounding boundary.  Plus a tensor the base does not have."""
    g = torch.Generator().manual_seed(seed)
    out = {
        k: (v.float() + lr * torch.randn(v.shape, generator=g).sign()).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in state.items()
    }
    out["new.bias"] = torch.full((33,), 0.5)
    return out


def _split(raw: bytes) -> tuple[bytes, memoryview]:
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[: 8 + n], memoryview(raw)[8 + n :]


def _publish_full(layout, version: int, state: dict[str, torch.Tensor]) -> bytes:
    raw = save(state, metadata={"format": "pt"})
    st = weights.staging_dir(layout, version)
    (st / FILE).write_bytes(raw)
    (st / "config.json").write_text("{}")
    weights.commit_version(layout, version, st, step=version, dtype="bfloat16")
    return raw


def _publish_delta(layout, version: int, base: int, state: dict[str, torch.Tensor]) -> bytes:
    """``state`` as version ``version``, a delta against ``base``, the way the trainer writes one."""
    raw = save(state, metadata={"format": "pt"})
    header, body = _split(raw)
    st = weights.staging_dir(layout, version)
    (st / "config.json").write_text("{}")
    with deltas.base_tensors(layout.weight_version(base)) as tensors:
        entry = deltas.encode_file(
            st / (FILE + deltas.DELTA_SUFFIX), header, body, tensors, frame_bytes=64 << 10
        )
    record = deltas.DeltaRecord(
        base=base,
        base_manifest_sha256=deltas.manifest_sha256(layout.weight_version(base)),
        files={FILE: entry},
    )
    weights.commit_version(layout, version, st, step=version, dtype="bfloat16", delta=record)
    return raw


@pytest.fixture()
def two_versions(tmp_path):
    layout = make_layout(tmp_path)
    base = _state()
    _publish_full(layout, 1, base)
    full2 = _publish_delta(layout, 2, 1, _stepped(base))
    return layout, full2


def test_delta_round_trips_bit_exactly(tmp_path, two_versions):
    layout, full2 = two_versions
    d = layout.weight_version(2)
    assert sorted(p.name for p in d.iterdir()) == [
        "config.json",
        deltas.DELTA_RECORD,
        "manifest.json",
        FILE + ".xor.zst",
    ]
    wv = weights.verify_version(layout, 2)
    assert (wv.kind, wv.base) == ("delta", 1)
    record = deltas.read_delta_record(d)
    assert record is not None and record.base == 1
    xored = {t.name: t.xor for t in record.files[FILE].tensors}
    assert xored == {
        "embed.weight": True,
        "layer.weight": True,
        "norm.weight": True,
        "steps": True,
        "new.bias": False,
    }
    delta_bytes = (d / (FILE + ".xor.zst")).stat().st_size
    assert delta_bytes < 0.2 * len(full2), (delta_bytes, len(full2))

    cache = NodeCache(layout, tmp_path / "cache")
    local = cache.materialise(2)
    assert local.path == tmp_path / "cache" / "v000002" and local.kind == "full"
    assert (local.path / FILE).read_bytes() == full2  # every byte, header included
    assert sorted(cache.built) == [1, 2]  # the base first, then the delta
    manifest = weights.read_manifest(local.path)
    assert set(manifest.files) == {FILE, "config.json"}
    assert manifest.files[FILE].sha256 == weights.file_digests([local.path / FILE])[0]
    # the read from shared storage: the base's files once, the delta's files once, nothing twice
    shared = [*layout.weight_version(1).iterdir(), *layout.weight_version(2).iterdir()]
    assert cache.shared_bytes_read == sum(p.stat().st_size for p in shared)
    assert torch.equal(load_file(local.path / FILE)["new.bias"], torch.full((33,), 0.5))

    again = NodeCache(layout, tmp_path / "cache").materialise(2)  # another worker of the node
    assert again.path == local.path


def test_damaged_delta_is_refused_with_its_reason(tmp_path, two_versions):
    layout, _ = two_versions
    f = layout.weight_version(2) / (FILE + ".xor.zst")
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    cache = NodeCache(layout, tmp_path / "cache")
    with pytest.raises(
        weights.WeightsError, match=r"v000002/model\.safetensors\.xor\.zst: sha256 does not match"
    ):
        cache.materialise(2)
    assert not cache.path(2).exists() and not list(cache.root.glob(".tmp-*"))
    read = cache.shared_bytes_read
    with pytest.raises(weights.WeightsError, match="sha256 does not match"):
        cache.materialise(2)  # the same damaged files: refused again without copying them again
    assert cache.shared_bytes_read == read


def test_delta_against_a_damaged_base_copy_is_refused(tmp_path, two_versions):
    layout, _ = two_versions
    cache = NodeCache(layout, tmp_path / "cache")
    base = cache.materialise(1)
    raw = bytearray((base.path / FILE).read_bytes())
    raw[-100] ^= 0x01  # the node's copy of the base rots; its size still matches
    (base.path / FILE).write_bytes(bytes(raw))
    with pytest.raises(
        deltas.DeltaError, match=r"reconstructed model\.safetensors does not match the digest"
    ):
        cache.materialise(2)


def test_missing_or_replaced_base_is_refused(tmp_path, two_versions):
    layout, _ = two_versions
    m = layout.weight_version(1) / "manifest.json"
    data = json.loads(m.read_text())
    data["created_at"] += 1
    m.write_text(json.dumps(data))  # a valid manifest, not the one the delta was made against
    with pytest.raises(deltas.DeltaError, match=r"base v1 is not the one it was made from"):
        NodeCache(layout, tmp_path / "cache-a").materialise(2)
    for p in layout.weight_version(1).iterdir():
        p.unlink()
    layout.weight_version(1).rmdir()
    with pytest.raises(
        deltas.DeltaError,
        match=r"v2 is a delta against v1, which cannot be used: .*v000001/manifest\.json: missing",
    ):
        NodeCache(layout, tmp_path / "cache-b").materialise(2)


def test_retention_keeps_the_base_of_kept_deltas(tmp_path):
    layout = make_layout(tmp_path)
    state = _state()
    deleted: list[int] = []
    for v in range(1, 9):
        state = _stepped(state, seed=v)
        if v in (1, 6):
            _publish_full(layout, v, state)
        else:
            _publish_delta(layout, v, 1 if v < 6 else 6, state)
        deleted += weights.garbage_collect(layout, keep=2, in_use=[])
    # v1 stays while a delta against it is kept (v5, until v7's publish), then goes; v6 is the base of v7 and v8
    assert deleted == [2, 3, 4, 1, 5]
    assert weights.published_versions(layout) == [6, 7, 8]


def test_retention_keeps_the_base_of_a_delta_in_use(tmp_path):
    layout = make_layout(tmp_path)
    state = _state()
    _publish_full(layout, 1, state)
    _publish_delta(layout, 2, 1, _stepped(state))
    _publish_full(layout, 3, _stepped(state, seed=3))
    _publish_full(layout, 4, _stepped(state, seed=4))
    assert weights.garbage_collect(layout, keep=1, in_use=[2]) == [3]
    assert weights.published_versions(layout) == [1, 2, 4]
    assert weights.delta_base(layout, 2) == 1 and weights.delta_base(layout, 4) is None


def test_commit_refuses_an_adapter_delta(tmp_path, two_versions):
    layout, _ = two_versions
    st = weights.staging_dir(layout, 3)
    record = deltas.read_delta_record(layout.weight_version(2))
    with pytest.raises(weights.WeightsError, match="only full weights"):
        weights.commit_version(
            layout, 3, st, step=3, dtype="bfloat16", kind="adapter", adapter=".", delta=record
        )


def test_cache_keeps_the_newest_and_their_base(tmp_path):
    layout = make_layout(tmp_path)
    state = _state()
    _publish_full(layout, 1, state)
    for v in range(2, 7):
        _publish_delta(layout, v, 1, _stepped(state, seed=v))
    cache = NodeCache(layout, tmp_path / "cache", keep=2)
    for v in range(2, 7):
        cache.materialise(v)
    assert sorted(p.name for p in cache.root.glob("v*")) == ["v000001", "v000005", "v000006"]
    manifest = WeightsManifest.model_validate_json((cache.path(6) / "manifest.json").read_text())
    assert manifest.version == 6 and deltas.DELTA_RECORD not in manifest.files


def test_trainer_publishes_deltas_between_full_versions(tmp_path, tiny_model_untied):
    """trainer.publish: a full version kept as base, a real AdamW step at lr 1e-6, then the same weights as a delta
    and in full; the delta rebuilds to the full version's bytes."""
    from transformers import AutoModelForCausalLM

    from trainer.delta_base import DeltaBase
    from trainer.publish import publish_weights

    layout = make_layout(tmp_path)
    base = DeltaBase()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_untied, dtype=torch.float32)

    def publish(v: int, **kw) -> None:
        publish_weights(
            model, layout, v, v, dtype="bfloat16", tied=False, src_model_dir=tiny_model_untied, **kw
        )

    publish(1, base=base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    publish(2, delta_base=1, base=base)
    publish(3)
    assert weights.verify_version(layout, 2).kind == "delta"
    assert weights.verify_version(layout, 3).kind == "full"
    local = NodeCache(layout, tmp_path / "cache").materialise(2)
    names = sorted(p.name for p in layout.weight_version(3).glob("*.safetensors"))
    assert names == ["model-00001-of-00001.safetensors"]
    assert (local.path / names[0]).read_bytes() == (layout.weight_version(3) / names[0]).read_bytes()
    before = load_file(layout.weight_version(1) / "model-00001-of-00001.safetensors")
    after = load_file(local.path / names[0])
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step changed no published byte"
    delta_file = layout.weight_version(2) / (names[0] + deltas.DELTA_SUFFIX)
    assert delta_file.stat().st_size < 0.5 * (layout.weight_version(3) / names[0]).stat().st_size
    # a delta against a version this process does not hold as its base is published in full
    publish(4, delta_base=3, base=base)  # v3 was full but not kept: base still holds v1
    assert weights.verify_version(layout, 4).kind == "full"
