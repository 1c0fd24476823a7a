"""One training step on every rank: advantages, micro-batches, losses, backward, optimizer updates.

Every rank gets the whole step's samples, splits them into ``trainer.updates_per_step`` mini-batches (one optimizer
update each) and takes its token-balanced share of each.  All ranks run the same number of micro-batches (empty
ones still run forward and backward), and losses are normalised by the mini-batch's global token/sequence counts,
so the gradient does not depend on how samples fall onto micro-batches and ranks.

Before the first update a no-grad pass computes what must come from the weights before this step: reference
logprobs (KL), proximal logprobs (the decoupled objective over several updates, the KL reward penalty) and the token
rewards (the scalar reward on the last response token, minus the KL penalty when ``kl_mode = "reward"``) of the
token-level algorithms: for PPO the critic's old values, GAE advantages and returns, optionally whitened over the
whole step on all ranks; for REINFORCE++ the returns, always whitened that way.  GRPO and RLOO advantages are per
episode (from the rewards of the episodes of the sample's group) and need none of it.  After the step, an adaptive
KL coefficient (``algorithm.kl_target``) moves towards the target by the step's measured KL; ``Models.state``
carries it through checkpoints.

Split episodes.  A multi-turn agent episode may come as several samples (``Sample.episode_key``; split where the
chat template rewrote the history, ``rollout_worker/envs/calls.py``), each with the episode's reward and group.
Every model token is in exactly one of them: what an earlier sample generated is a later one's prompt, context
only, so no token is trained twice.  Per estimator:

- grpo, rloo: the group's mean, std and leave-one-out baseline are over its episodes, one entry each, and every
  sample gets its episode's advantage (``group_sample_advantages``); per sample, an episode split in k would weigh
  k times in its group's statistics, and under RLOO its own reward would be in its own baseline.
- reinforce_pp: nothing to do.  Each token's return is its sample's reward (less the KL penalty to go, with
  ``kl_mode = "reward"``) and the baseline is the whitening over every token of the step, where each model token
  counts once however its episode was split.  With ``kl_mode = "reward"`` an earlier sample's returns miss the
  penalties of the later samples' tokens.
- ppo: nothing changes.  GAE runs per sample, with the reward on each sample's last token: at ``gamma = 1`` every
  token's Monte Carlo return is the episode's reward, as unsplit; at ``gamma < 1`` an earlier sample's tokens are
  discounted from their own sample's end rather than the episode's (a shorter horizon), and no value is
  bootstrapped across the split.

Loss aggregation counts a sample as a sequence.  ``token-mean``, ``token-sum``, ``seq-mean-token-sum`` and
``seq-mean-token-sum-norm`` weigh every model token the same whether or not its episode was split (the sequence
count of ``seq-mean-token-sum`` only scales the whole loss).  ``seq-mean-token-mean`` weighs each sample as one
sequence (its tokens averaged on their own), so an episode split in k weighs k times an unsplit one: pick a
token-weighted mode when that matters for an agent run.  Either way the prefix the samples of an episode share is
never weighed twice: it is never a loss token.

With ``trainer.sequence_parallel = K`` > 1 the K consecutive ranks of a group take the same share and each runs a
chunk of every packed micro-batch (``trainer/sequence_parallel.py``); every rank of a group then holds the group's
whole outputs and losses, so sums over all ranks (counts, metrics) count each group K times and are divided by K,
while the gradients, partial on each rank of a group, are summed over all ranks as they are at K = 1.

Called by ``trainer/loop.py`` (and ``bench/trainer.py``) on every rank with the same samples.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast, overload

import torch
import torch.nn.functional as F

from buffer.config import ShardRLConfig
from trainer import dist as tdist
from trainer import ppo
from trainer import sequence_parallel as seqpar
from trainer.batching import assign_to_ranks, batch_to, collate, microbatches, split_updates
from trainer.data import Sample
from trainer.fused_head import HeadLoss
from trainer.logprobs import TopK, batch_logprobs
from trainer.model import batch_values
from trainer.optim import clip_grad_norm_
from trainer.phases import phase
from trainer.sharding import Kernels, resolve_kernels

Batch = dict[str, torch.Tensor]


@dataclass
class Models:
    actor: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    reference: torch.nn.Module | None = None
    critic: Any = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: Any = None
    kl: ppo.KLController | None = None  # None: the fixed algorithm.kl_coef (and nothing to checkpoint)

    def parts(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Trainable models, optimizers and schedulers by part name, as checkpoints store them."""
        models: dict[str, Any] = {"actor": self.actor}
        optims: dict[str, Any] = {"actor": self.optimizer}
        scheds: dict[str, Any] = {"actor": self.scheduler}
        if self.critic is not None:
            models["critic"], optims["critic"] = self.critic, self.critic_optimizer
            scheds["critic"] = self.critic_scheduler
        return models, optims, scheds

    def state(self) -> dict[str, Any]:
        """Training state that is neither weights nor optimizer nor scheduler, JSON-able, for checkpoints."""
        return {"kl_controller": self.kl.state_dict()} if self.kl is not None else {}

    def load_state(self, saved: dict[str, Any]) -> None:
        """Restore what `state` returned (a checkpoint from before the KL controller existed has none)."""
        if self.kl is not None and "kl_controller" in saved:
            self.kl.load_state_dict(saved["kl_controller"])


