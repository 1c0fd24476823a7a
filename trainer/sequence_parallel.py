"""Ulysses sequence parallelism on packed rows (``trainer.sequence_parallel = K``).

The K consecutive ranks of a sequence-parallel group take the same samples (``data_parallel`` is the rank and world
that ``trainer/batching.py`` ``assign_to_ranks`` sees) and split each packed micro-batch's row into K contiguous chunks,
padded to a multiple of K with a padding sequence of its own (so no real sequence attends to it).  Each rank runs
embeddings, norms, MLPs and the LM or value head on its chunk only; attention exchanges (``all_to_all_single``) its
chunk of every head for every rank's chunk of a K-th of the heads, so that it sees the whole row and the row's
``cu_seqlens`` keep it exact, then exchanges back.  Positions are the packed row's own (per-sequence, global), so
rotary embeddings are the same as at K = 1.

Per-token outputs cross chunk boundaries in one place only: the logprob of token t comes from the hidden state at
t - 1, which can be the previous rank's.  Each rank therefore scores the tokens *after* its chunk's positions (the
target ids are on every rank) and the group gathers the scores; values are gathered before their shift.  The gather
is the identity on every rank's copy and its backward keeps the local slice only: every rank of a group computes
the same loss from the same gathered tensors, so the sum of the group's gradients (FSDP's reduction over all ranks,
see ``trainer/step.py``) is that loss's gradient once.

FSDP2 still shards over every rank: the group's ranks hold partial gradients of one loss that must be summed
anyway, and sharding over all ranks keeps parameter, gradient and optimizer memory at 1/world, checkpoints
independent of K (a run resumes at another K), and ``trainer/sharding.py`` unchanged.

Query heads must divide by K.  Grouped-query KV heads that do not are repeated (each KV head r times, r the
smallest factor making them a multiple of K) before the exchange: every rank then holds whole groups of queries
with their own KV head, at the cost of r times the KV traffic.

Built once per K by ``group`` (a collective: every rank calls it); K = 1 is ``None`` and no code path changes.
``trainer/attention.py`` reaches the exchange through the ``PackedRow`` that carries the group (``PackedRow.sp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer import dist as tdist
from trainer.attention import PackedRow

FIELD = "trainer.sequence_parallel"


@dataclass(frozen=True)
class SPGroup:
    """The sequence-parallel group this rank belongs to: ``size`` ranks, this one ``rank`` among them."""

    size: int
    rank: int
    group: Any  # a ProcessGroup of the ``size`` consecutive ranks

    def data_parallel(self) -> tuple[int, int]:
        """(world, rank) of the data-parallel split: one data-parallel rank per group."""
        return tdist.world() // self.size, tdist.rank() // self.size

    def attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``attention`` below, reached through the row (``trainer/attention.py`` imports nothing from here)."""
        return attention(*args, **kwargs)


_GROUPS: dict[int, SPGroup] = {}


def check_world(size: int, world: int) -> None:
    if size < 1 or world % size:
        raise ValueError(
            f"{FIELD} = {size} must divide the trainer's world size ({world} ranks): one of "
            f"{[k for k in range(1, world + 1) if world % k == 0]}"
        )


def check_heads(size: int, model_config: Any) -> None:
    """One line naming the field when a model's attention cannot split over ``size`` ranks."""
    heads = int(model_config.num_attention_heads)
    if heads % size:
        raise ValueError(
            f"{FIELD} = {size} must divide the model's {heads} attention heads: one of "
            f"{[k for k in range(1, heads + 1) if heads % k == 0]} (KV heads are repeated as needed)"
        )


def group(size: int) -> SPGroup | None:
    """This rank's group of ``size`` consecutive ranks (created on first use; a collective), None for size 1."""
    if size == 1:
        return None
    if size in _GROUPS:
        return _GROUPS[size]
    world, rank = tdist.world(), tdist.rank()
    check_world(size, world)
    mine = None
    for first in range(0, world, size):  # every rank creates every group, as new_group requires
        g = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = g
    _GROUPS[size] = SPGroup(size, rank % size, mine)
    return _GROUPS[size]


# ------------------------------------------------------------------------------------------ exchanges (autograd)


