"""A planned step's samples -> optimizer updates -> each rank's share -> token-balanced micro-batches -> tensors.

Micro-batches are packed by default (``trainer.packing``): the model sees one row holding every sequence back to back,
with positions restarting at 0 per sequence, so no compute is spent on padding and the token budget counts real
tokens.  ``collate`` still returns the right-padded [B, T] layout as well: the losses, GAE and metrics work on it,
and ``trainer.model.batch_logprobs``/``batch_values`` scatter the packed outputs back into it.  Used by
``trainer/step.py``.
"""

from __future__ import annotations

from typing import Any

from trainer.data import Sample


def split_updates(samples: list[Sample], updates: int) -> list[list[Sample]]:
    """The step's samples as ``updates`` mini-batches (one optimizer update each), interleaved so that each holds a
    slice of every group; the same on every rank.  Never more mini-batches than samples."""
    n = max(1, min(updates, len(samples)))
    return [samples[i::n] for i in range(n)]


def assign_to_ranks(samples: list[Sample], world: int) -> list[list[Sample]]:
    """Deterministic token-balanced split: longest first onto the least-loaded rank."""
    loads = [0] * world
    out: list[list[Sample]] = [[] for _ in range(world)]
    for s in sorted(samples, key=lambda s: (-s.length, s.sample_id)):
        r = loads.index(min(loads))
        out[r].append(s)
        loads[r] += s.length
    return out


def microbatches(samples: list[Sample], max_tokens: int, *, packed: bool = True) -> list[list[Sample]]:
    """Micro-batches within a budget of ``max_tokens``; a longer sample goes alone.

    Packed micro-batches count real tokens (the sum of the lengths) and are filled first-fit in decreasing length
    order, which comes within a micro-batch of the fewest possible; every micro-batch costs a pass over all FSDP
    units, and in the last one the ranks wait for the busiest.  Padded ones count rows x longest row, so they hold
    samples of similar length: consecutive in increasing length order.
    """
    if packed:
        return _first_fit_decreasing(samples, max_tokens)
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    for s in sorted(samples, key=lambda s: s.length):
        if cur and (len(cur) + 1) * s.length > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out


def _first_fit_decreasing(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    bins: list[list[Sample]] = []
    loads: list[int] = []
    for s in sorted(samples, key=lambda s: (-s.length, s.sample_id)):
        i = next((i for i, load in enumerate(loads) if load + s.length <= max_tokens), len(bins))
        if i == len(bins):
            bins.append([])
            loads.append(0)
        bins[i].append(s)
        loads[i] += s.length
    return bins


# Batch entries that stay on the host: Python-side sizes the attention splits on (a device copy would cost a sync).
HOST_KEYS = frozenset({"packed_lens"})


def collate(batch: list[Sample], pad_id: int, *, packed: bool = False) -> dict[str, Any]:
    """Right-padded tensors of one micro-batch, plus the packed row when ``packed``.

    ``input_ids`` [B,T]; ``response_mask`` [B,T] marks positions whose token is a response token the model sampled
    (the logprob at position t is that of ``input_ids[:, t]``; a multi-turn sample's environment tokens, loss mask 0,
    are attended but not marked, so losses, KL, entropy and advantages never reach them); ``behaviour_logp`` and
    ``advantages`` are aligned with it and 0 where it is.

    Packed, it adds the same tokens as one row without padding: ``packed_ids`` and ``packed_positions`` [1,N]
    (N real tokens; positions restart at 0 for each sequence), ``packed_index`` [N] (where each packed token sits in
    the flattened [B*T] layout), ``packed_lens`` [S] (the lengths of the S non-empty sequences, kept on the host) and
    ``packed_cu_seqlens`` [S+1] int32 (where each sequence starts, then N).
    """
    import torch

    width = max((s.length for s in batch), default=1)
    b = len(batch)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    behaviour = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    rewards = torch.zeros(b, dtype=torch.float32)
    for i, s in enumerate(batch):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attn[i, : p + r] = 1
        mask[i, p : p + r] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour[i, p : p + r] = torch.tensor(s.response_logprobs) * mask[i, p : p + r]
        adv[i, p : p + r] = s.advantage * mask[i, p : p + r]
        rewards[i] = s.reward
    out = {
        "input_ids": input_ids,
        "attention_mask": attn,
        "response_mask": mask,
        "behaviour_logp": behaviour,
        "advantages": adv,
        "rewards": rewards,
    }
    if packed:
        real = attn.bool()
        lens = attn.sum(1)
        # Right padding: the real tokens in row-major order are the sequences back to back.
        out["packed_ids"] = input_ids[real].unsqueeze(0)
        out["packed_positions"] = (attn.cumsum(1) - 1)[real].unsqueeze(0)
        out["packed_index"] = real.flatten().nonzero().squeeze(1)
        out["packed_lens"] = lens[lens > 0]
        out["packed_cu_seqlens"] = torch.cat([lens.new_zeros(1), out["packed_lens"].cumsum(0)]).int()
    return out


def batch_to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """A collated micro-batch on ``device``, but for the host-side entries (``HOST_KEYS``).

    To a GPU the copies go from pinned host memory without waiting: each is queued behind the work already launched
    on the stream, so the host can build the next micro-batch while the device runs this one (a copy from pageable
    memory waits for the stream).  Torch's pinned-memory cache keeps each block until its copy has run.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {k: v if k in HOST_KEYS else v.to(device) for k, v in batch.items()}
    return {
        k: v if k in HOST_KEYS else v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()
    }
