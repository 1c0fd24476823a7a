"""Advantages and losses of the trainer: pure functions of tensors.

Everything the trainer computes between "a micro-batch of logprobs/values" and "a scalar to call backward on" lives
here: GRPO, RLOO, REINFORCE++ and GAE advantages, KL estimators and the adaptive KL coefficient, the clipped policy
loss (token-level PPO ratio or GSPO's sequence-level one), the clipped value loss, truncated importance weights (per
token or per sequence) and the loss aggregation modes.  Nothing here reads a config object or talks to other ranks;
`trainer/step.py` passes plain floats and strings and, for aggregation, the token and sequence counts of the whole
optimizer step, so that a loss does not depend on how samples fell onto micro-batches and ranks.

Shapes: ``B`` sequences per micro-batch, ``T`` response tokens (right-padded), ``N`` samples.  A ``mask`` is ``[B, T]``
(bool or 0/1 float) and marks the response tokens that are trained on.  Per-token outputs are 0 where the mask is 0.
Tested on CPU against hand-computed values in ``tests/unit/test_ppo.py`` and ``tests/unit/test_algorithms.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

AggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
KLKind = Literal["k1", "k2", "k3"]
Level = Literal["token", "sequence"]
Metrics = dict[str, torch.Tensor]

# Log-ratios are clamped before exp(): one wildly off token (e.g. a sample far behind the current policy) must give
# a large but finite number, not inf/NaN that would poison the whole step.
_MAX_LOG_RATIO = 20.0
# k3 is clamped to this range: a token whose reference logprob is far off gives exp(|d|), which would otherwise
# dominate the whole step's KL term (and its gradient) on its own.
_MAX_K3 = 10.0


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is set.  ``x`` and ``mask`` [B, T] -> scalar."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the masked-in positions (0 when there are none).  [B, T], [B, T] -> scalar."""
    return masked_sum(x, mask) / mask.bool().sum().clamp(min=1)


# --------------------------------------------------------------------------------------------------------- advantages


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its group's mean, optionally over the group's std.

    ``rewards`` [N] (one scalar per sample), ``group_index`` [N] integer group id per sample (any ids, in any
    order) -> advantages [N] in the floating dtype of ``rewards`` (float32 for integer rewards).

    ``norm_by_std=True`` divides by ``std + eps`` with the population std (``unbiased=False``): it is defined for
    every group size, and a group of G samples always has unit mean-square advantage whatever G is.
    ``norm_by_std=False`` is Dr.GRPO (centring only).  A group of one sample, or whose rewards are all equal, has
    nothing to compare against and gets exactly 0 (not a rounding residue divided by eps).
    """
    out_dtype = _check_groups(rewards, group_index)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    r, g, count, flat = _groups(rewards, group_index)
    zeros = torch.zeros(count.numel(), dtype=torch.float64, device=r.device)
    centred = r - (zeros.index_add(0, g, r) / count)[g]
    if norm_by_std:
        std = (zeros.index_add(0, g, centred**2) / count).sqrt()
        centred = centred / (std[g] + eps)
    return torch.where(flat, torch.zeros_like(centred), centred).to(out_dtype)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: each reward minus the mean of the *other* rewards of its group.

    ``rewards`` [N], ``group_index`` [N] (as for `grpo_advantages`) -> advantages [N].  For a group of G samples
    ``A_i = r_i - (sum_j r_j - r_i) / (G - 1) = G / (G - 1) * (r_i - mean)``: the baseline does not depend on the
    sample it is subtracted from, so the estimate stays unbiased.  No std normalisation.  A group of one sample has
    no other sample to compare against, and a group of equal rewards nothing to learn: both get exactly 0.
    """
    out_dtype = _check_groups(rewards, group_index)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    r, g, count, flat = _groups(rewards, group_index)
    total = torch.zeros(count.numel(), dtype=torch.float64, device=r.device).index_add(0, g, r)
    others = (count[g] - 1).clamp(min=1)
    adv = r - (total[g] - r) / others
    return torch.where(flat | (count[g] < 2), torch.zeros_like(adv), adv).to(out_dtype)


