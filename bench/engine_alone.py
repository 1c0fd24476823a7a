"""The streaming engine by itself: the output tokens/s a rollout worker's engine can reach, the limit
``bench/e2e.py --engine-alone`` judges the workers against.

    python bench/engine_alone.py --model PATH --engine vllm --samples 1024 --in-flight 128 \\
        --lengths loguniform --min-response-length 16 --max-response-length 1024

The demo task's prompts (encoded as the workers encode them, without a chat template), ``--in-flight`` requests
kept in the engine at all times, each with its own length when ``--lengths loguniform`` (EOS ignored, as the
workers do then).  The first ``--in-flight`` samples are the warm-up and are not timed.  Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_worker.engines import SamplingSpec, make_streaming_engine
from rollout_worker.streaming import LengthDraw
from rollout_worker.tasks import task_prompts


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--in-flight", type=int, default=128)
    p.add_argument("--lengths", default="natural", choices=["natural", "loguniform"])
    p.add_argument("--min-response-length", type=int, default=16)
    p.add_argument("--max-response-length", type=int, default=1024)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--vllm-options",
        default='{"cpu_kvcache_space_gib": 2}',
        help="vLLM engine options as JSON (rollout.vllm's keys): bench/e2e.py passes the workers' own",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="hf streaming engine: profile this many decode-loop steps from step 200 (top operators on stderr)",
    )
    p.add_argument(
        "--batch",
        action="store_true",
        help="the batch engine instead: generate() calls of --in-flight samples, each with its own length",
    )
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="vLLM: keep the engine's tokenizer (what a run with stop strings builds); default: none, as without",
    )
    args = p.parse_args()
    import torch
    from transformers import AutoTokenizer

    from buffer.config import resolve_dtype

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = [tok(q.prompt)["input_ids"] for q in task_prompts("max_digit")]
    longest = max(len(x) for x in prompts)
    if args.batch:
        return batch_alone(args, prompts, longest)
    engine = make_streaming_engine(
        args.engine,
        Path(args.model),
        dtype=resolve_dtype(args.dtype, cuda=torch.cuda.is_available()),
        max_model_len=args.max_model_len or longest + args.max_response_length + 8,
        vllm_options=json.loads(args.vllm_options),
        max_batch_size=args.in_flight,
        detokenize=args.detokenize,
    )
    if args.profile_steps:
        profile_steps(engine, 200, args.profile_steps)
    draw = LengthDraw(args.min_response_length, args.max_response_length, random.Random(0))
    rng = random.Random(1)

    def spec() -> SamplingSpec:
        if args.lengths == "loguniform":
            return SamplingSpec(temperature=1.0, max_tokens=draw(), ignore_eos=True, seed=rng.getrandbits(31))
        return SamplingSpec(temperature=1.0, max_tokens=args.max_response_length, seed=rng.getrandbits(31))

    submitted = done = 0
    tokens, t0, cpu0 = 0, None, 0.0
    while done < args.samples:
        while submitted < args.samples and submitted - done < args.in_flight:
            engine.submit(str(submitted), prompts[submitted % len(prompts)], spec())
            submitted += 1
        for _, c in engine.finished(0.05):
            done += 1
            if t0 is not None:
                tokens += len(c.response_ids)
            elif done >= args.in_flight:
                t0, cpu0 = time.perf_counter(), time.process_time()
    seconds = time.perf_counter() - (t0 or time.perf_counter())
    cpu = time.process_time() - cpu0
    timings = getattr(engine, "timings", None)
    engine.close()
    out = {
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "samples": args.samples,
        "in_flight": args.in_flight,
        "engine": f"{args.engine} streaming",
        "detokenize": args.detokenize,
        # this process's CPU time per output token (vLLM's engine core runs in a process of its own): the
        # front end's cost, which caps tokens/s at 1e6 / this on one core whatever the accelerator
        "frontend_cpu_us_per_token": round(1e6 * cpu / tokens, 2) if tokens else None,
    }
    if timings is not None and timings.on:
        out["timings"] = timings.report()
    print(json.dumps(out))
    return 0


def profile_steps(engine: Any, first: int, count: int) -> None:
    """Wrap the streaming engine's loop step so that steps ``first`` .. ``first + count`` run under the profiler
    (it records the thread it is entered on: the engine's)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    inner, seen = engine._step, [0]

    def step(joining: Any) -> None:
        seen[0] += 1
        if seen[0] == first:
            prof.__enter__()
        inner(joining)
        if seen[0] == first + count:
            if cuda:
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            for key in (["self_cuda_time_total"] if cuda else []) + ["cpu_time_total", "self_cpu_time_total"]:
                print(f"--- {count} steps, top operators by {key}", file=sys.stderr)
                print(prof.key_averages().table(sort_by=key, row_limit=14), file=sys.stderr)

    engine._step = step


def batch_alone(args: argparse.Namespace, prompts: list[list[int]], longest: int) -> int:
    """The batch engine on the same prompts and lengths: calls of ``--in-flight`` samples; the first is warm-up."""
    import torch

    from buffer.config import resolve_dtype
    from rollout_worker.engines import make_engine

    engine = make_engine(
        args.engine,
        Path(args.model),
        dtype=resolve_dtype(args.dtype, cuda=torch.cuda.is_available()),
        max_model_len=args.max_model_len or longest + args.max_response_length + 8,
        vllm_options=json.loads(args.vllm_options),
        detokenize=args.detokenize,
    )
    draw = LengthDraw(args.min_response_length, args.max_response_length, random.Random(0))
    tokens, seconds, done, call, cpu = 0, 0.0, 0, 0, 0.0
    while done < args.samples:
        batch = [prompts[(done + i) % len(prompts)] for i in range(args.in_flight)]
        spec = SamplingSpec(temperature=1.0, max_tokens=args.max_response_length, seed=call)
        if args.lengths == "loguniform":
            each = [draw() for _ in batch]
            spec = SamplingSpec(
                temperature=1.0, max_tokens=max(each), seed=call, ignore_eos=True, max_tokens_each=each
            )
        start, cpu0 = time.perf_counter(), time.process_time()
        out = engine.generate(batch, spec)
        if call > 0:
            seconds += time.perf_counter() - start
            cpu += time.process_time() - cpu0
            tokens += sum(len(c.response_ids) for g in out for c in g)
        done += len(batch)
        call += 1
    engine.close()
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "samples": args.samples,
                "batch": args.in_flight,
                "engine": f"{args.engine} batch",
                "frontend_cpu_us_per_token": round(1e6 * cpu / tokens, 2) if tokens else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