def kl_controller(cfg: ShardRLConfig) -> ppo.KLController | None:
    """The KL coefficient's controller: None without a reference model (``kl_coef = 0``)."""
    a = cfg.algorithm
    return ppo.KLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_coef > 0 else None


def _kl_coef(cfg: ShardRLConfig, models: Models) -> float:
    return models.kl.value if models.kl is not None else cfg.algorithm.kl_coef


class LazyBatches(Sequence[Batch]):
    """A mini-batch's micro-batches, each collated and sent to the device when first asked for, then kept.

    The step walks them in order, so micro-batch i+1 is built on the host while the device still runs the work
    launched for micro-batch i (``batch_to`` queues its copies without waiting).  Built all at once before the
    first forward, they kept the device idle at the start of every step: 46 ms of a 2.4 s step at the 7B width
    with four micro-batches of 16,384 tokens, in the profile of ``bench/trainer.py``.
    """

    def __init__(self, build: Callable[[int], Batch], n: int) -> None:
        self._build = build
        self._built: list[Batch | None] = [None] * n

    def __len__(self) -> int:
        return len(self._built)

    @overload
    def __getitem__(self, i: int) -> Batch: ...

    @overload
    def __getitem__(self, i: slice) -> list[Batch]: ...

    def __getitem__(self, i: int | slice) -> Batch | list[Batch]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        b = self._built[i]
        if b is None:
            b = self._built[i] = self._build(i % len(self))
        return b

    def built(self) -> int:
        """How many micro-batches exist so far (a test's view of the laziness)."""
        return sum(b is not None for b in self._built)


@dataclass
class MiniBatch:
    """One optimizer update's share of this rank."""

    samples: list[Sample]
    batches: Sequence[Batch]  # padded with empty micro-batches up to the busiest rank's count
    tokens: list[int]  # response tokens of each micro-batch (0 for the padding ones)
    counts: tuple[float, float]  # response tokens and sequences of the whole mini-batch, all ranks

    def share(self, i: int, n_minis: int) -> float:
        """Micro-batch i's weight in the step's metrics: its fraction of the response tokens (per update)."""
        return self.tokens[i] / self.counts[0] / n_minis


GradHook = Callable[[Models], None]

# The normalisers of one mini-batch's losses: response tokens and sequences of the whole mini-batch (all ranks), and
# the constant response length of seq-mean-token-sum-norm.  The other loss terms take them splatted, in the order
# `ppo.aggregate` takes them.
Counts = ppo.Normalisers


def _loss_counts(cfg: ShardRLConfig, mini: MiniBatch) -> Counts:
    tokens, seqs = mini.counts
    return Counts(tokens, seqs, float(cfg.rollout.sampling.max_response_length))


