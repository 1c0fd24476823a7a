"""The LM head with its backward done in its forward, for a loss that is a sum of per-token terms.

The chunked head of ``trainer/logprobs.py`` keeps each chunk's [n, H] input and recomputes the chunk's logits in
backward: a third matrix product over the vocabulary beside the forward's one and the backward's two.  When the loss
is a sum of per-token terms, each a function of that token's logprob and entropy alone (PPO's token-level clip, the
entropy bonus, the k1/k2/k3 KL estimates, any ``loss_agg``: their normalisers are constants of the step), the loss's
gradient with respect to a chunk's logprobs and entropies is known as soon as the chunk's logits are.  The head then
takes the gradient with respect to the logits right there, turns it into the gradients of its input and of its
weight, and drops the logits; backward only scales what forward stored by the loss's incoming gradient.

At most one chunk's [n, V] fp32 logits are alive, as in the chunked head.  What lives from forward to backward is the
gradient of the head's input [N, H] (where the chunked head keeps the input itself) and of its weight [V, H].

``trainer/step.py`` decides when the loss qualifies (``trainer.fused_head``); GSPO's sequence ratio, an importance
weight of the current policy over a whole sequence, a KL over the reference's top tokens and sequence-parallel shards
couple tokens or rows, and keep the chunked head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# (logprobs [N], entropies [N]) of every scored row, in the head's row order -> the scalar loss
RowsLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class HeadLoss:
    """What a forward pass with grad needs to run the fused head, and what it gives back.

    ``fn(logp, entropy)`` is the loss, from [B, T] tensors in the caller's layout, and must be a sum of per-token
    terms (see the module's docstring).  ``layout`` maps the head's output layout to the caller's (a packed row back
    to its padded batch); ``batch_logprobs`` sets it.  The pass sets ``carrier``: a zero scalar whose gradient is the
    loss's, to be added to the loss computed without grad from the returned logprobs; None when the pass did not fuse
    (nothing scored), and the logprobs then carry their gradient as usual.

    A plain class, not a dataclass, for the reason ``TopK`` gives: the pass writes into this very object.
    """

    __slots__ = ("carrier", "compiled", "fn", "layout")

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], compiled: bool = False):
        self.fn = fn
        self.compiled = compiled  # the per-chunk softmax work as compiled kernels (``trainer.compile_head``)
        self.layout: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.carrier: torch.Tensor | None = None


def fused_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk: int,
    rows_loss: RowsLoss,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden`` [N, H] (the states that score ``targets`` [N]) -> (logp [N], entropy [N], carrier []), fp32.

    ``logp`` and ``entropy`` are detached values; the gradient of ``rows_loss(logp, entropy)`` with respect to
    ``hidden``, ``weight`` and ``bias`` flows through ``carrier`` (value 0) instead.  Entropies are zeros without
    ``with_entropy``.  ``compiled``: each chunk's softmax, entropy and logits' gradient run as compiled kernels
    that read the logits in their own dtype (``_Scores.compiled``) instead of eager fp32 passes over them.
    """
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _HeadGrad.apply(
        hidden, weight, bias, targets, temperature, with_entropy, chunk, rows_loss, compiled
    )
    return out


