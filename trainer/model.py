"""The trainer's models: HF load, FSDP2 sharding, chunked token logprobs, reference and critic, optimizer helpers.

Sharding follows one order: activation checkpointing on each decoder layer, then ``fully_shard`` on each decoder
layer, then on the root.  Every unit gets the same ``MixedPrecisionPolicy`` (mixing policies fails with a dtype
mismatch).  Embeddings, the final norm and the LM head stay in the root unit, which keeps a tied LM head with its
embedding (sharding them apart raises on torch >= 2.13 and silently unties on 2.11).

The root is a thin wrapper (``Actor``/``Critic``) whose ``forward`` runs the base model *and* the head, so FSDP's
forward/backward hooks surround both: the LM head is applied chunk by chunk over the tokens inside that forward and
never materialises a [tokens x vocab] fp32 tensor.  Parameter names below the wrapper stay the HF names
(``Actor.lm`` is the HF model); ``trainer/publish.py`` writes them without the wrapper prefixes.

Call ``trainer.dist.init()`` first: the builders shard over all ranks of the default process group, which exists
also for a single process started without torchrun.

Packed micro-batches (``trainer/data.py``) put a micro-batch's sequences back to back in one row, positions restarting
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
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ParamDtype = Literal["auto", "float32", "bfloat16"]
Schedule = Literal["constant", "cosine"]


# ------------------------------------------------------------------------------------------------ loading/sharding


def resolve_param_dtype(param_dtype: ParamDtype, device: torch.device) -> torch.dtype:
    """The FSDP compute dtype: ``auto`` is bf16 on GPU and fp32 on CPU (master weights are always fp32)."""
    if param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if param_dtype == "float32":
        return torch.float32
    if param_dtype == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"param_dtype: {param_dtype!r} is not one of auto, float32, bfloat16")


def load_causal_lm(model_dir: str | Path, *, weights: bool = True) -> nn.Module:
    """An HF causal LM from ``model_dir`` in fp32 on the CPU (FSDP moves each unit's shard to the device);
    ``weights=False``: the same model built from its config on the meta device (nothing read, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not an HF model directory (no config.json); check model.path")
    if weights:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)


def reads_weights() -> bool:
    """Whether this rank reads model weights from disk: only rank 0 does; the others build on the meta device and
    receive their shards from it (``load_once``), so a node holds one host copy of a model, not one per rank."""
    return not dist.is_initialized() or dist.get_rank() == 0


def load_once(root: nn.Module, layers: nn.ModuleList, device: torch.device, **sharding: Any) -> None:
    """``shard`` (with ``sharding``, its keyword arguments) a model that holds its weights on rank 0 and is on the
    meta device elsewhere, then give every rank its shards from rank 0's full state dict.

    Buffers are broadcast too: non-persistent ones (rotary ``inv_freq``) are in no state dict, and a meta rank's
    ``to_empty`` leaves them uninitialised.
    """
    single = dist.get_world_size() == 1
    # rank 0's weights as they are (fp32; a frozen LoRA base in the compute dtype)
    full = root.state_dict() if reads_weights() and not single else None
    shard(root, layers, device, **sharding)
    if single:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(p.is_meta for p in root.parameters()):  # offloaded shards live in host memory
        root.to_empty(device="cpu" if sharding.get("cpu_offload") else device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(root, full or {}, options=options)
    del full
    for buf in root.buffers():
        dist.broadcast(buf, src=0)


def decoder_layers(base: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF base model (``Qwen2Model.layers`` and every Llama-like model)."""
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(base).__name__}: no `layers` ModuleList; cannot shard it per decoder layer")
    return layers


def shard(
    root: nn.Module,
    layers: nn.ModuleList,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
) -> None:
    """Apply activation checkpointing, then ``fully_shard`` per layer, then on ``root``, over all ranks (in place).

    ``cpu_offload``: every unit keeps its shards (parameters, gradients, hence the optimizer state) in host memory,
    pinned on GPU so the copies around each unit's compute are asynchronous; the optimizer steps on the CPU.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("trainer.model: call trainer.dist.init() before building a sharded model")
    if activation_checkpointing:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=resolve_param_dtype(param_dtype, device), reduce_dtype=torch.float32
    )
    # CPU-only machines cannot pin memory
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(root, mesh=mesh, mp_policy=policy, offload_policy=offload)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit (the root keeps them after a forward without backward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


# ----------------------------------------------------------------------------------------------- packed attention

PACKED_ATTENTION = "shardrl_packed_sdpa"


class PackedRow(NamedTuple):
    """The sequences of a packed row: ``lens`` on the host (to split on without a device sync) and ``cu_seqlens``
    [S+1] int32, their start offsets and the total, on the row's device (for the varlen kernel)."""

    lens: list[int]
    cu_seqlens: torch.Tensor


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
    if query.shape[0] != 1 or sum(packed_row.lens) != query.shape[2]:
        raise ValueError(
            f"packed row of shape {tuple(query.shape)} does not hold sequences of {packed_row.lens}"
        )
    if len(set(packed_row.lens)) == 1:
        return _causal_equal_lengths(module, query, key, value, len(packed_row.lens), dropout, scaling), None
    out = _causal_varlen(query, key, value, packed_row, scaling) if dropout == 0.0 else None
    if out is None:
        out = _causal_per_sequence(module, query, key, value, packed_row.lens, dropout, scaling)
    return out, None


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


def _packing_kwargs(config: Any, position_ids: torch.Tensor | None, row: PackedRow | None) -> dict[str, Any]:
    """Extra keywords of an HF forward over a packed row (none for a padded batch)."""
    if row is None:
        return {}
    if position_ids is None:
        raise ValueError("a packed row needs position_ids that restart at 0 for each sequence")
    if config._attn_implementation == PACKED_ATTENTION:
        return {"packed_row": row}
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


# ------------------------------------------------------------------------------------------- logprobs and entropy


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
        **_packing_kwargs(lm.config, position_ids, packed),
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs_and_entropy`` of a collated micro-batch (``trainer.data.collate``), packed or padded.

    Returns ``(logp, entropy)`` [B, T] in the padded layout either way, 0 on padding and unwanted tokens.
    """
    opts: dict[str, Any] = {"chunk": chunk, "temperature": temperature, "with_entropy": with_entropy}
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


# --------------------------------------------------------------------------------------------------- the builders


def build_actor(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    lora: Any = None,
) -> Actor:
    """The trainable actor, sharded over all ranks, in train mode; ``lora`` (``model.lora``) with rank > 0 puts
    LoRA adapters on a frozen base (``trainer/lora.py``)."""
    from trainer.lora import maybe_lora

    lm = load_causal_lm(model_dir, weights=reads_weights())
    return shard_actor(
        maybe_lora(lm, lora, param_dtype, device, "model.lora"),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
    )


def shard_actor(
    lm: Any,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
) -> Actor:
    """Wrap an already built HF causal LM (fp32 on CPU or ``device``; on the meta device on ranks other than 0, see
    ``load_once``) as a sharded ``Actor``."""
    actor = Actor(lm)
    load_once(
        actor,
        decoder_layers(lm.base_model),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
    )
    return actor.train()


def build_reference(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    cpu_offload: bool = False,
) -> Actor:
    """A frozen copy of the actor's base (KL reference): sharded like the actor, no grad, eval mode."""
    lm = load_causal_lm(model_dir, weights=reads_weights())
    lm.requires_grad_(False)
    actor = shard_actor(lm, device, param_dtype=param_dtype, cpu_offload=cpu_offload)
    return actor.eval()


class Critic(nn.Module):
    """A value model: an HF base model and a ``Linear(hidden, 1)`` head on its last hidden state; the root unit."""

    def __init__(self, base: Any, hidden_size: int):
        super().__init__()
        self.base: Any = base
        use_packed_attention(base)
        # on the base's device: the meta device on ranks that receive their weights from rank 0 (``load_once``)
        self.value_head = nn.Linear(hidden_size, 1, device=next(base.parameters()).device)
        # Values start at 0: early advantages are then the returns themselves, not a random head's noise.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        packed: PackedRow | None = None,
    ) -> torch.Tensor:
        h = self.base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **_packing_kwargs(self.base.config, position_ids, packed),
        ).last_hidden_state
        v = self.value_head(h).squeeze(-1).float()
        # Aligned with token_logprobs_and_entropy: values[b, t] is the value of the state in which token t is chosen
        # (the prefix before t), so it reads the hidden state at t - 1; nothing precedes t = 0 (nor, in a packed row,
        # a position id 0: the state before it belongs to another sequence).
        v = F.pad(v[:, :-1], (1, 0))
        return v if position_ids is None else v.masked_fill(position_ids == 0, 0.0)

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        packed: PackedRow | None = None,
    ) -> torch.Tensor:
        """[B, T] fp32 values (see ``forward``); with FSDP call this, not ``self.base``, so the hooks run."""
        out = self(input_ids, attention_mask, position_ids, packed)
        if not torch.is_grad_enabled():
            reshard(self)
        return out