class _Metrics:
    """Token-weighted sums of per-micro-batch metrics, kept on the device (reading one would stall the stream
    between micro-batches) and reduced over ranks in one collective at the end of the step."""

    def __init__(self, copies: int = 1) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.copies = copies  # ranks that hold the same metrics (a sequence-parallel group)

    def add(self, m: dict[str, torch.Tensor], weight: float) -> None:
        for k, v in m.items():
            term = v.detach().double() * weight
            self.sums[k] = self.sums[k] + term if k in self.sums else term

    def reduced(self) -> dict[str, float]:
        keys = sorted(self.sums)  # the same keys on every rank: they depend on the config only
        if not keys:
            return {}
        t = torch.stack([self.sums[k].to(tdist.current_device()) for k in keys])
        t = tdist.all_reduce_sum(t)
        if self.copies > 1:
            t = t / self.copies
        return dict(zip(keys, t.tolist(), strict=True))


def group_sample_advantages(cfg: ShardRLConfig, samples: list[Sample]) -> None:
    """GRPO / RLOO: each sample's advantage from the rewards of its group's episodes (other algorithms: per token,
    later).

    The statistics are over one entry per episode (``episodes``), and every sample of an episode gets the
    episode's advantage; samples without an ``episode_key`` are an episode each, so a step with no split episode
    gets exactly the per-sample advantages.
    """
    a = cfg.algorithm
    if a.name not in ("grpo", "rloo"):
        return
    of_sample, rewards, group = episodes(samples)
    if a.name == "grpo":
        adv = ppo.grpo_advantages(rewards, group, a.norm_adv_by_std)
    else:
        adv = ppo.rloo_advantages(rewards, group)
    for s, value in zip(samples, adv[of_sample].tolist(), strict=True):
        s.advantage = value


def episodes(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(of_sample, rewards, group)``: each sample's episode [N], and each episode's reward [E] (float64) and group
    [E], episodes in the order of their first sample.

    An episode is a ``(group_id, episode_key)``, or a sample of its own when it has no key.  Its samples carry the
    episode's reward; should they not agree, the episode's reward is their mean.
    """
    index: dict[tuple[str, str, str], int] = {}
    of_sample = [
        index.setdefault(
            (s.group_id, "episode", s.episode_key)
            if s.episode_key is not None
            else (s.group_id, "sample", s.sample_id),
            len(index),
        )
        for s in samples
    ]
    rewards: list[list[float]] = [[] for _ in index]
    groups: dict[str, int] = {}
    group = [0] * len(index)
    for s, e in zip(samples, of_sample, strict=True):
        rewards[e].append(s.reward)
        group[e] = groups.setdefault(s.group_id, len(groups))
    # equal rewards are taken as they are: a mean of copies can be off by an ulp, and a flat group must stay flat
    reward = [rs[0] if min(rs) == max(rs) else math.fsum(rs) / len(rs) for rs in rewards]
    return (
        torch.tensor(of_sample, dtype=torch.long),
        torch.tensor(reward, dtype=torch.float64),
        torch.tensor(group, dtype=torch.long),
    )


def sampling_temperature(cfg: ShardRLConfig) -> float:
    """The temperature the behaviour logprobs were taken at (greedy sampling reports unscaled ones)."""
    t = cfg.rollout.sampling.temperature
    return t if t > 0 else 1.0


# ------------------------------------------------------------------------------------------------- micro-batches


def _padded_microbatches(mine: list[Sample], max_tokens: int, packed: bool) -> list[list[Sample]]:
    """This rank's micro-batches, padded with empty ones up to the count of the busiest rank."""
    mbs = microbatches(mine, max_tokens, packed=packed)
    n = int(tdist.all_reduce_max(float(len(mbs))))
    return mbs + [[] for _ in range(n - len(mbs))]


def _microbatch_of(
    mbs: list[list[Sample]], pad_id: int, device: torch.device, like: Sample, packed: bool, i: int
) -> Batch:
    """Tensors of micro-batch i; an empty one is a single masked-out row so forward/backward still run."""
    mb = mbs[i]
    b = collate(mb if mb else [like], pad_id, packed=packed)
    if not mb:
        b["response_mask"].zero_()
    return batch_to(b, device)


def _counts(mine: list[Sample], copies: int = 1) -> tuple[float, float]:
    # tokens the loss is taken over: a multi-turn sample's environment tokens are masked out (``Sample.loss_tokens``)
    local = [float(sum(s.loss_tokens for s in mine)), float(sum(1 for s in mine if s.loss_tokens))]
    total = tdist.all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=tdist.current_device()))
    if copies > 1:  # every rank of a sequence-parallel group holds the same share
        total = total / copies
    return max(float(total[0]), 1.0), max(float(total[1]), 1.0)


