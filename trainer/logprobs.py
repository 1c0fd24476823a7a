"""Chunked token logprobs and entropies: the ``Actor`` wrapper and the functions over collated micro-batches.

The root is a thin wrapper (``Actor``) whose ``forward`` runs the HF model *and* the head, so FSDP's forward/backward
hooks surround both: the LM head is applied chunk by chunk over the tokens inside that forward and never
materialises a [tokens x vocab] fp32 tensor.  Parameter names below the wrapper stay the HF names (``Actor.lm`` is
the HF model); ``trainer/publish.py`` writes them without the wrapper prefixes.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer import sequence_parallel as seqpar
from trainer.attention import PackedRow, pack, packed_row, packing_kwargs, unpack, use_packed_attention
from trainer.fused_head import HeadLoss, fused_head
from trainer.phases import phase
from trainer.sharding import reshard


class TopK:
    """The reference's ``k`` most likely next tokens at each scored position, for the KL over them (``topk_kl``).

    A reference pass given an empty ``TopK`` fills ``index`` / ``logp`` [N, k] and ``rest`` [N] (the log of the
    probability outside those k tokens), one row per scored token in the order the head scores them (row-major over
    the wanted tokens, the order of ``input_ids[want]``); an actor pass over the same batch given the filled one
    writes ``kl`` [B, T], its KL to the reference at every scored token, with grad (0 elsewhere).

    A plain class, not a dataclass: FSDP rebuilds the dataclasses among a forward's inputs (to cast their tensors),
    and the pass must write into this very object.
    """

    __slots__ = ("index", "k", "kl", "logp", "rest")

    def __init__(
        self,
        k: int,
        index: torch.Tensor | None = None,
        logp: torch.Tensor | None = None,
        rest: torch.Tensor | None = None,
    ):
        self.k, self.index, self.logp, self.rest = k, index, logp, rest
        self.kl: torch.Tensor | None = None


def topk_kl(
    logp_all: torch.Tensor, index: torch.Tensor, ref_logp: torch.Tensor, ref_rest: torch.Tensor
) -> torch.Tensor:
    """KL(pi || ref) over the reference's top-k tokens plus one bin for the rest of the vocabulary.

    ``logp_all`` [n, V] the policy's log-softmax, ``index`` / ``ref_logp`` [n, k] the reference's top tokens and
    their logprobs, ``ref_rest`` [n] the log of its mass outside them -> [n].  Merging tokens into one bin can only
    lower a KL, so this is at most the exact KL over the vocabulary, and equal to it when the two distributions agree
    on how the rest's mass is spread.  Unlike an estimate from the sampled token alone, it sees a probability move
    between tokens that are never sampled: a margin of the reference's choice eroding while that choice still holds
    almost all the mass.
    """
    lp = logp_all.gather(1, index)
    rest = _rest(logp_all, index)
    inside = (lp.exp() * (lp - ref_logp)).sum(1)
    outside = torch.where(torch.isfinite(rest), rest.exp() * (rest - ref_rest), torch.zeros_like(rest))
    return inside + outside


def _rest(logp_all: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log of the probability outside ``index`` [n, k], per row of ``logp_all`` [n, V]: a logsumexp over the rest,
    exact where 1 - sum(top) would cancel."""
    return torch.logsumexp(logp_all.scatter(1, index, float("-inf")), dim=1)


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """[n, H] hidden states -> [n, V] fp32 logits at ``temperature``."""
    logits = F.linear(hidden, weight, bias).float()
    return logits / temperature if temperature != 1.0 else logits


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[n, H] hidden states -> (logprob of ``targets`` [n], entropy [n], KL to ``ref`` [n] or None without one), all
    fp32; logits live only in here.  ``ref``: the reference's (index, logp, rest) rows of these positions (see
    ``TopK``)."""
    logits = _logits(hidden, weight, bias, temperature)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    kl = None if ref is None else topk_kl(logits - lse.unsqueeze(-1), *ref)
    if not with_entropy:
        return logp, torch.zeros_like(logp), kl
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy, kl


@torch.no_grad()
def _top_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, H] hidden states -> the ``k`` most likely tokens [n, k], their logprobs [n, k] and the log of the mass
    outside them [n], at ``temperature``."""
    logp_all = torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)
    top = logp_all.topk(min(k, logp_all.shape[-1] - 1), dim=-1)  # one token at least in the rest's bin
    return top.indices, top.values, _rest(logp_all, top.indices)