class _AllToAll(torch.autograd.Function):
    """[K, ...] -> [K, ...]: slot j goes to rank j, slot i of the result came from rank i.  Equal splits make the
    exchange its own adjoint, so backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pg: Any) -> torch.Tensor:
        ctx.pg = pg
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=pg)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.pg)
        return out, None


class _GatherChunks(torch.autograd.Function):
    """[..., C] on each rank -> [..., K*C], the group's chunks in rank order; backward keeps this rank's slice (each
    rank's copy of the loss is the same one, see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SPGroup) -> torch.Tensor:
        ctx.rank, ctx.size = sp.rank, sp.size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x, group=sp.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        c = grad.shape[-1] // ctx.size
        return grad[..., ctx.rank * c : (ctx.rank + 1) * c].contiguous(), None


def heads_major(x: torch.Tensor, size: int) -> torch.Tensor:
    """[1, h, C, D] (this rank's chunk, all heads) -> [K, h/K, C, D]: slot j holds head group j."""
    _, h, c, d = x.shape
    return x[0].reshape(size, h // size, c, d)


def full_sequence(recv: torch.Tensor) -> torch.Tensor:
    """[K, h/K, C, D] (slot i: rank i's chunk of this rank's heads) -> [1, h/K, K*C, D]."""
    k, hk, c, d = recv.shape
    return recv.transpose(0, 1).reshape(hk, k * c, d).unsqueeze(0)


def sequence_major(out: torch.Tensor, size: int) -> torch.Tensor:
    """Attention output [1, K*C, h/K, D] -> [K, C, h/K, D]: slot j holds sequence chunk j."""
    _, n, hk, d = out.shape
    return out[0].reshape(size, n // size, hk, d)


def all_heads(recv: torch.Tensor) -> torch.Tensor:
    """[K, C, h/K, D] (slot i: head group i of this rank's chunk) -> [1, C, h, D]."""
    k, c, hk, d = recv.shape
    return recv.transpose(0, 1).reshape(c, k * hk, d).unsqueeze(0)


def kv_repeats(kv_heads: int, size: int) -> int:
    """How often each KV head is repeated so that ``size`` ranks hold whole KV heads (1 when K divides them)."""
    return size // math.gcd(kv_heads, size)


def attention(
    inner: Any,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row: PackedRow,
    **kwargs: Any,
) -> torch.Tensor:
    """``inner`` (packed attention over a whole row: ``(module, q, k, v, row, **kwargs) -> [1, N, heads, D]``) on
    this rank's chunk ``query`` [1, h, C, D], ``key``/``value`` [1, kv, C, D]; returns [1, C, h, D]."""
    sp: SPGroup = row.sp
    k = sp.size
    rep = kv_repeats(key.shape[1], k)
    if rep > 1:
        key, value = (x.repeat_interleave(rep, dim=1) for x in (key, value))
    q, kk, v = (full_sequence(_AllToAll.apply(heads_major(x, k), sp.group)) for x in (query, key, value))
    # sdpa_attention_forward repeats KV heads by the module's ratio; after the split and any repeat it is this one
    shim = _Heads(module, q.shape[1] // kk.shape[1])
    out = inner(shim, q, kk, v, PackedRow(row.lens, row.cu_seqlens), **kwargs)
    return all_heads(_AllToAll.apply(sequence_major(out, k), sp.group))


class _Heads:
    """The attention module as SDPA sees it, with the query/KV head ratio of this rank's heads."""

    def __init__(self, module: Any, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = getattr(module, "is_causal", True)
        self.training = getattr(module, "training", False)


# ----------------------------------------------------------------------------------------- splitting a packed row


@dataclass
class Shard:
    """This rank's chunk of a packed row of N real tokens (padded to ``size`` chunks of C).

    ``ids``/``positions`` [1, C] go through the model; ``row`` is the whole padded row's boundaries (with the group,
    for attention); ``target_ids``/``target_want`` [1, C+1] are the tokens at this chunk's positions and the next
    one, and which of them are scored, for ``head_logprobs_and_entropy``; ``positions_full`` [1, N] the row's
    positions (the critic zeroes values at sequence starts)."""

    ids: torch.Tensor
    positions: torch.Tensor
    row: PackedRow
    target_ids: torch.Tensor
    target_want: torch.Tensor
    positions_full: torch.Tensor
    length: int
    sp: SPGroup


def split(
    ids: torch.Tensor, positions: torch.Tensor, want: torch.Tensor, row: PackedRow, sp: SPGroup
) -> Shard:
    """This rank's ``Shard`` of a packed row: ``ids``/``positions``/``want`` [1, N] (``want``: the tokens whose
    logprob is wanted)."""
    n, k = ids.shape[1], sp.size
    c = -(-n // k)
    pad = c * k - n
    lens, cu = list(row.lens), row.cu_seqlens
    if pad:
        # the padding is a sequence of its own: nothing real attends to it, and its positions restart at 0
        lens.append(pad)
        cu = torch.cat([cu, cu.new_tensor([c * k])])
        ids = F.pad(ids, (0, pad))
        positions = torch.cat([positions, torch.arange(pad, device=positions.device).unsqueeze(0)], dim=1)
    want = want.bool() & (positions[:, :n] != 0)
    want = F.pad(want, (0, pad + 1))  # + 1: the token after the row, never wanted
    ext = F.pad(ids, (0, 1))
    lo, hi = sp.rank * c, (sp.rank + 1) * c
    target_want = want[:, lo : hi + 1].clone()
    target_want[:, 0] = False  # scored by the previous rank, from its last hidden state
    return Shard(
        ids=ids[:, lo:hi],
        positions=positions[:, lo:hi],
        row=PackedRow(lens, cu, sp),
        target_ids=ext[:, lo : hi + 1],
        target_want=target_want,
        positions_full=positions[:, :n],
        length=n,
        sp=sp,
    )


def gather_scores(local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Per-token scores of this chunk's targets ([1, C+1] from ``head_logprobs_and_entropy`` on the shard's
    ``target_*``) -> [1, N] for the whole row, as at K = 1 (0 at t = 0 and wherever not wanted)."""
    full = _GatherChunks.apply(local[:, 1:], shard.sp)  # [1, K*C]: token t + 1 at every row position t
    # a new tensor, not a view: FSDP's root registers its backward hook on what the forward returns
    return F.pad(full[:, : shard.length - 1], (1, 0))


def gather_positions(local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Per-position outputs [1, C] -> [1, N] for the whole row (differentiable)."""
    return _GatherChunks.apply(local, shard.sp)[:, : shard.length]