def _sp(cfg: ShardRLConfig) -> seqpar.SPGroup | None:
    """The sequence-parallel group (created by ``train_step``'s first call on every rank, cached after)."""
    return seqpar.group(cfg.trainer.sequence_parallel)


def _data_parallel(cfg: ShardRLConfig) -> tuple[int, int]:
    sp = _sp(cfg)
    return sp.data_parallel() if sp is not None else (tdist.world(), tdist.rank())


def minibatches(cfg: ShardRLConfig, samples: list[Sample], pad_id: int) -> list[MiniBatch]:
    """This rank's share of every update of the step, as device tensors."""
    t, device = cfg.trainer, tdist.current_device()
    world, rank = _data_parallel(cfg)
    out = []
    for part in split_updates(samples, t.updates_per_step):
        mine = assign_to_ranks(part, world)[rank]
        mbs = _padded_microbatches(mine, t.max_tokens_per_microbatch, t.packing)
        shortest = min(samples, key=lambda s: s.length)  # the stand-in of empty micro-batches: cheapest
        batches = LazyBatches(partial(_microbatch_of, mbs, pad_id, device, shortest, t.packing), len(mbs))
        tokens = [sum(s.loss_tokens for s in mb) for mb in mbs]  # as `_counts` counts them: shares sum to 1
        out.append(MiniBatch(mine, batches, tokens, _counts(mine, t.sequence_parallel)))
    return out


# ------------------------------------------------------------------------------------- before the first update


def _logp(
    model: torch.nn.Module,
    b: Batch,
    cfg: ShardRLConfig,
    with_entropy: bool,
    topk: TopK | None = None,
    loss: HeadLoss | None = None,
) -> tuple[torch.Tensor, ...]:
    return batch_logprobs(
        model,
        b,
        chunk=cfg.trainer.logprob_chunk,
        temperature=sampling_temperature(cfg),
        with_entropy=with_entropy,
        sp=_sp(cfg),
        topk=topk,
        loss=loss,
    )


# The reference's top tokens of a micro-batch, for kl_estimator = "topk": kept on the batch between prepare and the
# loss under these keys (TopK's index, logp and rest).
_TOPK_KEYS = ("ref_top_index", "ref_top_logp", "ref_top_rest")


def _reference_pass(cfg: ShardRLConfig, models: Models, b: Batch) -> None:
    """The reference's logprobs of the batch's tokens, and with kl_estimator = "topk" its top tokens."""
    assert models.reference is not None
    a = cfg.algorithm
    top = TopK(a.kl_top_k) if a.kl_estimator == "topk" else None
    b["ref_logp"] = _logp(models.reference, b, cfg, with_entropy=False, topk=top)[0]
    if top is not None:
        assert top.index is not None and top.logp is not None and top.rest is not None  # the pass filled it
        b.update(zip(_TOPK_KEYS, (top.index, top.logp, top.rest), strict=True))


def _topk_of(cfg: ShardRLConfig, b: Batch) -> TopK | None:
    """The reference's top tokens ``prepare`` kept on ``b``, for the actor's pass to write its KL into."""
    if _TOPK_KEYS[0] not in b:  # only a topk run's reference pass keeps them
        return None
    index, logp, rest = (b[k] for k in _TOPK_KEYS)
    return TopK(cfg.algorithm.kl_top_k, index=index, logp=logp, rest=rest)


