"""The LM head alone: forward and backward of a per-token loss over [tokens x vocab] logits, three ways, against the
matrix products none of them can avoid, timed in the same run.

    python bench/head.py                                            # CPU: 2048 tokens, hidden 256, vocab 32768, fp32
    python bench/head.py --preset qwen2.5-7b --tokens 16384         # GPU: the 7B head over one micro-batch, bf16

- whole:      autograd through the whole fp32 logits, as a plain HF loss takes them: three products, [N x V] fp32 held;
- recompute:  the trainer's chunked head (``trainer.logprobs.head_logprobs_and_entropy``, each chunk checkpointed):
              four products (each chunk's logits again in backward), one chunk's logits alive;
- fused:      the same head with ``trainer.fused_head``: three products, one chunk's logits alive;
- compiled:   fused with ``trainer.compile_head``: each chunk's softmax, entropy and logits' gradient as two compiled
              kernels (compiled in the warm-up run, outside the timing).

The floor is three products of the logits' size (the logits, then the gradients of the input and of the weight), timed
alone here. Each way prints its mean time over ``--repeat`` runs after one warm-up, the spread, and its ratio to the
floor; then fused / recompute, and how far the fused head's gradients are from the recomputing head's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import SHAPES

from trainer.fused_head import HeadLoss
from trainer.logprobs import head_logprobs_and_entropy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--preset", choices=sorted(SHAPES), default=None, help="hidden size and vocabulary of a shape"
    )
    p.add_argument("--hidden", type=int, default=256, help="hidden size without --preset")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary without --preset")
    p.add_argument("--tokens", type=int, default=2048, help="scored tokens (one micro-batch's)")
    p.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each way, after one warm-up")
    p.add_argument(
        "--no-whole", action="store_true", help="skip the whole-logits way (its [N x V] fp32 memory)"
    )
    p.add_argument("--device", default=None, help="default: cuda when there is one, else cpu")
    args = p.parse_args(argv)
    if args.preset:
        args.hidden, args.vocab = SHAPES[args.preset]["hidden_size"], SHAPES[args.preset]["vocab_size"]
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n, hid, vocab = args.tokens, args.hidden, args.vocab
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n + 1, hid, generator=g).to(device, dtype)  # the state at t scores token t + 1
    weight = (torch.randn(vocab, hid, generator=g) / math.sqrt(hid)).to(device, dtype)
    ids = torch.randint(0, vocab, (1, n + 1), generator=g).to(device)
    want = torch.ones(1, n + 1, dtype=torch.bool, device=device)
    old = (-torch.rand(n, generator=g) * 3).to(device)
    adv = torch.randn(n, generator=g).to(device)

    def loss_of(logp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        """A clipped ratio and an entropy bonus per token, over [1, n + 1] (position 0 scores nothing)."""
        lp, en = logp[0, 1:], ent[0, 1:]
        ratio = torch.exp(lp - old)
        return (torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28)) - 0.01 * en).mean()

    def leaves() -> tuple[torch.Tensor, torch.nn.Linear]:
        head = torch.nn.Linear(hid, vocab, bias=False, device=device, dtype=dtype)
        head.weight.data.copy_(weight)
        return hidden.clone().requires_grad_(), head

    def whole() -> tuple[torch.Tensor, torch.Tensor]:
        h, head = leaves()
        logsm = torch.log_softmax(F.linear(h[0, :-1], head.weight).float(), dim=-1)
        lp = logsm.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1)
        pad = torch.zeros(1, device=device)
        loss_of(torch.cat([pad, lp]).unsqueeze(0), torch.cat([pad, ent]).unsqueeze(0)).backward()
        return h.grad, head.weight.grad  # type: ignore[return-value]

    def recompute() -> tuple[torch.Tensor, torch.Tensor]:
        h, head = leaves()
        logp, ent = head_logprobs_and_entropy(h, head, ids, want, chunk=args.chunk)
        loss_of(logp, ent).backward()
        return h.grad, head.weight.grad  # type: ignore[return-value]

    def fused(compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h, head = leaves()
        fn = HeadLoss(loss_of, compiled)
        head_logprobs_and_entropy(h, head, ids, want, chunk=args.chunk, loss=fn)
        assert fn.carrier is not None
        fn.carrier.backward()
        return h.grad, head.weight.grad  # type: ignore[return-value]

    d = torch.randn(n, vocab, generator=g).to(device, dtype)
    h2 = hidden[0, 1:]

    def floor() -> None:
        F.linear(h2, weight)  # the logits
        d @ weight  # the input's gradient
        d.t() @ h2  # the weight's

    print(
        f"head: {n} tokens, hidden {hid}, vocab {vocab}, {dtype} on {device}, chunks of {args.chunk}; mean of "
        f"{args.repeat} runs after 1",
        flush=True,
    )
    base = timed(floor, device, args.repeat)
    mean = sum(base) / len(base)
    print(f"{'floor: 3 products':24s}{mean:9.4f} s  ({min(base):.4f}-{max(base):.4f})", flush=True)
    ways = {"whole": whole, "recompute": recompute, "fused": fused, "compiled": lambda: fused(True)}
    if args.no_whole:
        del ways["whole"]
    means = {}
    for name, fn in ways.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runs = timed(fn, device, args.repeat)
        means[name] = sum(runs) / len(runs)
        peak = (
            f"  peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
            if device.type == "cuda"
            else ""
        )
        print(
            f"{name:24s}{means[name]:9.4f} s  ({min(runs):.4f}-{max(runs):.4f})  {means[name] / mean:5.2f}x the floor"
            f"{peak}",
            flush=True,
        )
    print(f"fused / recompute time {means['fused'] / means['recompute']:.3f}", flush=True)
    print(f"compiled / fused time {means['compiled'] / means['fused']:.3f}", flush=True)
    pairs = (("fused", "recompute", fused(), recompute()), ("compiled", "fused", fused(True), fused()))
    for name, ref, grads, ref_grads in pairs:
        for label, a, b in zip(("input", "weight"), grads, ref_grads, strict=True):
            err = float((a.float() - b.float()).norm() / b.float().norm())
            print(f"{name} vs {ref}, gradient of the {label}: relative difference {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
