"""One decode step of the transformers model over rows of one length against rows of different lengths (left-padded):
what continuous batching on a dense KV cache costs the streaming transformers engine.

    python bench/ragged_decode.py --model PATH [--rows 32 --length 200 --steps 30 --device cpu --threads 1 --profile]

Caches of ``--rows`` rows: every row ``--length`` tokens (no padding: transformers' SDPA path then passes no mask),
rows of lengths spread over 10..length prefilled together (left-padded) under transformers' SDPA path with a 2-D
padding mask, the same rows joined one by one with the streaming engine's merge, and the ragged rows again under the
streaming engine's own attention (``rollout_worker/engines/ragged_attention.py``: its 4-D mask, query heads folded
per key/value head).  Prints the mean seconds of a decode step of each and their ratio to the first; ``--profile``
adds the ten most expensive operators of each ragged case (device time on a GPU, else CPU time).  Measures only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_worker.engines import ragged_attention
from rollout_worker.engines.hf_stream import _merge


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default torch's)")
    p.add_argument("--profile", action="store_true", help="print the top operators of each ragged case")
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, DynamicCache

    dev = torch.device(args.device)
    model: Any = (
        AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(dev).eval()
    )

    def prefill(rows: list[list[int]]) -> tuple[Any, Any]:
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        cache = DynamicCache(config=model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            logits_to_keep=1,
        )
        return cache, mask

    def decode(cache: Any, mask: Any, lengths: list[int], *, ragged: bool = False) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        mask = mask.bool() if ragged else mask
        for _ in range(args.steps):
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
            positions = torch.tensor(lengths, device=dev)[:, None]
            token = torch.ones((mask.shape[0], 1), dtype=torch.long, device=dev)
            step_mask = ragged_attention.decode_mask(mask) if ragged else mask
            model(input_ids=token, attention_mask=step_mask, position_ids=positions, past_key_values=cache)
            lengths = [n + 1 for n in lengths]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - start) / args.steps

    def profiled(name: str, run: Any) -> float:
        if not args.profile:
            return float(run())
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            seconds = float(run())
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(f"--- {name}: {seconds * 1e3:.2f} ms a step (profiled)", file=sys.stderr)
        print(prof.key_averages().table(sort_by=key, row_limit=10), file=sys.stderr)
        return seconds

    ragged = [10 + (k * 37) % max(1, args.length - 10) for k in range(args.rows)]
    vocab = int(model.config.vocab_size)

    def tokens(n: int) -> list[int]:
        return [5 + i % (vocab - 10) for i in range(n)]

    seq = [tokens(n) for n in ragged]
    out: dict[str, float] = {}
    with torch.inference_mode():
        out["one_length_s"] = decode(*prefill([tokens(args.length)] * args.rows), [args.length] * args.rows)
        out["ragged_prefilled_s"] = profiled("sdpa, 2-D mask", lambda: decode(*prefill(seq), ragged))
        cache, mask = prefill(seq[:1])
        for s in seq[1:]:
            cache, mask = _merge(cache, mask, *prefill([s]), model.config)
        out["ragged_merged_s"] = decode(cache, mask, ragged)
        # The streaming engine's attention on the same ragged rows (prefilled under SDPA: the cache is the same).
        cache, mask = prefill(seq)
        ragged_attention.install(model)
        out["ragged_own_attention_s"] = profiled(
            "own attention", lambda: decode(cache, mask, ragged, ragged=True)
        )
    for k in ("ragged_prefilled", "ragged_merged", "ragged_own_attention"):
        out[f"{k}_vs_one_length"] = out[f"{k}_s"] / out["one_length_s"]
    print(json.dumps({k: round(v, 5) for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