def _kl_in_reward(cfg: ShardRLConfig) -> bool:
    return cfg.algorithm.kl_coef > 0 and cfg.algorithm.kl_mode == "reward"


def _gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo.gae`` from the first response column on: prompts come first, so the columns before are all masked."""
    cols = mask.bool().any(dim=0).nonzero()
    lo = int(cols[0]) if cols.numel() else mask.shape[1]
    adv, ret = ppo.gae(rewards[:, lo:], values[:, lo:], mask[:, lo:], gamma, lam)
    return F.pad(adv, (lo, 0)), F.pad(ret, (lo, 0))


def _token_rewards(cfg: ShardRLConfig, models: Models, b: Batch, m: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sequence reward on its last response token, minus the KL penalty on every token with kl_mode = "reward"
    (its token-mean goes into ``m`` as ``kl_ref``)."""
    mask = b["response_mask"]
    rewards = ppo.scalar_reward_to_tokens(b["rewards"], mask)
    if _kl_in_reward(cfg):
        # the config refuses "topk" with kl_mode = "reward"
        kind = cast(ppo.KLKind, cfg.algorithm.kl_estimator)
        kl = ppo.kl_estimate(b["prox_logp"], b["ref_logp"], kind) * mask
        rewards = rewards - _kl_coef(cfg, models) * kl
        m["kl_ref"] = ppo.masked_mean(kl, mask)
    return rewards


def _ppo_targets(cfg: ShardRLConfig, models: Models, b: Batch) -> dict[str, torch.Tensor]:
    """Old values, token rewards, GAE advantages and returns of one micro-batch (written into ``b``)."""
    a = cfg.algorithm
    assert a.name == "ppo"
    mask = b["response_mask"]
    b["old_values"] = batch_values(models.critic, b, _sp(cfg))
    m: dict[str, torch.Tensor] = {}
    rewards = _token_rewards(cfg, models, b, m)
    b["advantages"], b["returns"] = _gae(rewards, b["old_values"], mask, a.gamma, a.lam)
    m["returns_mean"] = ppo.masked_mean(b["returns"], mask)
    m["old_value_mean"] = ppo.masked_mean(b["old_values"], mask)
    return m


def _reinforce_pp_returns(cfg: ShardRLConfig, models: Models, b: Batch) -> dict[str, torch.Tensor]:
    """REINFORCE++ returns of one micro-batch, written into ``b`` as its advantages (whitened afterwards over the
    whole step, which makes them ``ppo.reinforce_pp_advantages`` of the step's batch)."""
    m: dict[str, torch.Tensor] = {}
    mask = b["response_mask"]
    b["advantages"] = ppo.reinforce_pp_returns(_token_rewards(cfg, models, b, m), mask)
    m["returns_mean"] = ppo.masked_mean(b["advantages"], mask)
    return m


def _whiten_over_ranks(batches: list[Batch], eps: float = 1e-8) -> None:
    """``ppo.whiten`` of the advantages of the whole step on all ranks: mean and population variance over every
    rank's response tokens (``ppo.whiten`` alone would whiten each rank's share differently)."""
    device = tdist.current_device()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for b in batches:
        m = b["response_mask"].bool()
        total += torch.stack([b["advantages"][m].double().sum(), m.sum().double()])
    tdist.all_reduce_sum(total)
    mean = total[0] / total[1].clamp(min=1)
    sq = torch.zeros(1, dtype=torch.float64, device=device)
    for b in batches:
        m = b["response_mask"].bool()
        sq += ((b["advantages"][m].double() - mean) ** 2).sum()
    var = tdist.all_reduce_sum(sq)[0] / total[1].clamp(min=1)
    scale = torch.rsqrt(var + eps)
    for b in batches:
        m = b["response_mask"].bool()
        whitened = ((b["advantages"].double() - mean) * scale).to(b["advantages"].dtype)
        b["advantages"] = torch.where(m, whitened, torch.zeros_like(whitened))