def _check_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.dtype:
    """The output dtype of a group estimator; refuses inputs that are not two matching [N] tensors."""
    if rewards.dim() != 1 or rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards and group_index must both be [N]; got {rewards.shape} and {group_index.shape}"
        )
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _groups(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(r, g, count, flat)``: float64 rewards [N], dense group of each sample [N], group sizes [G], and whether
    each sample's group has all-equal rewards [N] (tested exactly, so that rounding residues cannot leak out)."""
    r = rewards.detach().to(torch.float64)
    _, g, count = torch.unique(group_index, return_inverse=True, return_counts=True)
    zeros = torch.zeros(count.numel(), dtype=torch.float64, device=r.device)
    lo = zeros.scatter_reduce(0, g, r, "amin", include_self=False)
    hi = zeros.scatter_reduce(0, g, r, "amax", include_self=False)
    return r, g, count, (lo == hi)[g]


def scalar_reward_to_tokens(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last masked-in token.

    ``reward`` [B], ``mask`` [B, T] -> [B, T], zero everywhere else.  A row with no masked-in token gets no reward.
    """
    B, T = mask.shape
    m = mask.bool()
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(B, T, dtype=reward.dtype, device=reward.device)
    rows = torch.arange(B, device=mask.device)
    has_any = last >= 0
    out[rows[has_any], last[has_any]] = reward.detach()[has_any]
    return out


@torch.no_grad()
def gae(
    rewards_tok: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens of each sequence.

    ``rewards_tok``, ``values``, ``mask`` [B, T] -> ``(advantages, returns)``, both [B, T] and 0 where masked.

    ``values[b, t]`` is the critic's estimate before token t is generated.  With ``d_t = r_t + gamma * V_next - V_t``
    the recursion is ``A_t = d_t + gamma * lam * A_next`` and ``returns = A + V``.  "Next" means the next masked-in
    token of the same row; after the last one the episode has ended, so ``V_next = A_next = 0``.  Masked positions are
    skipped rather than treated as terminal, which makes right padding (any lengths) and masked-out spans inside a
    response both come out right.  Inputs are treated as data (no gradient).
    """
    B, T = mask.shape
    m = mask.bool()
    r = rewards_tok.to(values.dtype)
    next_v = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_a = torch.zeros_like(next_v)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(m[:, t], a, torch.zeros_like(a))
        next_v = torch.where(m[:, t], values[:, t], next_v)
        next_a = torch.where(m[:, t], a, next_a)
    returns = torch.where(m, adv + values, torch.zeros_like(values))
    return adv, returns


@torch.no_grad()
def reinforce_pp_returns(rewards_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ returns: at each response token, the sum of the token rewards from it to the end (gamma = 1).

    ``rewards_tok``, ``mask`` [B, T] -> [B, T], 0 where masked.  With the scalar reward on the last token
    (`scalar_reward_to_tokens`) every token's return is the sequence's reward; with a per-token KL penalty in the
    reward (``kl_mode = "reward"``) token t's return is ``reward - coef * sum over s >= t of kl_s``.
    """
    m = mask.bool()
    r = torch.where(m, rewards_tok, torch.zeros_like(rewards_tok))
    to_go = r.flip(1).cumsum(1).flip(1)
    return torch.where(m, to_go, torch.zeros_like(to_go))


def reinforce_pp_advantages(rewards_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ advantages: `reinforce_pp_returns` whitened over every masked-in token of the batch.

    ``rewards_tok``, ``mask`` [B, T] -> [B, T].  No critic and no group baseline: the batch mean is the baseline and
    the batch std the scale.  Whiten the whole step's batch (``trainer/step.py`` does it across ranks), not a
    micro-batch, or each micro-batch gets a baseline of its own.
    """
    return whiten(reinforce_pp_returns(rewards_tok, mask), mask)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked-in positions.

    ``x``, ``mask`` [B, T] -> [B, T], 0 where masked.  Population variance (``unbiased=False``).  With
    ``shift_mean=False`` the mean is added back (only the scale changes), so the sign of each advantage relative to
    the batch mean survives.  Statistics are over this tensor only: whiten the whole step's batch, not a micro-batch.
    """
    m = mask.bool()
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------------------------------- KL


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled by pi.

    ``logp``, ``ref_logp`` [B, T] -> [B, T] (no masking; aggregate with a mask).  With ``d = logp - ref_logp``:
    ``k1 = d`` (unbiased, can be negative), ``k2 = d**2 / 2`` (biased, low variance),
    ``k3 = exp(-d) + d - 1`` (unbiased, always >= 0), clamped to [-10, 10]: past 10 a token carries no gradient, so
    one token the reference finds very unlikely cannot outweigh the rest of the batch (``d`` is also clamped to +-20
    inside the exp, so the clamp never sees inf).
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        neg = (-d).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(neg) - neg - 1.0).clamp(-_MAX_K3, _MAX_K3)
    raise ValueError(f"kl estimator must be one of k1, k2, k3; got {kind!r}")


def mismatch_kl(
    train_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """How far the trainer's logprobs are from those the sampler reported, as a detached scalar metric.

    ``train_logp``, ``behaviour_logp``, ``mask`` [B, T] -> scalar: masked token-mean estimate of
    KL(behaviour || train).  The tokens were sampled by the behaviour policy, so it is the "pi" of `kl_estimate`.
    """
    return masked_mean(kl_estimate(behaviour_logp.detach(), train_logp.detach(), kind), mask)


def truncated_is_weight(
    proximal_or_current_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    cap: float,
    mask: torch.Tensor | None = None,
    level: Level = "token",
) -> torch.Tensor:
    """Truncated importance weight ``min(exp(a - b), cap)``, detached, per token or per sequence.

    [B, T], [B, T] (and ``mask`` [B, T] for ``level="sequence"``) -> [B, T].  ``a`` is the policy the update is taken
    against (the current policy for plain truncated IS, the proximal policy for the decoupled objective), ``b`` the
    policy that sampled the tokens.  ``level="token"`` weighs each token by its own ratio; ``level="sequence"`` gives
    every token of a sequence the sequence's ratio ``min(exp(sum over its masked-in tokens of a - b), cap)``, the
    importance weight of the whole response (lower variance per token, but one bad token reweighs the sequence).
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0; got {cap}")
    log_w = (proximal_or_current_logp - behaviour_logp).detach()
    if level == "sequence":
        if mask is None:
            raise ValueError("a sequence-level importance weight needs the mask")
        m = mask.bool()
        per_seq = torch.where(m, log_w, torch.zeros_like(log_w)).sum(dim=1, keepdim=True)
        log_w = per_seq.expand_as(log_w)
    elif level != "token":
        raise ValueError(f"importance weight level must be token or sequence; got {level!r}")
    return torch.exp(log_w.clamp(max=math.log(cap)))


# ------------------------------------------------------------------------------------------------------------ losses


AGG_MODES: tuple[AggMode, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)


def aggregate(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    mode: AggMode,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] with ``mask`` [B, T] to a scalar.

    - ``token-mean``: ``sum(loss * mask) / global_tokens``.
    - ``seq-mean-token-mean``: ``sum over seqs of (sum of the seq's loss / its token count) / global_seqs``.
    - ``seq-mean-token-sum``: ``sum over seqs of (sum of the seq's loss) / global_seqs``.
    - ``seq-mean-token-sum-norm``: ``sum over seqs of (sum of the seq's loss / norm_length) / global_seqs``, Dr.GRPO's
      constant normaliser: every token weighs the same whatever its sequence's length and the batch's token count
      (``norm_length`` is the maximum response length of the run, a constant).
    - ``token-sum``: ``sum(loss * mask)``, no normaliser (the loss scale grows with the batch).

    ``global_tokens`` / ``global_seqs`` are the masked-in token count and the count of sequences with at least one
    masked-in token over the whole optimizer step (all micro-batches, all ranks).  Given them, per-micro-batch
    results add up to the loss of the whole batch however samples were split.  (FSDP2 averages gradients over ranks,
    so the caller scales by the world size or reduces with a sum.)  Without them the local counts are used, which
    makes this a plain mean over the given tensor; an empty tensor then gives 0.  Without ``norm_length`` the padded
    width ``T`` is used, which differs between micro-batches: pass the constant for a split-invariant loss.
    """
    m = mask.bool()
    masked = torch.where(m, loss_tok, torch.zeros_like(loss_tok))
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-mean":
        return masked.sum() / _denominator(global_tokens, m.sum(), "global_tokens")
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation must be one of {', '.join(AGG_MODES)}; got {mode!r}")
    per_seq = masked.sum(dim=1)
    seq_tokens = m.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / seq_tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / _denominator(norm_length, torch.tensor(float(m.shape[1])), "norm_length")
    denom = _denominator(global_seqs, (seq_tokens > 0).sum(), "global_seqs")
    return per_seq.sum() / denom


def _denominator(given: float | None, local: torch.Tensor, name: str) -> torch.Tensor | float:
    if given is None:
        return local.clamp(min=1)
    if given <= 0:
        raise ValueError(f"{name} must be > 0; got {given}")
    return given


class Normalisers(NamedTuple):
    """The denominators `aggregate` divides by, over the whole optimizer step (see there); None = the local count
    (or, for ``length``, the padded width)."""

    tokens: float | None = None  # masked-in response tokens, all micro-batches and ranks
    seqs: float | None = None  # sequences with at least one masked-in token, likewise
    length: float | None = None  # seq-mean-token-sum-norm's constant: the run's maximum response length


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    agg_mode: AggMode,
    norms: Normalisers = Normalisers(),
    is_weight: torch.Tensor | None = None,
    ratio_level: Level = "token",
    metrics: bool = True,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped PPO surrogate with asymmetric clipping, optional dual clip and optional per-token weight.

    ``logp`` (with grad), ``old_logp``, ``advantages``, ``mask``, ``is_weight`` [B, T] -> ``(loss, metrics)``;
    ``norms`` are the normalisers of `aggregate`.

    ``ratio = exp(logp - old_logp)``; per token ``max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``.
    With ``dual_clip = c > 1``, tokens with ``A < 0`` are further capped at ``-c * A``: a token whose ratio has
    exploded (a stale or off-policy sample) then contributes a bounded loss and no gradient.  ``is_weight``
    multiplies the per-token loss (truncated IS against the behaviour policy; for the decoupled objective
    ``old_logp`` is the proximal policy and ``is_weight`` the proximal/behaviour weight).  Then `aggregate`.

    ``ratio_level="sequence"`` is GSPO: every token of a sequence uses the sequence's ratio, the geometric mean of its
    token ratios ``s = exp(mean over its masked-in tokens of logp - old_logp)`` (see `sequence_log_ratio`), so the
    clip keeps or cuts whole sequences, and a length-normalised ratio stays near 1 for long responses too.  The dual
    clip applies to that ratio as it does to a token's when given; GSPO itself has none, and the config leaves it
    off with ``policy_loss = "gspo"`` unless ``algorithm.dual_clip`` is set.

    Metrics (masked token-means, detached): ``clip_frac_low`` / ``clip_frac_high`` are the tokens where the lower
    (``A < 0``) / upper (``A > 0``) clip is active, i.e. their gradient is cut; ``dual_clip_frac`` the tokens
    bounded by the dual clip; ``approx_kl`` the k3 estimate of KL(old || current) from the token ratios, the tokens
    being from ``old``.  ``metrics=False`` leaves them out (an empty dict): a caller that evaluates the loss once per
    chunk of the LM head only for its gradient (``trainer/fused_head.py``) would compute them for nothing.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None); got {dual_clip}")
    old_logp = old_logp.detach()
    adv = advantages.detach()
    tok_log_ratio = (logp - old_logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if ratio_level == "sequence":
        log_ratio = sequence_log_ratio(logp, old_logp, mask)
    elif ratio_level == "token":
        log_ratio = tok_log_ratio
    else:
        raise ValueError(f"ratio level must be token or sequence; got {ratio_level!r}")
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual_active = (adv < 0) & (loss_tok > bound)
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, bound), loss_tok)
    if is_weight is not None:
        loss_tok = loss_tok * is_weight.detach()
    loss = aggregate(loss_tok, mask, agg_mode, norms.tokens, norms.seqs, norms.length)
    if not metrics:
        return loss, {}
    r = ratio.detach()
    cut = clipped.detach() > unclipped.detach()
    tok_lr = tok_log_ratio.detach()
    return loss, {
        "clip_frac_low": masked_mean((cut & (r < 1.0)).float(), mask),
        "clip_frac_high": masked_mean((cut & (r > 1.0)).float(), mask),
        "dual_clip_frac": masked_mean(dual_active.float(), mask),
        # k3 with the roles swapped: the tokens were sampled by old, so this estimates KL(old || current).
        "approx_kl": masked_mean(torch.exp(tok_lr) - 1.0 - tok_lr, mask),
    }


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's log-ratio, per token: its value is the sequence's mean log-ratio, its gradient that of the token's logp.

    ``logp`` (with grad), ``old_logp``, ``mask`` [B, T] -> [B, T].  The value at every position of row b is
    ``mean over the masked-in tokens of row b of (logp - old_logp)`` (clamped to +-20; 0 for a row without any), so
    ``exp`` of it is the sequence-level ratio ``s_b``.  Written as ``logp - sg(logp) + sg(mean)``, the gradient of
    ``exp`` of it at token t is ``s_b * grad logp_t``: summed over a sequence with one advantage that is exactly the
    gradient of ``s_b`` itself (times the token count), and with per-token advantages each token keeps its own
    (GSPO-token).
    """
    m = mask.bool()
    old_logp = old_logp.detach()
    diff = torch.where(m, logp.detach() - old_logp, torch.zeros_like(old_logp))
    per_seq = diff.sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
    per_seq = per_seq.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return logp - logp.detach() + per_seq


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    agg_mode: AggMode,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss: ``0.5 * max((V - R)**2, (V_clip - R)**2)``, ``V_clip = clamp(V, V_old - clip, V_old + clip)``.

    ``values`` (with grad), ``old_values``, ``returns``, ``mask`` [B, T] -> ``(loss, metrics)``.  Taking the larger
    error means a value that moved more than ``clip`` from ``old_values`` in a direction that lowers the error gets no
    further gradient, like the policy ratio clip.  The 0.5 makes the gradient of a token ``V - R``.  Then `aggregate`.
    Metrics: ``value_clip_frac`` (tokens where the clip binds: ``V`` is outside the range and the clipped error is
    the larger one, so the token gets no gradient), ``value_mse`` (unclipped).  ``V_clip`` is a clamp of ``V``
    itself, not ``V_old + clamp(V - V_old)``: inside the range it is then exactly ``V``, whereas the round trip
    through the difference can be off by an ulp and make the clipped error "larger" where the clip does not bind.
    """
    old_values = old_values.detach()
    returns = returns.detach()
    v_clipped = torch.clamp(values, old_values - clip, old_values + clip)
    err = (values - returns) ** 2
    err_clipped = (v_clipped - returns) ** 2
    loss = aggregate(
        0.5 * torch.maximum(err, err_clipped), mask, agg_mode, global_tokens, global_seqs, norm_length
    )
    metrics = {
        "value_clip_frac": masked_mean((err_clipped.detach() > err.detach()).float(), mask),
        "value_mse": masked_mean(err.detach(), mask),
    }
    return loss, metrics


def entropy_bonus(
    entropy_tok: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg_mode: AggMode,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Loss term ``-coef * aggregate(entropy)``: adding it to the loss rewards higher entropy.

    ``entropy_tok``, ``mask`` [B, T] -> ``(loss, {"entropy": masked token-mean, detached})``.
    """
    loss = -coef * aggregate(entropy_tok, mask, agg_mode, global_tokens, global_seqs, norm_length)
    return loss, {"entropy": masked_mean(entropy_tok.detach(), mask)}


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: KLKind,
    agg_mode: AggMode,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL-to-reference loss term ``coef * aggregate(kl_estimate(logp, ref_logp, kind))``.

    ``logp`` (with grad), ``ref_logp``, ``mask`` [B, T] -> ``(loss, {"kl_ref": masked token-mean, detached})``.
    """
    kl_tok = kl_estimate(logp, ref_logp.detach(), kind)
    return kl_penalty(kl_tok, mask, coef, agg_mode, Normalisers(global_tokens, global_seqs, norm_length))


def kl_penalty(
    kl_tok: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg_mode: AggMode,
    norms: Normalisers = Normalisers(),
) -> tuple[torch.Tensor, Metrics]:
    """``coef * aggregate(kl_tok)`` for a per-token KL already computed (with grad), e.g. over the reference's top
    tokens (``trainer.logprobs.topk_kl``).  [B, T], [B, T] -> ``(loss, {"kl_ref": masked token-mean})``."""
    loss = coef * aggregate(kl_tok, mask, agg_mode, norms.tokens, norms.seqs, norms.length)
    return loss, {"kl_ref": masked_mean(kl_tok.detach(), mask)}


# ------------------------------------------------------------------------------------------------ KL coefficient


@dataclass
class KLController:
    """The coefficient of the KL to the reference: fixed, or the adaptive proportional controller.

    With ``target`` None the coefficient stays ``value``.  With a target KL, after each step
    ``value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon`` (Ziegler et al. 2019): the coefficient
    grows while the measured KL is above the target and shrinks while it is below, by at most 20% per ``horizon``
    samples, so it follows the KL the run drifts to rather than jumping with each step's noise.  A multiplier must
    stay positive: keep ``horizon`` above the samples of one step.  ``state_dict`` / ``load_state_dict`` carry the
    current value through checkpoints (JSON-able floats).
    """

    value: float
    target: float | None = None
    horizon: float = 10000.0

    def update(self, kl: float, n_samples: int) -> None:
        """Adapt to the step's measured KL; a non-finite KL (a skipped or broken step) leaves the value alone."""
        if self.target is None or not math.isfinite(kl):
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
