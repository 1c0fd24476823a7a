"""Publishing FSDP2-sharded weights from 2 torchrun ranks (CPU, gloo) as a loadable HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from buffer.layout import RunLayout
from buffer.weights import abandoned_staging, latest_version, manifest_of, verify_version
from trainer.publish import assign_owners, hf_name

from ._fsdp_worker import launch

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_assign_owners_is_balanced_and_deterministic() -> None:
    sizes = [100, 7, 7, 50, 50, 3, 0, 20]
    owners = assign_owners(sizes, 3)
    assert owners == assign_owners(sizes, 3)
    load = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(3)]
    assert max(load) - min(load) <= max(sizes)
    assert owners[0] == 0  # the largest goes first, to rank 0
    assert assign_owners(sizes, 1) == [0] * len(sizes)


def test_hf_name_strips_wrappers() -> None:
    assert hf_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == (
        "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("_orig_mod.model.norm.weight") == "model.norm.weight"
    assert hf_name("lm_head.weight") == "lm_head.weight"


def _file_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def _check_version_dir(d: Path, tied: bool, dtype: str) -> dict[str, list[str]]:
    """Files, index and config of one published version; returns the keys of each shard file."""
    files = manifest_of(d)["files"]
    for name in [*SHARDS, "model.safetensors.index.json", "config.json", "generation_config.json"]:
        assert name in files, name
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert not any(name.startswith(".tmp") for name in files)
    assert json.loads((d / "config.json").read_text())["dtype"] == dtype
    keys = {f: _file_keys(d / f) for f in SHARDS}
    assert all(keys.values()), "a rank wrote an empty file"
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k: f for f, ks in keys.items() for k in ks} == index
    assert ("lm_head.weight" in index) is not tied
    assert not any("_checkpoint_wrapped_module" in k or k.startswith("lm.") for k in index)
    sizes = [(d / f).stat().st_size for f in SHARDS]
    assert abs(sizes[0] - sizes[1]) < 0.5 * sum(sizes), f"unbalanced shard files {sizes}"
    return keys


@pytest.mark.slow
def test_publish_from_two_ranks(tmp_path: Path, tiny_model_tied: Path, tiny_model_untied: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tied_dir, untied_dir = tiny_model_tied, tiny_model_untied
    out = tmp_path / "out"
    out.mkdir()
    # Each model is trained one step (so the weights are not the source's), published in float32 (v1) and
    # bfloat16 (v2); the untied one runs with activation checkpointing (wrapper names must not leak).
    launch(["publish", out, tied_dir, untied_dir], nproc=2)

    for tag, src, tied in (("tied", tied_dir, True), ("untied", untied_dir, False)):
        layout = RunLayout.of(out / f"run-{tag}")
        assert latest_version(layout) == 2
        v1 = verify_version(layout, 1, checksums=True).path
        v2 = verify_version(layout, 2, checksums=True).path
        assert abandoned_staging(layout) == [] and not list(layout.weights.glob(".staging-*"))
        _check_version_dir(v1, tied, "float32")
        _check_version_dir(v2, tied, "bfloat16")

        # The reference: the trainer's weights gathered by torch's own full-state-dict path into a plain model.
        ref_sd = load_file(str(out / f"ref-{tag}.safetensors"))
        reference = AutoModelForCausalLM.from_pretrained(src)
        reference.load_state_dict(ref_sd)
        published = AutoModelForCausalLM.from_pretrained(v1)
        assert published.config.tie_word_embeddings is tied
        batch = load_file(str(out / f"logp-{tag}.safetensors"))
        ids, mask = batch["ids"], batch["mask"]
        with torch.no_grad():
            logits = published(input_ids=ids, attention_mask=mask).logits
            ref_logits = reference(input_ids=ids, attention_mask=mask).logits
            base_logits = AutoModelForCausalLM.from_pretrained(src)(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
        assert (logits - base_logits).abs().max() > 1e-2, "the published weights are the untrained source's"

        # The FSDP actor's chunked logprobs (computed in the workers) against the published model's full softmax.
        logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        m = mask[:, 1:].bool()
        torch.testing.assert_close(batch["logp"][:, 1:][m], logp[m], rtol=1e-5, atol=1e-5)
        assert (batch["logp"][:, 0] == 0).all() and (batch["logp"][:, 1:][~m] == 0).all()

        # bfloat16 version: every tensor is the reference cast to bf16, bit for bit.
        bf16 = {}
        for f in SHARDS:
            bf16.update(load_file(str(v2 / f)))
        expected = {k: v for k, v in ref_sd.items() if not (tied and k == "lm_head.weight")}
        assert bf16.keys() == expected.keys()
        for k, v in expected.items():
            assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16)), k


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_weights_are_read_once_and_broadcast(
    tmp_path: Path, tiny_model_tied: Path, tiny_model_untied: Path, tied: bool
) -> None:
    """2 ranks: rank 0 reads the model, rank 1 builds it on the meta device; both end with the weights, rotary
    buffers and outputs of a plain load (actor, LoRA actor, reference, LoRA critic)."""
    model = tiny_model_tied if tied else tiny_model_untied
    launch(["load-once", tmp_path, model], nproc=2)
    r = json.loads((tmp_path / "load-once.json").read_text())
    assert r["reads_by_rank"] == [4, 0]
    assert r["actor_missing"] == []
    assert r["actor_weights_max_diff"] == 0.0
    assert r["lora_base_max_diff"] == 0.0
    assert r["critic_base_max_diff"] == 0.0
    assert r["lora_b_max_abs"] == 0.0 and r["critic_head_max_abs"] == 0.0 and r["values_max_abs"] == 0.0
    assert r["buffers"] >= 1 and r["buffers_max_diff"] == 0.0
    for bound, std in r[
        "lora_a_rows"
    ]:  # rank 1's rows came from rank 0's init, not from uninitialised memory
        assert bound <= 1.0 + 1e-6 and 0.6 < std < 1.4, (bound, std)
    assert all(d < 1e-5 for d in r["logprob_max_diff"].values()), r["logprob_max_diff"]