class _HeadGrad(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk: int,
        rows_loss: RowsLoss,
        compiled: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        scores = _Scores(n, hidden.device, temperature, with_entropy, rows_loss)
        chunk_grad = scores.compiled if compiled else scores.eager
        dh = torch.zeros_like(hidden) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros_like(bias) if need_b and bias is not None else None
        for s in range(0, n, chunk):
            rows = slice(s, min(s + chunk, n))
            h = hidden[rows]
            logits = F.linear(h, weight, bias)
            t = targets[rows].unsqueeze(-1)
            d = chunk_grad(logits, t, rows)
            del logits
            if dh is not None:
                dh[rows] = (d @ weight).to(dh.dtype)
            if dw is not None:
                dw.addmm_(d.t(), h.to(dw.dtype))
            if db is not None:
                db.add_(d.sum(0).to(db.dtype))
        ctx.save_for_backward(dh, dw, db)
        ctx.mark_non_differentiable(scores.logp, scores.ent)
        return scores.logp, scores.ent, torch.zeros((), dtype=torch.float32, device=hidden.device)

    @staticmethod
    def backward(ctx: Any, _g_lp: torch.Tensor, _g_ent: torch.Tensor, g: torch.Tensor) -> tuple[Any, ...]:
        # ``g`` is the loss's scale (1, or the world size under FSDP's averaging): the stored gradients are the loss's
        return (
            *(None if t is None else t * g.to(t.dtype) for t in ctx.saved_tensors),
            None,
            None,
            None,
            None,
            None,
            None,
        )


class _Scores:
    """The head's logprobs and entropies [N] fp32, filled chunk by chunk, and the two ways to fill a chunk and take
    the loss's gradient with respect to its logits (in the logits' dtype: as autograd casts the gradient of
    ``.float()``, the products after it run in the weight's dtype, like forward's)."""

    def __init__(
        self, n: int, device: torch.device, temperature: float, with_entropy: bool, rows_loss: RowsLoss
    ) -> None:
        self.logp = torch.zeros(n, dtype=torch.float32, device=device)
        self.ent = torch.zeros_like(self.logp)
        self.temperature, self.with_entropy, self.rows_loss = temperature, with_entropy, rows_loss

    def eager(self, logits: torch.Tensor, t: torch.Tensor, rows: slice) -> torch.Tensor:
        """In eager PyTorch: two [n, V] fp32 tensors at a time, each pass over them a kernel of its own."""
        temperature = self.temperature
        logsm = logits.float()
        if temperature != 1.0:
            logsm.div_(temperature)
        logsm.sub_(torch.logsumexp(logsm, dim=-1, keepdim=True))  # log-softmax, in place
        self.logp[rows] = logsm.gather(-1, t).squeeze(-1)
        p = logsm.exp()
        if self.with_entropy:
            self.ent[rows] = -(p * logsm).sum(-1)
        g_lp, g_ent = _token_grads(self.rows_loss, self.logp, self.ent, rows)
        d = _logit_grad(logsm, p, t, g_lp, g_ent if self.with_entropy else None, self.ent[rows])
        del logsm, p  # written over by now
        if temperature != 1.0:
            d.div_(temperature)
        return d.to(logits.dtype)

    def compiled(self, logits: torch.Tensor, t: torch.Tensor, rows: slice) -> torch.Tensor:
        """``eager`` as two compiled kernels around the loss's per-token gradients: one reduction over the logits
        (log-sum-exp and entropy), then one element-wise pass that writes the logits' gradient.  They read the
        [n, V] logits in their own dtype and write only the gradient: the compiler fuses the fp32 work into them,
        where ``eager`` runs about a dozen kernels over [n, V] fp32 tensors."""
        stats, grad = _kernels()
        lse, h = stats(logits, self.temperature, self.with_entropy)
        self.logp[rows] = logits.gather(-1, t).squeeze(-1).float() / self.temperature - lse
        self.ent[rows] = h
        g_lp, g_ent = _token_grads(self.rows_loss, self.logp, self.ent, rows)
        return grad(logits, t, lse, h, g_lp, g_ent, self.temperature, self.with_entropy)


def _chunk_stats(
    logits: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, entropy) [n] fp32 of each row of ``logits / temperature``; entropies 0 without entropy."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    if not with_entropy:
        return lse, torch.zeros_like(lse)
    logsm = z - lse.unsqueeze(-1)
    return lse, -(logsm.exp() * logsm).sum(-1)


def _chunk_grad(
    logits: torch.Tensor,
    t: torch.Tensor,
    lse: torch.Tensor,
    h: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> torch.Tensor:
    """d loss / d logits, in the logits' dtype: ``_logit_grad``'s formula as one element-wise expression, the
    target's one-hot included (so it is added in fp32, before the cast, as the eager chunk adds it)."""
    logsm = logits.float() / temperature - lse.unsqueeze(-1)
    p = logsm.exp()
    gl = g_lp.unsqueeze(-1)
    d = -p * gl
    if with_entropy:
        d = d - g_ent.unsqueeze(-1) * p * (logsm + h.unsqueeze(-1))
    onehot = torch.arange(logits.shape[-1], device=logits.device) == t
    d = torch.where(onehot, d + gl, d)
    return (d / temperature).to(logits.dtype)


_KERNELS: tuple[Any, Any] | None = None


def _kernels() -> tuple[Any, Any]:
    """The two chunk functions compiled once per process.  Dynamic in the chunk's rows, so a micro-batch's last,
    shorter chunk reuses the kernels of the full ones."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = (
            torch.compile(_chunk_stats, dynamic=True),
            torch.compile(_chunk_grad, dynamic=True),
        )
    return _KERNELS


def _token_grads(
    rows_loss: RowsLoss, logp: torch.Tensor, ent: torch.Tensor, rows: slice
) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss / d logp and d loss / d entropy at ``rows``.  The rows after them hold zeros so far: a loss of
    per-token terms gives these rows the same gradient whatever the others hold."""
    lp, en = logp[rows].detach().requires_grad_(), ent[rows].detach().requires_grad_()
    with torch.enable_grad():
        loss = rows_loss(
            torch.cat([logp[: rows.start], lp, logp[rows.stop :]]),
            torch.cat([ent[: rows.start], en, ent[rows.stop :]]),
        )
        g_lp, g_ent = torch.autograd.grad(loss, (lp, en), allow_unused=True)
    return (
        torch.zeros_like(lp) if g_lp is None else g_lp.detach(),
        torch.zeros_like(en) if g_ent is None else g_ent.detach(),
    )


def _logit_grad(
    logsm: torch.Tensor,
    p: torch.Tensor,
    targets: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    ent: torch.Tensor,
) -> torch.Tensor:
    """d loss / d logits [n, V] from the log-softmax and softmax [n, V] of the logits and the loss's gradients with
    respect to each row's logprob of its target [n, 1] and its entropy [n].  Both [n, V] inputs are consumed (written
    over), so that a chunk holds two such tensors at a time.

    d logp_y / d z = onehot(y) - p;  d H / d z = -p * (log p + H)."""
    if g_ent is None:
        d = p.mul_(-g_lp.unsqueeze(-1))
    else:
        d = logsm.add_(ent.unsqueeze(-1)).mul_(p).mul_(-g_ent.unsqueeze(-1))
        d.sub_(p.mul_(g_lp.unsqueeze(-1)))
    return d.scatter_add_(-1, targets, g_lp.unsqueeze(-1))