def head_logprobs_and_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    input_ids: torch.Tensor,
    want: torch.Tensor,
    *,
    chunk: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
    topk: TopK | None = None,
    loss: HeadLoss | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the LM head chunk by chunk to the positions that predict the tokens marked in ``want``.

    ``hidden`` [B, T, H] final hidden states, ``input_ids`` and ``want`` [B, T] -> (logp, entropy) [B, T] fp32,
    zero where ``want`` is false or t = 0.  With grad, each chunk runs under ``torch.utils.checkpoint``: only its
    [n, H] input is kept and its logits are recomputed in backward, so at most one chunk of logits is alive.
    ``topk``: an empty one is filled with this model's top tokens (the reference's pass); a filled one gets the
    KL to them in ``topk.kl`` (the actor's pass), see ``TopK``.  ``loss``: with grad, the head computes its
    gradient in forward from the loss (``trainer/fused_head.py``) and returns detached values; not with ``topk``.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    want = want.bool().clone()
    want[:, 0] = False  # nothing predicts the first token
    src = torch.zeros_like(want)
    src[:, :-1] = want[:, 1:]  # token t is predicted from the hidden state at t - 1
    h = hidden[src]  # [N, H], row-major order, which matches input_ids[want]
    targets = input_ids[want]
    weight = cast(torch.Tensor, head.weight)
    bias = cast("torch.Tensor | None", getattr(head, "bias", None))
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if topk is not None and topk.index is None:
        _fill_top(topk, h, weight, bias, temperature, chunk)
        topk = None
    elif topk is not None and topk.index is not None and topk.index.shape[0] != h.shape[0]:
        raise ValueError(
            f"the reference's top tokens cover {topk.index.shape[0]} positions, this pass scores {h.shape[0]}: "
            "they must come from the same batch"
        )
    zeros = torch.zeros(want.shape, dtype=torch.float32, device=hidden.device)
    if loss is not None and grad and h.shape[0] > 0:
        if topk is not None:
            raise ValueError("the fused head takes no KL over the reference's top tokens")
        return _fused(h, weight, bias, targets, want, zeros, temperature, with_entropy, chunk, loss)
    logps, ents, kls = [], [], []
    for s in range(0, h.shape[0], chunk):
        ref = None if topk is None else _rows(topk, s, s + chunk)
        args = (h[s : s + chunk], weight, bias, targets[s : s + chunk], temperature, with_entropy, ref)
        lp, en, kl = checkpoint(_head_chunk, *args, use_reentrant=False) if grad else _head_chunk(*args)
        logps.append(lp)
        ents.append(en)
        if kl is not None:
            kls.append(kl)
    if topk is not None:
        topk.kl = zeros.masked_scatter(want, torch.cat(kls)) if kls else zeros.clone()
    if not logps:
        if grad:
            # Nothing wanted: an empty micro-batch that keeps this rank in step with the others.  Its backward must
            # still reach every parameter the others' does (the head too), or FSDP's gradient reduction differs.
            anchor = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0.0)
            zeros = zeros + 0.0 * anchor.float()
        return zeros, zeros.clone()
    return zeros.masked_scatter(want, torch.cat(logps)), zeros.masked_scatter(want, torch.cat(ents))


