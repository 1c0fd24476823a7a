"""Attention for the streaming transformers engine's ragged batches: rows of different lengths, left-padded.

transformers' SDPA path is built for batches of one length.  Given a padding mask it (1) builds a 4-D mask from the
2-D one each forward, checking first whether any padding exists, which waits for the device, and (2) copies every
cached key and value once per query head group (``repeat_kv``: 7x the cache at the Qwen2.5-0.5B shape), since
it uses SDPA's grouped-query mode only when there is no mask.  A continuously batched cache always has padding, so it paid both
on every decode step.  And with a mask PyTorch picks cuDNN's attention on recent GPUs, which plans its kernel on the
host for each new shape, about 3 ms of CPU a call on an H200 against 27 us of GPU time, and a growing cache is a new
shape at every step: 24 layers made that ~75 ms of a ~95 ms decode step.  So cuDNN is left out here; the
memory-efficient kernel takes the mask at no planning cost.

Here the engine passes its own boolean 4-D mask (transformers hands a 4-D mask to the attention function as it is),
and a decode step folds each key/value head's query heads into the query axis: ``[B, H, 1, D]`` becomes
``[B, H_kv, H / H_kv, D]`` against ``[B, H_kv, T, D]`` keys, one SDPA call, no copy of the cache.  That is exact: at
one query position every head of a group sees the same keys under the same mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NAME = "shardrl_ragged"


def ragged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query [B, H, q, D]``, ``key``/``value [B, H_kv, T, D]``, ``attention_mask`` bool ``[B, 1, q, T]`` (True:
    attend) -> ``([B, q, H, D], None)``, the layout transformers' attention functions return."""
    import torch

    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise RuntimeError(
            f"{NAME} attention needs the engine's boolean 4-D mask, got {attention_mask!r:.60}"
        )
    from torch.nn.attention import sdpa_kernel

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(sdpa_backends()):
        if q_len == 1:
            # Head h uses key/value head h // groups (repeat_kv's order), so a plain view groups them.
            folded = query.reshape(batch, kv_heads, groups, dim)
            out = sdpa(folded, key, value, attn_mask=attention_mask, scale=scaling)
            return out.reshape(batch, heads, 1, dim).transpose(1, 2), None
        if groups > 1:  # a prefill: the copy is paid once per join, not per decode step
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = sdpa(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2), None


def sdpa_backends() -> list[Any]:
    """Every SDPA backend but cuDNN's (flash, which takes no mask, is CPU's fused kernel)."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def install(model: Any) -> None:
    """Switch ``model``'s attention to ``ragged_attention`` (registered once per process)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, ragged_attention)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(NAME)
    else:
        model.config._attn_implementation = NAME


def decode_mask(mask: torch.Tensor) -> torch.Tensor:
    """The running rows' bool ``[B, T]`` key mask as the ``[B, 1, 1, T]`` mask of one decode step."""
    return mask[:, None, None, :]


def prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """Causal and padding mask ``[B, 1, T, T]`` of a left-padded prefill of bool ``[B, T]``.

    A padding position attends to itself alone, so no row of the mask is empty: an empty row makes SDPA return NaN
    there, and a NaN in a padded key or value would poison the real rows through the zero weights that multiply it.
    """
    import torch

    width = mask.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool, device=mask.device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=mask.device)
    return ((causal[None] & mask[:, None, :]) | eye[None])[:, None]
