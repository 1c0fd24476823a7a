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
from trainer.sharding import reshard


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] hidden states -> (logprob of ``targets`` [n], entropy [n]), both fp32; logits live only in here."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def head_logprobs_and_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    input_ids: torch.Tensor,
    want: torch.Tensor,
    *,
    chunk: int,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the LM head chunk by chunk to the positions that predict the tokens marked in ``want``.

    ``hidden`` [B, T, H] final hidden states, ``input_ids`` and ``want`` [B, T] -> (logp, entropy) [B, T] fp32,
    zero where ``want`` is false or t = 0.  With grad, each chunk runs under ``torch.utils.checkpoint``: only its
    [n, H] input is kept and its logits are recomputed in backward, so at most one chunk of logits is alive.
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
    logps, ents = [], []
    for s in range(0, h.shape[0], chunk):
        args = (h[s : s + chunk], weight, bias, targets[s : s + chunk], temperature, with_entropy)
        lp, en = checkpoint(_head_chunk, *args, use_reentrant=False) if grad else _head_chunk(*args)
        logps.append(lp)
        ents.append(en)
    zeros = torch.zeros(want.shape, dtype=torch.float32, device=hidden.device)
    if not logps:
        if grad:
            # Nothing wanted: an empty micro-batch that keeps this rank in step with the others.  Its backward must
            # still reach every parameter the others' does (the head too), or FSDP's gradient reduction differs.
            anchor = hidden.sum() + weight.sum() + (bias.sum() if bias is not None else 0.0)
            zeros = zeros + 0.0 * anchor.float()
        return zeros, zeros.clone()
    return zeros.masked_scatter(want, torch.cat(logps)), zeros.masked_scatter(want, torch.cat(ents))


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
) -> tuple[torch.Tensor, torch.Tensor]:
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
    return head_logprobs_and_entropy(
        out.last_hidden_state,
        lm.get_output_embeddings(),
        input_ids,
        want,
        chunk=chunk,
        temperature=temperature,
        with_entropy=with_entropy,
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if shard is not None:  # the inputs are the shard's; the others are not read
            return _lm_shard_logprobs_and_entropy(self.lm, shard, chunk, temperature, with_entropy)
        return _lm_logprobs_and_entropy(
            self.lm,
            input_ids,
            attention_mask,
            position_ids,
            response_mask,
            chunk,
            temperature,
            with_entropy,
            packed,
        )


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs and entropies of ``input_ids`` under ``model`` (an ``Actor`` or a plain HF causal LM).

    ``input_ids`` [B, T]; ``attention_mask`` [B, T] (1 = real token) and/or ``position_ids`` [B, T] as the HF model
    takes them; ``response_mask`` [B, T] marks the tokens whose logprob is wanted (default: every attended token).
    Returns ``(logp, entropy)``, both [B, T] fp32: ``logp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` at
    ``temperature``, ``entropy[b, t]`` the entropy of that next-token distribution; 0 at t = 0, where a position id
    is 0, and wherever the token is not wanted.  The LM head runs over ``chunk`` tokens at a time (see
    ``head_logprobs_and_entropy``).  A packed row is [1, N] with ``position_ids`` restarting per sequence and
    ``packed`` its sequence boundaries (see ``batch_logprobs``).
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
        )
        if not torch.is_grad_enabled():
            reshard(model)  # no backward will free the root's gathered weights
        return out
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
    )


def batch_logprobs(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = True,
    sp: seqpar.SPGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs_and_entropy`` of a collated micro-batch (``trainer.batching.collate``), packed or padded.

    Returns ``(logp, entropy)`` [B, T] in the padded layout either way, 0 on padding and unwanted tokens.  ``sp``:
    the sequence-parallel group of a packed micro-batch, whose ranks each run a chunk of the row and all return the
    whole row's outputs.
    """
    opts: dict[str, Any] = {"chunk": chunk, "temperature": temperature, "with_entropy": with_entropy}
    if sp is not None and "packed_ids" in batch:
        return _sharded_batch_logprobs(model, batch, sp, opts)
    if "packed_ids" not in batch:
        return token_logprobs_and_entropy(
            model, batch["input_ids"], batch["attention_mask"], None, batch["response_mask"], **opts
        )
    logp, ent = token_logprobs_and_entropy(
        model,
        batch["packed_ids"],
        None,
        batch["packed_positions"],
        pack(batch["response_mask"], batch),
        packed=packed_row(batch),
        **opts,
    )
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