def _fused(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    want: torch.Tensor,
    zeros: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk: int,
    loss: HeadLoss,
) -> tuple[torch.Tensor, torch.Tensor]:
    def rows_loss(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        return loss.fn(
            loss.layout(zeros.masked_scatter(want, logp)), loss.layout(zeros.masked_scatter(want, ent))
        )

    logp, ent, loss.carrier = fused_head(
        h, weight, bias, targets, temperature, with_entropy, chunk, rows_loss, loss.compiled
    )
    return zeros.masked_scatter(want, logp), zeros.masked_scatter(want, ent)


def _fill_top(
    topk: TopK,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    chunk: int,
) -> None:
    # An empty pass still gets tensors of the right shapes: one chunk of no rows.
    starts = range(0, h.shape[0], chunk) or range(1)
    parts = [_top_chunk(h[s : s + chunk], weight, bias, temperature, topk.k) for s in starts]
    topk.index, topk.logp, topk.rest = (torch.cat(column) for column in zip(*parts, strict=True))


def _rows(topk: TopK, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    assert topk.index is not None and topk.logp is not None and topk.rest is not None
    return topk.index[lo:hi], topk.logp[lo:hi], topk.rest[lo:hi]


def _lm_logprobs_and_entropy(
    lm: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    response_mask: torch.Tensor | None,
    chunk: int,
    temperature: float,
    with_entropy: bool,
    packed: PackedRow | None = None,
    topk: TopK | None = None,
    loss: HeadLoss | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    with phase("decoder"):
        out = lm.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **packing_kwargs(lm.config, position_ids, packed),
        )
    if response_mask is not None:
        want = response_mask
    elif attention_mask is not None:
        want = attention_mask
    else:
        want = torch.ones_like(input_ids, dtype=torch.bool)
    if position_ids is not None:
        # Nothing predicts the first token of a sequence; in a packed row the state before it is another sequence's.
        want = want.bool() & (position_ids != 0)
    with phase("head"):
        return head_logprobs_and_entropy(
            out.last_hidden_state,
            lm.get_output_embeddings(),
            input_ids,
            want,
            chunk=chunk,
            temperature=temperature,
            with_entropy=with_entropy,
            topk=topk,
            loss=loss,
        )


def _lm_shard_logprobs_and_entropy(
    lm: Any, shard: seqpar.Shard, chunk: int, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) [1, N] of a whole packed row from this rank's chunk of it (``trainer/sequence_parallel.py``):
    the chunk's hidden states score the tokens after them, and the group gathers the scores."""
    out = lm.base_model(
        input_ids=shard.ids,
        position_ids=shard.positions,
        use_cache=False,
        **packing_kwargs(lm.config, shard.positions, shard.row),
    )
    # one more state after the chunk, so that the targets [1, C+1] line up; the last target is never wanted
    hidden = F.pad(out.last_hidden_state, (0, 0, 0, 1))
    logp, ent = head_logprobs_and_entropy(
        hidden,
        lm.get_output_embeddings(),
        shard.target_ids,
        shard.target_want,
        chunk=chunk,
        temperature=temperature,
        with_entropy=with_entropy,
    )
    logp = seqpar.gather_scores(logp, shard)
    # zeros without entropy: the same on every rank, no exchange needed
    return logp, seqpar.gather_scores(ent, shard) if with_entropy else torch.zeros_like(logp)


class Actor(nn.Module):
    """An HF causal LM (``self.lm``) whose forward returns (token logprobs, entropies); the root FSDP unit.

    Wrapping switches an SDPA model to ``PACKED_ATTENTION`` (the same attention for padded batches).
    """

    def __init__(self, lm: Any):
        super().__init__()
        self.lm: Any = lm
        use_packed_attention(lm)

    @property
    def config(self) -> Any:
        return self.lm.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        *,
        chunk: int = 1024,
        temperature: float = 1.0,
        with_entropy: bool = True,
        packed: PackedRow | None = None,
        shard: seqpar.Shard | None = None,
        topk: TopK | None = None,
        loss: HeadLoss | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """(logp, entropy), and when ``loss`` got a ``carrier``, that third: an output of the root's forward, so
        that FSDP hooks its backward like the others'."""
        if (
            shard is not None
        ):  # the inputs are the shard's, the others unread (batch_logprobs refuses a topk here)
            return _lm_shard_logprobs_and_entropy(self.lm, shard, chunk, temperature, with_entropy)
        out = _lm_logprobs_and_entropy(
            self.lm,
            input_ids,
            attention_mask,
            position_ids,
            response_mask,
            chunk,
            temperature,
            with_entropy,
            packed,
            topk,
            loss,
        )
        return out if loss is None or loss.carrier is None else (*out, loss.carrier)


def token_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = True,
    packed: PackedRow | None = None,
    topk: TopK | None = None,
    loss: HeadLoss | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs and entropies of ``input_ids`` under ``model`` (an ``Actor`` or a plain HF causal LM).

    ``input_ids`` [B, T]; ``attention_mask`` [B, T] (1 = real token) and/or ``position_ids`` [B, T] as the HF model
    takes them; ``response_mask`` [B, T] marks the tokens whose logprob is wanted (default: every attended token).
    Returns ``(logp, entropy)``, both [B, T] fp32: ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` at
    ``temperature``, ``entropy[b, t]`` the entropy of that next-token distribution; 0 at t = 0, where a position id
    is 0, and wherever the token is not wanted.  The LM head runs over ``chunk`` tokens at a time (see
    ``head_logprobs_and_entropy``).  A packed row is [1, N] with ``position_ids`` restarting per sequence and
    ``packed`` its sequence boundaries (see ``batch_logprobs``).  ``topk``: see ``TopK`` (its ``kl`` comes back in
    this call's layout).  ``loss``: see ``HeadLoss``.
    """
    if isinstance(model, Actor):
        out = model(
            input_ids,
            attention_mask,
            position_ids,
            response_mask,
            chunk=chunk,
            temperature=temperature,
            with_entropy=with_entropy,
            packed=packed,
            topk=topk,
            loss=loss,
        )
        if not torch.is_grad_enabled():
            reshard(model)  # no backward will free the root's gathered weights
        if loss is not None and len(out) > 2:
            loss.carrier = out[2]  # the tensor FSDP hooked, should it differ from the one the head set
        return out[0], out[1]
    return _lm_logprobs_and_entropy(
        model,
        input_ids,
        attention_mask,
        position_ids,
        response_mask,
        chunk,
        temperature,
        with_entropy,
        packed,
        topk,
        loss,
    )


def batch_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = True,
    sp: seqpar.SPGroup | None = None,
    topk: TopK | None = None,
    loss: HeadLoss | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs_and_entropy`` of a collated micro-batch (``trainer.batching.collate``), packed or padded.

    Returns ``(logp, entropy)`` [B, T] in the padded layout either way, 0 on padding and unwanted tokens.  ``sp``:
    the sequence-parallel group of a packed micro-batch, whose ranks each run a chunk of the row and all return the
    whole row's outputs.  ``topk``: see ``TopK``; its ``kl`` comes back [B, T] in the padded layout too.
    ``loss``: see ``HeadLoss``; its ``fn`` takes the padded layout.
    """
    opts: dict[str, Any] = {"chunk": chunk, "temperature": temperature, "with_entropy": with_entropy}
    if sp is not None and "packed_ids" in batch:
        if topk is not None or loss is not None:
            raise ValueError(
                "neither a KL over the reference's top tokens nor the fused head runs on sequence-parallel shards"
            )
        return _sharded_batch_logprobs(model, batch, sp, opts)
    if "packed_ids" not in batch:
        return token_logprobs_and_entropy(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            None,
            batch["response_mask"],
            topk=topk,
            loss=loss,
            **opts,
        )
    if loss is not None:
        loss.layout = lambda t: unpack(t, batch)
    logp, ent = token_logprobs_and_entropy(
        model,
        batch["packed_ids"],
        None,
        batch["packed_positions"],
        pack(batch["response_mask"], batch),
        packed=packed_row(batch),
        topk=topk,
        loss=loss,
        **opts,
    )
    if topk is not None and topk.kl is not None:
        topk.kl = unpack(topk.kl, batch)
    return unpack(logp, batch), unpack(ent, batch)


def _sharded_batch_logprobs(
    model: nn.Module, batch: dict[str, torch.Tensor], sp: seqpar.SPGroup, opts: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    shard = seqpar.split(
        batch["packed_ids"],
        batch["packed_positions"],
        pack(batch["response_mask"], batch),
        packed_row(batch),
        sp,
    )
    if isinstance(model, Actor):
        logp, ent = model(shard.ids, shard=shard, **opts)
        if not torch.is_grad_enabled():
            reshard(model)  # no backward will free the root's gathered weights
    else:
        logp, ent = _lm_shard_logprobs_and_entropy(model, shard, **opts)
    return unpack(logp, batch), unpack(ent, batch)
