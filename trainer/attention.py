"""Attention over packed rows: causal within each sequence, no [N, N] mask, no compiler.

Packed micro-batches (``trainer/batching.py``) put a micro-batch's sequences back to back in one row, positions restarting
at 0 per sequence, and attention must not cross a sequence boundary.  How that attention is computed decides whether
packing saves anything, and it has to run on CPU (torch 2.13, transformers 5.19, the tests) and on the H200 image
(torch 2.11, transformers 5.17, no flash-attn package):

- transformers' own packing detection (``position_ids`` given, no ``attention_mask``; identical code in 5.17 and
  5.19) hands ``flash_attention_2`` the sequence boundaries, but for ``sdpa`` and ``eager`` it builds a dense
  [N, N] block-diagonal mask: N^2 memory, and attention computed over the whole row, which at a 16k-token row costs
  about as much as the rest of a 1.5B model (measured on H200: 1.44 s against 0.92 s for flex attention);
- ``flex_attention`` skips the masked blocks but compiles (Triton on GPU, a C++ toolchain on CPU) and recompiles as
  row lengths change; flash-attn is not installed on the GPU image.

So models on ``sdpa`` (transformers' default) are switched to ``PACKED_ATTENTION``: for padded batches it is
transformers' SDPA unchanged; for a packed row it computes causal attention within each sequence, with no mask, no
compiler and sum(n_i^2) work instead of N^2.  On CUDA in bf16/fp16 that is one call of torch's own flash kernel for
variable lengths (``torch.nn.attention.varlen.varlen_attn``, in torch 2.11 and 2.13); elsewhere (CPU, fp32) it is
``scaled_dot_product_attention(is_causal=True)`` on each sequence's slice; sequences all of one length are one SDPA
call over them as rows.  On one H200 (bf16, 12 heads of 128, 16k tokens, fwd+bwd of one layer) a loop of SDPA calls
costs 2.1 ms for 8 sequences of 2048 and the varlen kernel 2.5 ms, but for 55 sequences of ~300 tokens the loop
costs 6.4 ms and the kernel 1.8 ms: one launch keeps the GPU busy where many short ones do not.  The row's
boundaries (``PackedRow``: lengths on the host, offsets on the device, so nothing syncs) travel as the ``packed_row``
keyword down to every attention call.  Models on another implementation keep it and get transformers' own packing
detection.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

PACKED_ATTENTION = "shardrl_packed_sdpa"


class PackedRow:
    """The sequences of a packed row: ``lens`` on the host (to split on without a device sync) and ``cu_seqlens``
    [S+1] int32, their start offsets and the total, on the row's device (for the varlen kernel).  ``sp``: the
    sequence-parallel group (``trainer/sequence_parallel.py``) when this rank holds only a chunk of the row that
    ``lens`` describes; None otherwise.

    A plain object, not a tuple: compiled decoder layers (``trainer.kernels``) pass it through untouched to the
    attention, which runs outside the compiled code, and the compiler guards only on what it looks into; a tuple's
    items it would look into, and recompile for every new number of sequences in a micro-batch."""

    __slots__ = ("cu_seqlens", "lens", "sp")

    def __init__(self, lens: list[int], cu_seqlens: torch.Tensor, sp: Any = None):
        self.lens = lens
        self.cu_seqlens = cu_seqlens
        self.sp = sp


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., torch.Tensor], dict[str, Any]] | None:
    """torch's variable-length flash attention and the keywords it needs for fewer KV heads than query heads (torch
    2.13 asks for ``enable_gqa``; 2.11 has no such keyword and takes them as they are), or None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    gqa: dict[str, Any] = (
        {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    )
    return cast("Callable[..., torch.Tensor]", varlen_attn), gqa


def _causal_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, row: PackedRow, scaling: float | None
) -> torch.Tensor | None:
    """Causal attention within each sequence in one kernel call, or None where that kernel does not run (CPU,
    fp32, a torch without it)."""
    kernel = _varlen_kernel()
    if kernel is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    fn, gqa = kernel
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, D]
    longest = max(row.lens)
    out = fn(
        q, k, v, row.cu_seqlens, row.cu_seqlens, longest, longest, scale=scaling, window_size=(-1, 0), **gqa
    )
    return out.unsqueeze(0)


