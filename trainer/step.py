"""One training step on one rank: advantages, micro-batches, losses, backward, optimizer update.

Every rank sees the whole step's samples (read from the planned shards), computes the same advantages, and trains on
its token-balanced share.  All ranks run the same number of micro-batches (empty ones still run backward), and
losses are normalised by global token/sequence counts, so the result does not depend on how samples fall on ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from buffer.config import ShardRLConfig
from trainer import dist as tdist
from trainer import ppo
from trainer.data import Sample, assign_to_ranks, collate, microbatches
from trainer.model import clip_grad_norm_, token_logprobs_and_entropy


@dataclass
class Models:
    actor: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    reference: torch.nn.Module | None = None
    critic: Any = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: Any = None


def grpo_sample_advantages(samples: list[Sample], norm_by_std: bool) -> None:
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = ppo.grpo_advantages(rewards, index, norm_by_std)
    for s, a in zip(samples, adv.tolist(), strict=True):
        s.advantage = a


def _padded_microbatches(mine: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """This rank's micro-batches, padded with empty ones up to the count of the busiest rank."""
    mbs = microbatches(mine, max_tokens)
    n = int(tdist.all_reduce_max(float(len(mbs))))
    return mbs + [[] for _ in range(n - len(mbs))]


def _batch(mb: list[Sample], pad_id: int, device: torch.device, like: Sample) -> dict[str, torch.Tensor]:
    """Tensors of a micro-batch; an empty one is a single masked-out row so forward/backward still run."""
    b = collate(mb if mb else [like], pad_id)
    if not mb:
        b["response_mask"].zero_()
    return {k: v.to(device) for k, v in b.items()}


def _counts(mine: list[Sample]) -> tuple[float, float]:
    tokens = tdist.all_reduce_sum(float(sum(len(s.response_ids) for s in mine)))
    seqs = tdist.all_reduce_sum(float(sum(1 for s in mine if s.response_ids)))
    return max(tokens, 1.0), max(seqs, 1.0)


def _policy_terms(
    cfg: ShardRLConfig,
    logp: torch.Tensor,
    b: dict[str, torch.Tensor],
    prox: torch.Tensor,
    counts: tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    a = cfg.algorithm
    mask, adv, behaviour = b["response_mask"], b["advantages"], b["behaviour_logp"]
    g_tok, g_seq = counts
    if a.off_policy == "tis":
        # truncated-IS policy gradient against the behaviour policy: no ratio, a capped weight
        w = ppo.truncated_is_weight(logp.detach(), behaviour, a.tis_cap)
        tok = -w * adv * logp
        loss = ppo.aggregate(tok, mask, a.loss_agg, g_tok, g_seq)
        return loss, {"is_weight": ppo.masked_mean(w, mask)}
    old, weight = (
        (behaviour, None)
        if a.off_policy == "none"
        else (prox, ppo.truncated_is_weight(prox, behaviour, a.tis_cap))
    )
    loss, m = ppo.policy_loss(
        logp, old, adv, mask, a.clip_low, a.clip_high, a.dual_clip, a.loss_agg, g_tok, g_seq, is_weight=weight
    )
    if weight is not None:
        m["is_weight"] = ppo.masked_mean(weight, mask)
    return loss, m


def _ref_logp(models: Models, b: dict[str, torch.Tensor], chunk: int) -> torch.Tensor | None:
    if models.reference is None:
        return None
    with torch.no_grad():
        ref, _ = token_logprobs_and_entropy(
            models.reference,
            b["input_ids"],
            b["attention_mask"],
            None,
            b["response_mask"],
            chunk=chunk,
            with_entropy=False,
        )
    return ref


def _microbatch_loss(
    cfg: ShardRLConfig,
    models: Models,
    b: dict[str, torch.Tensor],
    prox: torch.Tensor | None,
    counts: tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    a, t = cfg.algorithm, cfg.trainer
    logp, ent = token_logprobs_and_entropy(
        models.actor, b["input_ids"], b["attention_mask"], None, b["response_mask"], chunk=t.logprob_chunk
    )
    mask = b["response_mask"]
    proximal = logp.detach() if prox is None else prox
    loss, m = _policy_terms(cfg, logp, b, proximal, counts)
    ent_loss, em = ppo.entropy_bonus(ent, mask, a.entropy_coef, a.loss_agg, *counts)
    loss = loss + ent_loss
    m.update(em)
    ref = _ref_logp(models, b, t.logprob_chunk)
    if ref is not None and a.kl_mode == "loss" and a.kl_coef > 0:
        kl_loss, km = ppo.kl_loss(logp, ref, mask, a.kl_coef, a.kl_estimator, a.loss_agg, *counts)
        loss = loss + kl_loss
        m.update(km)
    m["mismatch_kl"] = ppo.mismatch_kl(logp.detach(), b["behaviour_logp"], mask)
    return loss, m


def _proximal(models: Models, batches: list[dict[str, torch.Tensor]], chunk: int) -> list[torch.Tensor]:
    """Logprobs under the weights before this step's first update (the decoupled objective's proximal policy)."""
    out = []
    with torch.no_grad():
        for b in batches:
            lp, _ = token_logprobs_and_entropy(
                models.actor,
                b["input_ids"],
                b["attention_mask"],
                None,
                b["response_mask"],
                chunk=chunk,
                with_entropy=False,
            )
            out.append(lp)
    return out


def _accumulate(acc: dict[str, float], m: dict[str, torch.Tensor], weight: float) -> None:
    for k, v in m.items():
        acc[k] = acc.get(k, 0.0) + float(v) * weight


def train_step(cfg: ShardRLConfig, models: Models, samples: list[Sample], pad_id: int) -> dict[str, float]:
    """Train on one step's samples (GRPO; all ranks call it with the same list); returns rank-0 metrics."""
    t = cfg.trainer
    device = tdist.current_device()
    grpo_sample_advantages(samples, cfg.algorithm.norm_adv_by_std)
    mine = assign_to_ranks(samples, tdist.world())[tdist.rank()]
    updates = max(1, min(t.updates_per_step, len(mine) or 1))
    minis = [mine[i::updates] for i in range(updates)]
    metrics: dict[str, float] = {}
    grad_norms = []
    for mini in minis:
        counts = _counts(mini)
        batches = [
            _batch(mb, pad_id, device, samples[0])
            for mb in _padded_microbatches(mini, t.max_tokens_per_microbatch)
        ]
        proxs: list[torch.Tensor | None] = (
            list(_proximal(models, batches, t.logprob_chunk)) if updates > 1 else [None] * len(batches)
        )
        for b, prox in zip(batches, proxs, strict=True):
            loss, m = _microbatch_loss(cfg, models, b, prox, counts)
            # FSDP averages gradients over ranks; losses are already normalised by global counts, so undo the mean
            (loss * tdist.world()).backward()
            share = float(b["response_mask"].sum()) / counts[0]
            _accumulate(metrics, m, share / len(minis))
        grad_norms.append(clip_grad_norm_(models.actor.parameters(), t.grad_clip))
        models.optimizer.step()
        models.optimizer.zero_grad(set_to_none=True)
    models.scheduler.step()
    metrics = {k: tdist.all_reduce_sum(v) for k, v in metrics.items()}
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["lr"] = float(models.optimizer.param_groups[0]["lr"])
    metrics["clip_frac"] = metrics.get("clip_frac_low", 0.0) + metrics.get("clip_frac_high", 0.0)
    return metrics
