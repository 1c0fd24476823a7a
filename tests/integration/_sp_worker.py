"""Sequence parallelism against the plain path, run under torchrun on CPU (gloo):

    python -m torch.distributed.run --nproc_per_node=N tests/integration/_sp_worker.py MODEL OUT CASE:K,K... ...

For each CASE (settings in ``CASES``) and each K it builds the models as the trainer does (actor, KL reference,
critic for PPO, LoRA adapters), seeded alike, then:
- runs ``batch_logprobs`` / ``batch_values`` on one packed micro-batch of every sample, the same on every rank;
- runs the real ``trainer.step.train_step`` on the step's samples with ``trainer.sequence_parallel = K``, gathering
  every parameter's full gradient after the backward of the first and of the last update.
Rank 0 writes ``OUT/CASE-kK.safetensors`` (``direct/...``, ``first/PART/NAME``, ``last/PART/NAME``) with the step's
metrics as JSON in the file's metadata.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from buffer.config import ShardRLConfig, apply_overrides, validate
from trainer import dist as tdist
from trainer import sequence_parallel as seqpar
from trainer.__main__ import leave
from trainer.batching import batch_to, collate
from trainer.data import Sample
from trainer.logprobs import batch_logprobs
from trainer.lora import AdaptersOff
from trainer.model import (
    batch_values,
    build_actor,
    build_critic,
    build_optimizer,
    build_reference,
    build_scheduler,
)
from trainer.step import Models, kl_controller, train_step

BASE = {
    "reward.function": "max_digit",
    "rollout.sampling.n": "4",
    "rollout.sampling.max_response_length": "12",
    "trainer.samples_per_step": "12",
    "trainer.max_tokens_per_microbatch": "48",  # several micro-batches a rank, unequal counts
    "trainer.logprob_chunk": "7",
    "trainer.param_dtype": "float32",
    "trainer.lr": "1e-3",
    "algorithm.entropy_coef": "0.01",
}
CASES: dict[str, dict[str, str]] = {
    # KL in the loss against a reference, entropy in the loss, two updates with the decoupled (proximal) objective
    "grpo": {
        "algorithm.kl_coef": "0.1",
        "algorithm.off_policy": "decoupled",
        "trainer.updates_per_step": "2",
    },
    # the critic's values and value loss, GAE, whitening over ranks, the KL in the reward, activation checkpointing
    "ppo": {
        "algorithm.name": "ppo",
        "algorithm.whiten_advantages": "true",
        "algorithm.kl_coef": "0.1",
        "algorithm.kl_mode": "reward",
        "trainer.activation_checkpointing": "true",
    },
    # LoRA adapters on a frozen base; the reference is the actor with its adapters off
    "lora": {"model.lora.rank": "4", "model.lora.alpha": "8", "algorithm.kl_coef": "0.1"},
}


def config(model: str, case: str, k: int) -> ShardRLConfig:
    settings = {**BASE, **CASES[case], "model.path": model, "trainer.sequence_parallel": str(k)}
    return validate(apply_overrides({}, settings), f"case {case}")


def samples(vocab: int) -> list[Sample]:
    """Three groups of four, prompts and responses of different lengths (so rows pad to a multiple of K)."""
    rng = random.Random(7)
    out = []
    for i in range(12):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        logprobs = [-rng.uniform(0.5, 5.0) for _ in response]
        out.append(Sample(f"s{i}", f"g{i // 4}", prompt, response, logprobs, float(rng.random() < 0.5), 0))
    return out


def build(cfg: ShardRLConfig, device: torch.device) -> Models:
    """The models as ``trainer.loop.build_models`` builds them (without a run directory)."""
    t, model_dir = cfg.trainer, cfg.model.path
    sharding: dict[str, Any] = {
        "param_dtype": t.param_dtype,
        "activation_checkpointing": t.activation_checkpointing,
    }
    torch.manual_seed(1234)  # LoRA's initial A matrices (rank 0's are broadcast)
    actor = build_actor(model_dir, device, **sharding, lora=cfg.model.lora)
    opt = build_optimizer(actor, lr=t.lr)
    models = Models(actor, opt, build_scheduler(opt, warmup_steps=0, schedule="constant", total_steps=10))
    models.kl = kl_controller(cfg)
    if cfg.algorithm.kl_coef > 0:
        lora = cfg.model.lora.enabled
        models.reference = (
            AdaptersOff(actor) if lora else build_reference(model_dir, device, param_dtype="float32")
        )
    if cfg.algorithm.name == "ppo":
        models.critic = build_critic(model_dir, device, **sharding)
        with torch.no_grad():  # a non-zero head, so that the critic's base gets gradients too
            models.critic.value_head.weight.fill_(0.05)
        models.critic_optimizer = build_optimizer(models.critic, lr=t.lr)
        models.critic_scheduler = build_scheduler(
            models.critic_optimizer, warmup_steps=0, schedule="constant", total_steps=10
        )
    return models


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def direct(
    cfg: ShardRLConfig, models: Models, rows: list[Sample], device: torch.device
) -> dict[str, torch.Tensor]:
    """Logprobs, entropies (and values) of one packed micro-batch of every sample, on every rank alike."""
    sp = seqpar.group(cfg.trainer.sequence_parallel)
    b = batch_to(collate(rows, 0, packed=True), device)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        out["logp"], out["entropy"] = (x.cpu() for x in batch_logprobs(models.actor, b, chunk=5, sp=sp))
        if models.reference is not None:
            out["ref_logp"] = batch_logprobs(models.reference, b, chunk=5, with_entropy=False, sp=sp)[0].cpu()
        if models.critic is not None:
            out["values"] = batch_values(models.critic, b, sp).cpu()
    return {f"direct/{k}": v for k, v in out.items()}


def run_case(model: str, out_dir: Path, case: str, k: int, device: torch.device) -> None:
    from safetensors.torch import save_file

    cfg = config(model, case, k)
    models = build(cfg, device)
    actor: Any = models.actor
    vocab = actor.config.vocab_size
    rows = samples(int(vocab))
    # Tokens this rank's embedding sees in the forward pass of ``direct``: 1/K of the packed row (plus its padding
    # to a multiple of K) when sequence parallelism engaged, the whole row when a setting was ignored.
    seen = [0]
    hook_handle = actor.lm.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.__setitem__(0, seen[0] + args[0].numel())
    )
    dumped = direct(cfg, models, rows, device)
    hook_handle.remove()
    embedded = [0] * tdist.world()
    torch.distributed.all_gather_object(embedded, seen[0])
    updates = 0

    def hook(m: Models) -> None:
        nonlocal updates
        updates += 1
        for part, net in (("actor", m.actor), ("critic", m.critic)):
            for name, p in net.named_parameters() if net is not None else []:
                if p.grad is not None:
                    g = full(p.grad)
                    if updates == 1:
                        dumped[f"first/{part}/{name}"] = g
                    dumped[f"last/{part}/{name}"] = g.clone()

    metrics = train_step(cfg, models, rows, 0, grad_hook=hook)
    if tdist.is_main():
        path = out_dir / f"{case}-k{k}.safetensors"
        save_file(
            {n: v.contiguous() for n, v in dumped.items()},
            str(path),
            metadata={"metrics": json.dumps(metrics), "embedded_tokens": json.dumps(embedded)},
        )


def main() -> None:
    model, out_dir, *cases = sys.argv[1:]
    device = tdist.init("cpu")
    for spec in cases:
        case, ks = spec.split(":")
        for k in ks.split(","):
            run_case(model, Path(out_dir), case, int(k), device)
    tdist.teardown()
    leave(0)  # a finished rank skips the interpreter's finalization, as the trainer does


if __name__ == "__main__":
    main()
