"""Benchmark of the trainer step against a bare FSDP2 forward+backward of the same tokens, in the same run.

    python -m torch.distributed.run --nproc_per_node=N bench/trainer.py                  # Qwen2.5-1.5B shape
    python -m torch.distributed.run --nproc_per_node=N bench/trainer.py --lengths longtail
    python bench/trainer.py --preset tiny                                                 # one process, CPU smoke

Builds a randomly initialised Qwen2 with a published model's shapes on the current device (GPU when there is one,
else CPU) and synthetic samples (``--samples-per-rank`` x ``--seq-len`` tokens per rank, ``--prompt-len`` of them
prompt), then times, one after the other:

- bare:     a plain HF causal LM sharded the same way (activation checkpointing, ``fully_shard`` per decoder layer
            and root, the same mixed precision) computing the same tokens as the trainer: the decoder on every
            token, the LM head and a cross-entropy on the response tokens only, then backward, over the same
            micro-batches; no optimizer (``--bare-adam`` adds clip + AdamW, to show what the update costs);
- trainer:  ``trainer.step.train_step`` with the run config's defaults (GRPO, decoupled objective, bf16 compute on
            GPU, activation checkpointing): advantages, chunked logprobs, losses, backward, clip, AdamW, metrics.

Prints per path the step time, tokens/s (all tokens of all ranks), MFU against a bf16 peak of 989 TFLOP/s per H200
(not meaningful on CPU), peak memory, and the ratio trainer tokens/s / bare tokens/s.  MFU counts the FLOPs a
forward + backward runs (``step_flops``): 6 x the decoder's parameters x every token (the input embedding is a
lookup, not a matmul), 6 x hidden x vocab x the response tokens (the only ones the LM head is applied to), and,
reported apart, causal attention, 6 x layers x hidden x sum(sequence length^2); activation recomputation is not
counted as useful work.

``--preset qwen2.5-7b`` is the Qwen2.5-7B shape (untied, 7.6B parameters): fp32 master weights, gradients and AdamW
state are 16 bytes per parameter, so its full-weight step peaks at 117.9 GiB on one H200 (it also ran on two), or
``--cpu-offload`` (``trainer.cpu_offload``: parameters, gradients and optimizer state in host memory, the optimizer
step on the CPU), or ``--lora R`` (a frozen bf16 base).
``--preset qwen2.5-7b-8l`` keeps 8 of those 28 decoder layers (2.95B parameters), for a GPU of 80 GB.

``--kernels`` sets ``trainer.kernels`` of the trainer path (``auto``: the decoder layers compiled on GPU; the bare
path stays plain HF, eager).  ``--profile`` then runs ``--profile-steps`` more steps of each path with every phase
boundary synchronised (``trainer/phases.py``) and prints where the time goes, bare and trainer side by side: the
decoder's forward, the LM head (logprobs, entropy, top-k KL), the rest of the forward (losses), the reference and
proximal passes (``prepare``), backward (with the recomputation), clip + optimizer, and the remainder.

``--sequence-parallel K`` runs the packed trainer paths with ``trainer.sequence_parallel = K`` (Ulysses: each
micro-batch's tokens split over K ranks, which exchange attention heads); K must divide the ranks and the preset's
attention heads.  The step's samples are the same (``--samples-per-rank`` x ranks), so tokens per rank and tokens/s
compare with K = 1 directly.

``--lengths longtail`` measures what padding would cost instead: response lengths are drawn log-uniformly between
``--response-min`` and ``--response-max`` (32..4096 by default: as many sequences under 128 tokens as between 1024 and
4096), after the same ``--prompt-len``, until the step holds as many real tokens as the uniform step
(``--samples-per-rank`` x ``--seq-len`` per rank).  It prints the padding fraction of one right-padded batch, of the
length-sorted padded micro-batches (``trainer.packing = false``) and of the packed ones, with the micro-batch count
of the busiest rank, then times the trainer step on the uniform samples, on the long-tailed ones packed and on them
padded, and reports real tokens/s and the ratio long-tailed packed / uniform (target >= 0.9).  The uniform step fills
its micro-batches exactly when the tokens per rank are a multiple of the budget (the default shapes); the long-tailed
one then needs one more, nearly empty, micro-batch wherever a rank's share exceeds that multiple, and with several
ranks that costs a pass over all FSDP units (measured on 2 x H200 at the 1.5B shape: ~0.26 s, the same as a uniform
step with one sample more).  ``--microbatch-tokens`` a little above the multiple compares at equal counts.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import SHAPES

PEAK_BF16_FLOPS = 989e12  # per H200, dense
PRESETS: dict[str, dict[str, Any]] = {k: SHAPES[k] for k in ("tiny", "qwen2.5-1.5b", "qwen2.5-7b")}
# The 7B shape's decoder layers, 8 of its 28: what fits beside AdamW's state on an 80 GB GPU, so that a GPU which
# cannot hold the whole 7B step still measures the step's speed at the 7B width.  Its embedding and LM head weigh
# more against its layers than the whole model's do, so its MFU is a lower estimate of the 7B model's.
PRESETS["qwen2.5-7b-8l"] = {**SHAPES["qwen2.5-7b"], "num_hidden_layers": 8}
DEFAULT_SHAPE = {
    "tiny": (4, 128, 32),
    "qwen2.5-1.5b": (8, 2048, 512),
    "qwen2.5-7b": (8, 2048, 512),
}  # samples per rank, seq len, prompt len
LONGTAIL_RESPONSES = {"tiny": (8, 512), "qwen2.5-1.5b": (32, 4096), "qwen2.5-7b": (32, 4096)}  # log-uniform
DEFAULT_SHAPE["qwen2.5-7b-8l"] = DEFAULT_SHAPE["qwen2.5-7b"]  # the 7B step's samples, at fewer layers
LONGTAIL_RESPONSES["qwen2.5-7b-8l"] = LONGTAIL_RESPONSES["qwen2.5-7b"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-1.5b")
    p.add_argument("--samples-per-rank", type=int, default=None, help="samples per rank (default by preset)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default by preset)")
    p.add_argument(
        "--prompt-len", type=int, default=None, help="prompt tokens per sample (default by preset)"
    )
    p.add_argument("--microbatch-tokens", type=int, default=16384, help="trainer.max_tokens_per_microbatch")
    p.add_argument("--no-activation-checkpointing", action="store_true")
    p.add_argument(
        "--cpu-offload", action="store_true", help="trainer.cpu_offload for every path (bare and trainer)"
    )
    p.add_argument(
        "--activation-offload",
        action="store_true",
        help="trainer.activation_offload for every path: checkpointed layers' inputs in host memory",
    )
    p.add_argument(
        "--ac-skip",
        type=int,
        default=0,
        metavar="K",
        help="trainer.activation_checkpointing_skip for every path: K decoder layers keep their activations",
    )
    p.add_argument(
        "--fsdp-prefetch",
        type=int,
        default=1,
        help="trainer.fsdp_prefetch for every path: decoder layers whose all-gathers run ahead (1 = FSDP2's own)",
    )
    p.add_argument(
        "--lora", type=int, default=0, help="model.lora.rank for the trainer path (the bare path stays full)"
    )
    p.add_argument(
        "--paths",
        default=None,
        help="comma-separated subset of the uniform paths to time: bare, bare-adam, trainer, trainer-recompute (the "
        "trainer with trainer.fused_head off: the LM head runs its chunks' logits again in backward), "
        "trainer-eager-head / trainer-compiled-head (trainer.compile_head false / true; the default config follows "
        "--kernels); default: bare, bare-adam, trainer",
    )
    p.add_argument("--param-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "eager", "compile"],
        help="trainer.kernels (trainer path)",
    )
    p.add_argument("--profile", action="store_true", help="print the per-phase table of each path")
    p.add_argument("--profile-steps", type=int, default=2, help="--profile: steps timed phase by phase")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each path")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each path (the mean is reported)")
    p.add_argument("--bare-adam", action="store_true", help="also time bare fwd+bwd + clip + AdamW")
    p.add_argument(
        "--lengths",
        choices=["uniform", "longtail"],
        default="uniform",
        help="uniform: every sample --seq-len tokens, trainer vs bare; longtail: log-uniform response lengths, "
        "packed vs padded vs the uniform step",
    )
    p.add_argument(
        "--response-min", type=int, default=None, help="longtail: shortest response (default by preset)"
    )
    p.add_argument(
        "--response-max", type=int, default=None, help="longtail: longest response (default by preset)"
    )
    p.add_argument(
        "--padded", action="store_true", help="uniform: time the trainer with trainer.packing = false"
    )
    p.add_argument(
        "--sequence-parallel",
        type=int,
        default=1,
        metavar="K",
        help="trainer.sequence_parallel of the packed trainer paths: each micro-batch split over K ranks (the "
        "bare path stays data-parallel); the tokens per rank stay --samples-per-rank x --seq-len",
    )
    args = p.parse_args(argv)
    n, seq, prompt = DEFAULT_SHAPE[args.preset]
    args.samples_per_rank = args.samples_per_rank or n
    args.seq_len = args.seq_len or seq
    args.prompt_len = args.prompt_len if args.prompt_len is not None else prompt
    lo, hi = LONGTAIL_RESPONSES[args.preset]
    args.response_min = args.response_min or lo
    args.response_max = args.response_max or hi
    if not 0 < args.prompt_len < args.seq_len:
        p.error("--prompt-len must be between 1 and --seq-len - 1")
    if not 0 < args.response_min <= args.response_max:
        p.error("--response-min must be between 1 and --response-max")
    if args.sequence_parallel < 1:
        p.error("--sequence-parallel must be at least 1")
    if args.sequence_parallel > 1 and args.padded:
        p.error("--sequence-parallel needs packed micro-batches (drop --padded)")
    return args


def max_len(args: argparse.Namespace) -> int:
    return max(args.seq_len, args.prompt_len + args.response_max)


def build_lm(preset: str, seq_len: int, device: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**{**PRESETS[preset], "max_position_embeddings": max(4096, seq_len)})
    torch.manual_seed(0)  # the same weights on every rank before sharding
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).float()


def _sample(rng: random.Random, i: int, prompt: int, resp: int, vocab: int) -> Any:
    """A synthetic sample in groups of 8, with plausible behaviour logprobs."""
    from trainer.data import Sample

    return Sample(
        sample_id=f"s{i}",
        group_id=f"g{i // 8}",
        prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
        response_ids=[rng.randrange(vocab) for _ in range(resp)],
        response_logprobs=[-rng.uniform(0.01, 3.0) for _ in range(resp)],
        reward=float(rng.random() < 0.5),
        policy_version=0,
    )


def make_samples(args: argparse.Namespace, world: int, vocab: int) -> list[Any]:
    """The same synthetic samples on every rank: full-length responses."""
    rng = random.Random(0)
    resp = args.seq_len - args.prompt_len
    return [_sample(rng, i, args.prompt_len, resp, vocab) for i in range(args.samples_per_rank * world)]


def make_longtail_samples(args: argparse.Namespace, world: int, vocab: int) -> list[Any]:
    """Log-uniform response lengths until exactly the uniform step's real token count (the last sample is cut to fit,
    its prompt too if need be); the same samples on every rank."""
    rng = random.Random(1)
    room = args.samples_per_rank * world * args.seq_len
    lo, hi = math.log(args.response_min), math.log(args.response_max + 1)
    out: list[Any] = []
    while room > 0:
        prompt = min(args.prompt_len, room - 1) if room > 1 else 1
        resp = min(int(math.exp(rng.uniform(lo, hi))), args.response_max, max(room - prompt, 0))
        out.append(_sample(rng, len(out), prompt, resp, vocab))
        room -= prompt + resp
    return out


def microbatch_shares(cfg: Any, samples: list[Any], world: int, packed: bool) -> tuple[float, int]:
    """(share of padding in the model's input, micro-batches of the busiest rank) as the trainer splits ``samples``.

    Every rank runs as many micro-batches as the busiest one, and each costs a pass over all FSDP units whatever
    it holds, so that count matters as much as the padding."""
    from trainer.batching import assign_to_ranks, microbatches

    seen, counts = 0, []
    for mine in assign_to_ranks(samples, world):
        mbs = microbatches(mine, cfg.trainer.max_tokens_per_microbatch, packed=packed)
        seen += sum(
            sum(s.length for s in mb) if packed else len(mb) * max(s.length for s in mb) for mb in mbs
        )
        counts.append(len(mbs))
    return 1 - sum(s.length for s in samples) / seen, max(counts)


def bare_batches(cfg: Any, samples: list[Any], device: Any) -> list[dict[str, Any]]:
    """This rank's micro-batches exactly as the padded trainer splits them, with labels on the response tokens."""
    from trainer import dist as tdist
    from trainer.batching import assign_to_ranks, collate, microbatches

    mine = assign_to_ranks(samples, tdist.world())[tdist.rank()]
    out = []
    for mb in microbatches(mine, cfg.trainer.max_tokens_per_microbatch, packed=False):
        b = collate(mb, pad_id=0)
        labels = b["input_ids"].masked_fill(b["response_mask"] == 0, -100)
        out.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"], "labels": labels})
    return [{k: v.to(device) for k, v in b.items()} for b in out]


class BareLM:  # built lazily: torch is imported inside main
    """The least a policy-gradient step computes: the decoder on every token, the LM head and a cross-entropy on the
    response tokens only.  The root FSDP unit, so its forward gathers the embedding and the head."""

    @staticmethod
    def build(lm: Any) -> Any:
        import torch.nn.functional as F
        from torch import nn

        from trainer.phases import phase

        class _Bare(nn.Module):
            def __init__(self, lm: Any):
                super().__init__()
                self.lm = lm

            def forward(self, input_ids: Any, attention_mask: Any, labels: Any) -> Any:
                with phase("decoder"):
                    h = self.lm.model(
                        input_ids=input_ids, attention_mask=attention_mask, use_cache=False
                    ).last_hidden_state
                with phase("head"):
                    target = labels[:, 1:]
                    keep = target != -100
                    logits = self.lm.lm_head(h[:, :-1][keep]).float()
                    return F.cross_entropy(logits, target[keep])

        return _Bare(lm)


def device_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync() -> None:
    """The device's queue done, and every rank in step."""
    from trainer import dist as tdist

    device_sync()
    tdist.barrier()


Phases = dict[str, float]  # mean seconds per step by phase path (trainer/phases.py), "step" the whole step


def timed(fn: Callable[[], Any], args: argparse.Namespace) -> tuple[float, Phases]:
    """Mean seconds per call over ``--steps`` calls after ``--warmup`` untimed ones, with all ranks in step; then,
    with ``--profile``, the mean per phase over ``--profile-steps`` more calls."""
    for _ in range(args.warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        fn()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    return step_s, (profiled(fn, args.profile_steps) if args.profile else {})


def profiled(fn: Callable[[], Any], steps: int) -> Phases:
    from trainer.phases import timing

    with timing(device_sync) as timer:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        device_sync()
        total = time.perf_counter() - t0
    out = {k: v / steps for k, v in timer.seconds.items()}
    out["step"] = total / steps
    return out


def reset_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> str:
    import torch

    if torch.cuda.is_available():
        return f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (process)"


def run_bare(args: argparse.Namespace, cfg: Any, samples: list[Any], adam: bool) -> tuple[float, Phases]:
    from trainer import dist as tdist
    from trainer.model import build_optimizer, clip_grad_norm_, decoder_layers, shard
    from trainer.phases import phase

    device = tdist.current_device()
    lm = build_lm(args.preset, max_len(args), device)
    bare = BareLM.build(lm)
    t = cfg.trainer
    shard(
        bare,
        decoder_layers(lm.model),
        device,
        param_dtype=t.param_dtype,
        activation_checkpointing=t.activation_checkpointing,
        activation_offload=t.activation_offload,
        checkpoint_skip=t.activation_checkpointing_skip,
        cpu_offload=t.cpu_offload,
        prefetch=t.fsdp_prefetch,
    )
    opt = build_optimizer(bare, lr=1e-6) if adam else None
    batches = bare_batches(cfg, samples, device)

    def step() -> None:
        for b in batches:
            with phase("forward"):
                loss = bare(**b)
            with phase("backward"):
                loss.backward()
        with phase("optimizer"):
            if opt is not None:
                clip_grad_norm_(bare.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                bare.zero_grad(set_to_none=True)

    return timed(step, args)  # the model goes with this frame, before the next path


def run_trainer(args: argparse.Namespace, cfg: Any, samples: list[Any]) -> tuple[float, Phases]:
    from trainer import dist as tdist
    from trainer.lora import maybe_lora
    from trainer.model import build_optimizer, build_scheduler, shard_actor
    from trainer.step import Models, train_step

    device, t = tdist.current_device(), cfg.trainer
    where = device if tdist.is_main() else "meta"  # the other ranks receive rank 0's weights (load_once)
    lm = maybe_lora(
        build_lm(args.preset, max_len(args), where), cfg.model.lora, t.param_dtype, device, "lora"
    )
    actor = shard_actor(
        lm,
        device,
        param_dtype=t.param_dtype,
        activation_checkpointing=t.activation_checkpointing,
        activation_offload=t.activation_offload,
        checkpoint_skip=t.activation_checkpointing_skip,
        cpu_offload=t.cpu_offload,
        kernels=t.kernels,
        prefetch=t.fsdp_prefetch,
    )
    opt = build_optimizer(actor, lr=1e-6, betas=t.betas, weight_decay=t.weight_decay)
    sched = build_scheduler(opt, warmup_steps=0, schedule="constant", total_steps=1)
    models = Models(actor, opt, sched)
    return timed(lambda: train_step(cfg, models, samples, pad_id=0), args)


def step_flops(preset: str, samples: list[Any]) -> tuple[float, float]:
    """(model FLOPs, attention FLOPs) of one forward + backward over ``samples`` (all ranks): see the docstring."""
    shape = PRESETS[preset]
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = hidden * (hidden + 2 * kv) + (hidden + 2 * kv) + hidden * hidden  # q, k, v (+ biases), o
    per_layer += 3 * hidden * shape["intermediate_size"]  # gate, up, down
    tokens = sum(s.length for s in samples)
    responses = sum(len(s.response_ids) for s in samples)
    model = 6 * layers * per_layer * tokens + 6 * hidden * shape["vocab_size"] * responses
    attention = 6 * layers * hidden * sum(s.length**2 for s in samples)
    return float(model), float(attention)


def report(name: str, step_s: float, samples: list[Any], preset: str, world: int, on_gpu: bool) -> float:
    tokens = sum(s.length for s in samples)
    tok_s = tokens / step_s
    model, attention = step_flops(preset, samples)
    peak = step_s * world * PEAK_BF16_FLOPS
    mfu = (
        f"MFU {100 * model / peak:5.1f}% (+attention {100 * (model + attention) / peak:5.1f}%)"
        if on_gpu
        else "MFU n/a (CPU)"
    )
    print(f"{name:26s} {step_s:8.3f} s/step  {tok_s / 1e3:9.2f}k tok/s  {mfu}  {peak_memory()}", flush=True)
    return tok_s


PHASE_ORDER = (
    *("batches", "prepare/decoder", "prepare/head", "prepare"),
    *("forward/decoder", "forward/head", "forward", "backward", "optimizer", "metrics"),
)
PHASE_NAMES = {
    "batches": "advantages, micro-batch plan",
    "prepare/decoder": "reference/proximal pass: decoder",
    "prepare/head": "reference/proximal pass: head",
    "prepare": "prepare: the rest",
    "forward/decoder": "forward: decoder",
    "forward/head": "forward: LM head, logprobs",
    "forward": "forward: the rest (losses)",
    "backward": "backward (with recompute)",
    "optimizer": "clip + optimizer",
    "metrics": "metrics: reduced, read back",
}


def print_phases(phases: dict[str, Phases]) -> None:
    """Milliseconds per step by phase, one column per path, and the share of the step."""
    names = [n for n, p in phases.items() if p]
    keys = [k for k in PHASE_ORDER if any(k in phases[n] for n in names)]
    keys += sorted({k for n in names for k in phases[n]} - {*keys, "step"})
    print(f"{'phase (ms per step, synchronised)':36s}" + "".join(f"{n:>28s}" for n in names), flush=True)
    rows = [(PHASE_NAMES.get(k, k), [phases[n].get(k, 0.0) for n in names]) for k in keys]
    rows.append(("other", [phases[n]["step"] - sum(phases[n].get(k, 0.0) for k in keys) for n in names]))
    rows.append(("step", [phases[n]["step"] for n in names]))
    for label, values in rows:
        cells = "".join(
            f"{1e3 * v:>18.1f} ({100 * v / phases[n]['step']:5.1f}%)"
            for n, v in zip(names, values, strict=True)
        )
        print(f"{label:36s}{cells}", flush=True)


def make_config(
    args: argparse.Namespace, packing: bool, fused_head: bool = True, compile_head: bool | None = None
) -> Any:
    from buffer.config import ShardRLConfig

    trainer = {
        "max_tokens_per_microbatch": args.microbatch_tokens,
        "activation_checkpointing": not args.no_activation_checkpointing,
        "activation_offload": args.activation_offload,
        "activation_checkpointing_skip": args.ac_skip,
        "param_dtype": args.param_dtype,
        "packing": packing,
        "cpu_offload": args.cpu_offload,
        "fsdp_prefetch": args.fsdp_prefetch,
        "kernels": args.kernels,
        "fused_head": fused_head,
        "compile_head": compile_head,
        # sequence parallelism splits packed rows; the padded comparison path stays data-parallel
        "sequence_parallel": args.sequence_parallel if packing else 1,
    }
    model = {"lora": {"rank": args.lora}}
    return ShardRLConfig.model_validate(
        {"reward": {"function": "max_digit"}, "trainer": trainer, "model": model}
    )


Timed = tuple[str, list[Any], Callable[[], tuple[float, Phases]]]


def uniform_paths(args: argparse.Namespace, vocab: int, world: int) -> list[Timed]:
    cfg = make_config(args, packing=not args.padded)
    samples = make_samples(args, world, vocab)
    wanted = set((args.paths or "bare,bare-adam,trainer").split(","))
    paths: list[Timed] = []
    if "bare" in wanted:
        paths.append(("bare fwd+bwd", samples, lambda: run_bare(args, cfg, samples, False)))
    if args.bare_adam and "bare-adam" in wanted:
        paths.append(("bare fwd+bwd+adam", samples, lambda: run_bare(args, cfg, samples, True)))
    if "trainer" in wanted:
        paths.append(("trainer step", samples, lambda: run_trainer(args, cfg, samples)))
    if "trainer-recompute" in wanted:
        recompute = make_config(args, packing=not args.padded, fused_head=False)
        paths.append(("trainer, recomputing head", samples, lambda: run_trainer(args, recompute, samples)))
    for way, setting in (("eager", False), ("compiled", True)):
        if f"trainer-{way}-head" in wanted:
            head = make_config(args, packing=not args.padded, compile_head=setting)
            paths.append((f"trainer, {way} head", samples, lambda c=head: run_trainer(args, c, samples)))
    return paths


def longtail_paths(args: argparse.Namespace, vocab: int, world: int) -> list[Timed]:
    packed, padded = make_config(args, packing=True), make_config(args, packing=False)
    uniform, longtail = make_samples(args, world, vocab), make_longtail_samples(args, world, vocab)
    from trainer import dist as tdist

    if tdist.is_main():
        lengths = sorted(s.length for s in longtail)
        print(
            f"longtail: {len(longtail)} samples, responses log-uniform {args.response_min}..{args.response_max}, "
            f"lengths min {lengths[0]} median {lengths[len(lengths) // 2]} max {lengths[-1]}; "
            f"uniform: {len(uniform)} x {args.seq_len}",
            flush=True,
        )
        one_batch = 1 - sum(s.length for s in longtail) / (len(longtail) * max(s.length for s in longtail))
        print(f"longtail padding fraction: one right-padded batch {100 * one_batch:.1f}%", flush=True)
        for name, cfg, samples in (
            ("padded", padded, longtail),
            ("packed", packed, longtail),
            ("uniform", packed, uniform),
        ):
            frac, n = microbatch_shares(cfg, samples, world, cfg.trainer.packing)
            print(f"{name:8s} micro-batches: padding {100 * frac:5.1f}%, {n} on the busiest rank", flush=True)
    return [
        ("trainer step, uniform", uniform, lambda: run_trainer(args, packed, uniform)),
        ("trainer step, longtail packed", longtail, lambda: run_trainer(args, packed, longtail)),
        ("trainer step, longtail padded", longtail, lambda: run_trainer(args, padded, longtail)),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from trainer import dist as tdist
    from trainer.model import resolve_param_dtype

    device = tdist.init()
    world, on_gpu = tdist.world(), device.type == "cuda"
    vocab = PRESETS[args.preset]["vocab_size"]
    params = sum(p.numel() for p in build_lm(args.preset, args.seq_len, "meta").parameters())
    if tdist.is_main():
        dtype = resolve_param_dtype(args.param_dtype, device)
        print(
            f"preset {args.preset}: {params / 1e6:.1f}M params, {world} rank(s) on {device.type}, compute {dtype}, "
            f"activation checkpointing {'off' if args.no_activation_checkpointing else 'on'}"
            f"{' (inputs in host memory)' if args.activation_offload else ''}"
            f"{f', {args.ac_skip} layer(s) not checkpointed' if args.ac_skip else ''}, "
            f"cpu offload {'on' if args.cpu_offload else 'off'}, FSDP prefetch {args.fsdp_prefetch} layer(s), "
            f"trainer LoRA rank {args.lora}, "
            f"sequence parallel {args.sequence_parallel}; "
            f"{args.samples_per_rank} x {args.seq_len} real tokens per rank ({args.prompt_len} prompt), "
            f"micro-batches of <= {args.microbatch_tokens} tokens; mean of {args.steps} steps after {args.warmup}",
            flush=True,
        )
    paths = (longtail_paths if args.lengths == "longtail" else uniform_paths)(args, vocab, world)
    results, phases = {}, {}
    for name, samples, fn in paths:
        reset_memory()
        step_s, phases[name] = fn()
        if tdist.is_main():
            results[name] = report(name, step_s, samples, args.preset, world, on_gpu)
        torch.manual_seed(0)
    if args.profile and tdist.is_main():
        print_phases(phases)
    if tdist.is_main():
        if args.lengths == "longtail":
            ratio = results["trainer step, longtail packed"] / results["trainer step, uniform"]
            gain = results["trainer step, longtail packed"] / results["trainer step, longtail padded"]
            print(f"longtail packed / uniform real tokens/s {ratio:.3f} (target >= 0.9)", flush=True)
            print(f"longtail packed / longtail padded real tokens/s {gain:.2f}x", flush=True)
        elif "bare fwd+bwd" in results:
            for name in [n for n in results if n.startswith("trainer")]:  # every trainer path that ran
                ratio = results[name] / results["bare fwd+bwd"]
                print(f"{name} / bare tokens/s ratio {ratio:.3f} (target >= 1.0)", flush=True)
    tdist.teardown()


if __name__ == "__main__":
    main()