@torch.no_grad()
def prepare(cfg: ShardRLConfig, models: Models, minis: list[MiniBatch], metrics: _Metrics) -> None:
    """Everything that needs the weights before the step's first update, added to each micro-batch."""
    a = cfg.algorithm
    targets = {"ppo": _ppo_targets, "reinforce_pp": _reinforce_pp_returns}.get(a.name)
    # With one update the proximal policy is the current one: its logprobs are the actor's own, detached.
    need_prox = (a.off_policy == "decoupled" and len(minis) > 1) or _kl_in_reward(cfg)
    # Nothing to add: the micro-batches stay unbuilt until the update asks for them (``LazyBatches``).
    passes = models.reference is not None or need_prox or targets is not None
    for mini in minis if passes else []:
        for i, b in enumerate(mini.batches):
            if models.reference is not None:
                _reference_pass(cfg, models, b)
            if need_prox:
                b["prox_logp"] = _logp(models.actor, b, cfg, with_entropy=False)[0]
            if targets is not None:
                metrics.add(targets(cfg, models, b), mini.share(i, len(minis)))
    if a.name == "reinforce_pp" or (a.name == "ppo" and a.whiten_advantages):
        _whiten_over_ranks([b for mini in minis for b in mini.batches])


# ------------------------------------------------------------------------------------------------------ losses


def _policy_terms(
    cfg: ShardRLConfig,
    logp: torch.Tensor,
    b: Batch,
    prox: torch.Tensor,
    counts: Counts,
    metrics: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    a = cfg.algorithm
    mask, adv, behaviour = b["response_mask"], b["advantages"], b["behaviour_logp"]
    level = a.off_policy_level
    if a.off_policy == "tis":
        # truncated-IS policy gradient against the behaviour policy: no ratio, a capped weight
        w = ppo.truncated_is_weight(logp.detach(), behaviour, a.tis_cap, mask, level)
        tok = -w * adv * logp
        loss = ppo.aggregate(tok, mask, a.loss_agg, *counts)
        return loss, {"is_weight": ppo.masked_mean(w, mask)} if metrics else {}
    old, weight = (
        (behaviour, None)
        if a.off_policy == "none"
        else (prox, ppo.truncated_is_weight(prox, behaviour, a.tis_cap, mask, level))
    )
    ratio_level: ppo.Level = "sequence" if a.policy_loss == "gspo" else "token"
    loss, m = ppo.policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip,
        agg_mode=a.loss_agg,
        norms=counts,
        is_weight=weight,
        ratio_level=ratio_level,
        metrics=metrics,
    )
    if not metrics:
        return loss, m
    if weight is not None:
        m["is_weight"] = ppo.masked_mean(weight, mask)
    if a.dual_clip is None:
        m.pop("dual_clip_frac", None)  # no dual clip: nothing was measured
    return loss, m