def batch_values(critic: Critic, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The critic's values of a collated micro-batch, packed or padded: [B, T] in the padded layout, 0 on padding
    when packed (with or without grad)."""
    if "packed_ids" not in batch:
        return critic.values(batch["input_ids"], batch["attention_mask"])
    v = critic.values(batch["packed_ids"], None, batch["packed_positions"], packed_row(batch))
    return unpack(v, batch)


def build_critic(
    model_dir: str | Path,
    device: torch.device,
    *,
    param_dtype: ParamDtype = "auto",
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    lora: Any = None,
) -> Critic:
    """A critic on a copy of the base model in ``model_dir`` (its LM head dropped), sharded over all ranks;
    ``lora`` (``trainer.critic_lora``) with rank > 0: LoRA adapters on its frozen base, the value head trains."""
    from trainer.lora import maybe_lora

    lm: Any = load_causal_lm(model_dir, weights=reads_weights())
    lm = maybe_lora(lm, lora, param_dtype, device, "trainer.critic_lora")
    base = lm.base_model
    critic = Critic(base, int(lm.config.hidden_size))
    del lm
    load_once(
        critic,
        decoder_layers(base),
        device,
        param_dtype=param_dtype,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
    )
    return critic.train()


def hf_module(model: nn.Module) -> nn.Module:
    """The HF model inside an ``Actor`` (the model itself otherwise): the module whose names are HF names."""
    return model.lm if isinstance(model, Actor) else model


# ------------------------------------------------------------------------------------------------ optimization


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm weights (1-d) get no weight decay.

    On the GPU the update is the fused kernel: the default multi-tensor path builds temporaries as large as a
    group's parameters (sqrt of the second moment, the step), 4 bytes per parameter on top of AdamW's 16, which is
    what kept a 7B full-weight step from one H200.  Elsewhere (CPU training, parameters offloaded to the host) the
    default path stays."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": ps, "weight_decay": wd}
        for ps, wd in ((decay, weight_decay), (no_decay, 0.0))
        if ps  # an empty group would make the state-dict layout depend on the model
    ]
    on_gpu = bool(decay or no_decay) and all(p.device.type == "cuda" for p in (*decay, *no_decay))
    return torch.optim.AdamW(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True if on_gpu else None
    )


def lr_factor(
    step: int, *, warmup_steps: int, schedule: Schedule, total_steps: int, min_lr_ratio: float = 0.0
) -> float:
    """The multiplier of the base LR at optimizer step ``step`` (0-based): linear warmup, then constant/cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    schedule: Schedule,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``lr_factor``; its state dict is plain numbers (checkpointed as JSON)."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule: {schedule!r} is not one of constant, cosine")

    def factor(step: int) -> float:
        return lr_factor(
            step,
            warmup_steps=warmup_steps,
            schedule=schedule,
            total_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip gradients to their global L2 norm over all ranks' shards; returns the norm before clipping.

    Works on each rank's local shards as plain tensors, wherever they live (the device, or host memory with
    ``trainer.cpu_offload``): the squared norms are summed across ranks on the collective device, and every rank
    scales its shards by the same factor.  A non-finite norm is returned as is (the caller skips the step); the
    gradients are then scaled by a NaN/0 factor.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squared = torch.nn.utils.get_total_norm(local, norm_type=2.0).double() ** 2
    if any(isinstance(g, DTensor) for g in grads) and dist.is_initialized() and dist.get_world_size() > 1:
        from trainer import dist as tdist

        squared = tdist.all_reduce_sum(squared.cpu())
    total = squared.sqrt()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in local:
        g.mul_(factor.to(device=g.device, dtype=g.dtype))
    return float(total.item())