def _causal_per_sequence(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: list[int],
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    parts = zip(query.split(lens, 2), key.split(lens, 2), value.split(lens, 2), strict=True)
    outs = [
        sdpa_attention_forward(module, q, k, v, None, dropout, scaling, is_causal=True)[0]
        for q, k, v in parts
    ]
    return torch.cat(outs, dim=1)


def _causal_equal_lengths(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    count: int,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """``count`` sequences of one length as a batch of rows: one SDPA call, as fast as unpadded rows (the varlen
    kernel is ~20% slower on attention at 8 x 2048)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rows(x: torch.Tensor) -> torch.Tensor:  # [1, h, count * n, D] -> [count, h, n, D]
        return x[0].unflatten(1, (count, -1)).transpose(0, 1)

    out = sdpa_attention_forward(
        module, rows(query), rows(key), rows(value), None, dropout, scaling, is_causal=True
    )[0]
    return out.flatten(0, 1).unsqueeze(0)  # [count, n, heads, D] -> [1, N, heads, D]


# Left out of compiled decoder layers (``trainer.kernels``): a packed row's lengths are Python ints that change with
# every micro-batch, which compiled code would specialise on and recompile for; the kernels called here are fused
# already.
@torch.compiler.disable
def _packed_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed_row: PackedRow | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, or causal attention within each sequence of a packed row (``packed_row``).

    ``query`` [1, heads, N, D] and ``key``/``value`` [1, kv heads, N, D] -> ([1, N, heads, D], None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_row is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if sliding_window is not None:
        raise ValueError(
            "packed micro-batches do not support sliding-window attention; set trainer.packing = false"
        )
    if packed_row.sp is not None:  # this rank holds a chunk of the row: the group exchanges heads around it
        out = packed_row.sp.attention(
            _packed_row_attention, module, query, key, value, packed_row, dropout=dropout, scaling=scaling
        )
        return out, None
    return _packed_row_attention(
        module, query, key, value, packed_row, dropout=dropout, scaling=scaling
    ), None


def _packed_row_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed_row: PackedRow,
    *,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each sequence of a whole packed row: [1, heads, N, D] -> [1, N, heads, D]."""
    if query.shape[0] != 1 or sum(packed_row.lens) != query.shape[2]:
        raise ValueError(
            f"packed row of shape {tuple(query.shape)} does not hold sequences of {packed_row.lens}"
        )
    if len(set(packed_row.lens)) == 1:
        return _causal_equal_lengths(module, query, key, value, len(packed_row.lens), dropout, scaling)
    out = _causal_varlen(query, key, value, packed_row, scaling) if dropout == 0.0 else None
    if out is None:
        out = _causal_per_sequence(module, query, key, value, packed_row.lens, dropout, scaling)
    return out


def _padding_mask_only(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's mask for padded rows; none for a packed row, whose boundaries ``_packed_sdpa`` applies itself (the
    alternative is transformers' dense [N, N] mask, built from ``position_ids`` and then ignored)."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return cast("torch.Tensor | None", sdpa_mask(*args, **kwargs))


def use_packed_attention(model: Any) -> bool:
    """Switch an HF model on SDPA to ``PACKED_ATTENTION`` (in place); True if the model now uses it.

    Models on another implementation are left alone: flash attention and flex attention take packed rows from
    ``position_ids`` themselves (eager then builds a dense mask, which is correct and slow).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    current = model.config._attn_implementation
    if current == PACKED_ATTENTION:
        return True
    if current != "sdpa":
        return False
    AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa)
    AttentionMaskInterface.register(PACKED_ATTENTION, _padding_mask_only)
    model.set_attn_implementation(PACKED_ATTENTION)
    return True


def packing_kwargs(config: Any, position_ids: torch.Tensor | None, row: PackedRow | None) -> dict[str, Any]:
    """Extra keywords of an HF forward over a packed row (none for a padded batch)."""
    if row is None:
        return {}
    if position_ids is None:
        raise ValueError("a packed row needs position_ids that restart at 0 for each sequence")
    if config._attn_implementation == PACKED_ATTENTION:
        return {"packed_row": row}
    if row.sp is not None:
        raise ValueError(
            f"trainer.sequence_parallel needs the model on sdpa attention (it is {config._attn_implementation!r})"
        )
    return {}  # transformers finds the boundaries in position_ids


def pack(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, T] in the padded layout of a collated micro-batch -> [1, N] in its packed row."""
    return x.flatten()[batch["packed_index"]].unsqueeze(0)


def unpack(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1, N] in the packed row -> [B, T] in the padded layout, 0 on padding (differentiable)."""
    shape = batch["input_ids"].shape
    flat = x.new_zeros(shape.numel()).scatter(0, batch["packed_index"], x[0])
    return flat.view(shape)


def packed_row(batch: dict[str, torch.Tensor]) -> PackedRow:
    """The sequence boundaries of a collated packed micro-batch."""
    return PackedRow([int(n) for n in batch["packed_lens"].tolist()], batch["packed_cu_seqlens"])