def _value_terms(
    cfg: ShardRLConfig, models: Models, b: Batch, counts: Counts
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    a, mask = cfg.algorithm, b["response_mask"]
    assert a.name == "ppo"
    values = batch_values(models.critic, b, _sp(cfg))
    loss, m = ppo.value_loss(values, b["old_values"], b["returns"], mask, a.value_clip, a.loss_agg, *counts)
    return a.value_coef * loss, m


def fused_head_applies(cfg: ShardRLConfig) -> bool:
    """Whether ``trainer.fused_head`` is on and the actor's loss is a sum of per-token terms, as the fused head
    needs (``trainer/fused_head.py``): GSPO's ratio and a sequence-level weight of the current policy couple a
    sequence's tokens, and a KL over the reference's top tokens is taken inside the recomputing head."""
    a, t = cfg.algorithm, cfg.trainer
    couples = a.policy_loss == "gspo" or (a.off_policy == "tis" and a.off_policy_level == "sequence")
    topk = a.kl_estimator == "topk" and a.kl_coef > 0 and a.kl_mode == "loss"
    return t.fused_head and not couples and not topk and t.sequence_parallel == 1


@functools.cache
def head_compiled(setting: bool | None, kernels: Kernels, device_type: str) -> bool:
    """``trainer.compile_head``, or where it is unset, whether ``trainer.kernels`` compiles the decoder layers on
    this device.  Cached: it is asked once per micro-batch, and an ``auto`` without a C compiler warns once."""
    if setting is not None:
        return setting
    return resolve_kernels(kernels, torch.device(device_type)) == "compile"


def _microbatch_loss(
    cfg: ShardRLConfig, models: Models, b: Batch, counts: Counts
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # The entropy is computed only when it is in the loss: inside the checkpointed LM-head chunks it would otherwise
    # be recomputed in backward just for a metric (measured: ~4% of a 1.5B step on H200).
    with_entropy = cfg.algorithm.entropy_coef > 0
    top = _topk_of(cfg, b)
    head = None
    if top is None and fused_head_applies(cfg):
        head = HeadLoss(
            lambda lp, en: _actor_terms(cfg, models, b, lp, en, counts, None, metrics=False)[0],
            head_compiled(cfg.trainer.compile_head, cfg.trainer.kernels, tdist.current_device().type),
        )
    logp, ent = _logp(models.actor, b, cfg, with_entropy=with_entropy, topk=top, loss=head)
    if head is not None and head.carrier is not None:
        # the head took the loss's gradient in forward: the loss's value from the detached logprobs, its gradient
        # through the carrier (value 0)
        with torch.no_grad():
            loss, m = _actor_terms(cfg, models, b, logp, ent, counts, None)
        loss = loss + head.carrier
    else:
        loss, m = _actor_terms(cfg, models, b, logp, ent, counts, top)
    if models.critic is not None:
        v_loss, vm = _value_terms(cfg, models, b, counts)
        loss = loss + v_loss
        m.update(vm)
    return loss, m


def _actor_terms(
    cfg: ShardRLConfig,
    models: Models,
    b: Batch,
    logp: torch.Tensor,
    ent: torch.Tensor,
    counts: Counts,
    top: TopK | None,
    metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss from its logprobs and entropies [B, T]: the policy terms, the entropy bonus and the KL to
    the reference; and its metrics, unless ``metrics`` is false (the fused head's per-chunk gradients: the
    micro-batch's metrics come from one more evaluation of the loss, without grad)."""
    a = cfg.algorithm
    mask = b["response_mask"]
    loss, m = _policy_terms(cfg, logp, b, b.get("prox_logp", logp.detach()), counts, metrics)
    if a.entropy_coef > 0:
        ent_loss, em = ppo.entropy_bonus(ent, mask, a.entropy_coef, a.loss_agg, *counts)
        loss = loss + ent_loss
        m.update(em)
    if "ref_logp" in b and a.kl_mode == "loss":
        coef = _kl_coef(cfg, models)
        if top is not None and top.kl is not None:
            kl_loss, km = ppo.kl_penalty(top.kl, mask, coef, a.loss_agg, counts)
        else:
            kind = cast(ppo.KLKind, a.kl_estimator)  # "topk" is computed above, whenever a reference pass ran
            kl_loss, km = ppo.kl_loss(logp, b["ref_logp"], mask, coef, kind, a.loss_agg, *counts)
        loss = loss + kl_loss
        m.update(km)
    if metrics:
        m["mismatch_kl"] = ppo.mismatch_kl(logp.detach(), b["behaviour_logp"], mask)
    return loss, m


# ------------------------------------------------------------------------------------------------------ update


def _apply(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[float, bool]:
    """Clip to the global norm and step; a non-finite norm (same on every rank) skips the update."""
    norm = clip_grad_norm_(model.parameters(), max_norm)
    ok = math.isfinite(norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, ok


def _update(models: Models, max_norm: float, norms: dict[str, list[float]]) -> None:
    pairs = [("grad_norm", models.actor, models.optimizer)]
    if models.critic is not None and models.critic_optimizer is not None:
        pairs.append(("critic_grad_norm", models.critic, models.critic_optimizer))
    for name, model, optimizer in pairs:
        norm, ok = _apply(model, optimizer, max_norm)
        norms.setdefault(name, []).append(norm)
        norms.setdefault("skipped_updates", []).append(0.0 if ok else 1.0)


def train_step(
    cfg: ShardRLConfig,
    models: Models,
    samples: list[Sample],
    pad_id: int,
    grad_hook: GradHook | None = None,
) -> dict[str, float]:
    """Train on one step's samples (all ranks call it with the same list); returns metrics (same on all ranks).

    ``grad_hook(models)``, when given, runs after the backward of each update, before clipping (a debugging aid).
    """
    _check_sequence_parallel(cfg, models)
    # host work while the device idles; the micro-batches' tensors are built later, each behind the previous one's work
    with phase("batches"):
        group_sample_advantages(cfg, samples)
        minis = minibatches(cfg, samples, pad_id)
    metrics = _Metrics(cfg.trainer.sequence_parallel)
    with phase("prepare"):
        prepare(cfg, models, minis, metrics)
    norms: dict[str, list[float]] = {}
    for mini in minis:
        for i, b in enumerate(mini.batches):
            with phase("forward"):
                loss, m = _microbatch_loss(cfg, models, b, _loss_counts(cfg, mini))
            with phase("backward"):
                # FSDP averages gradients over ranks; the losses are normalised by global counts: undo the mean
                (loss * tdist.world()).backward()
            metrics.add(m, mini.share(i, len(minis)))
            # the losses are normalised by global counts: their sum over micro-batches and ranks is the update's
            metrics.add({"loss": loss.detach()}, 1.0 / len(minis))
        if grad_hook is not None:
            grad_hook(models)
        with phase("optimizer"):
            _update(models, cfg.trainer.grad_clip, norms)
    for sched in (models.scheduler, models.critic_scheduler):
        if sched is not None:
            sched.step()
    with phase("metrics"):
        out = metrics.reduced()
    out.update({k: sum(v) / len(v) for k, v in norms.items() if k != "skipped_updates"})
    out["skipped_updates"] = sum(norms["skipped_updates"])
    out["lr"] = float(models.optimizer.param_groups[0]["lr"])
    if "clip_frac_low" in out or "clip_frac_high" in out:  # a ratio was clipped against (not with tis)
        out["clip_frac"] = out.get("clip_frac_low", 0.0) + out.get("clip_frac_high", 0.0)
    out.update(sample_metrics(samples, cfg.rollout.sampling.max_response_length))
    _adapt_kl(cfg, models, out, len(samples))
    return out


def _check_sequence_parallel(cfg: ShardRLConfig, models: Models) -> None:
    """Refuse a K the world size or a model's heads do not allow (one line), and create the group (a collective)."""
    k = cfg.trainer.sequence_parallel
    if k == 1:
        return
    seqpar.check_world(k, tdist.world())
    seqpar.check_heads(k, models.actor.config)
    if models.critic is not None:
        seqpar.check_heads(k, models.critic.base.config)
    _sp(cfg)


def sample_metrics(samples: list[Sample], max_response_length: int) -> dict[str, float]:
    """What the step's samples were: response length mean/max, the fraction that used the whole response budget
    (truncated, or ending exactly there), reward mean/std."""
    if not samples:
        return {}
    lengths = [len(s.response_ids) for s in samples]
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    return {
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "truncated_frac": sum(1 for n in lengths if n >= max_response_length) / len(lengths),
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
    }


def _adapt_kl(cfg: ShardRLConfig, models: Models, out: dict[str, float], n_samples: int) -> None:
    """Log the KL coefficient this step used, then let the controller react to the step's KL (the reduced metric,
    the same number on every rank, so every rank's coefficient stays the same)."""
    if cfg.algorithm.kl_coef <= 0:
        return
    out["kl_coef"] = _kl_coef(cfg, models)
    if models.kl is not None and "kl_ref" in out:
        models.kl.update(out["kl_ref"], n_samples)
