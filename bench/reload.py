"""Benchmark of the rollout worker's hot weight reload against a cold engine start and a raw read of the same bytes.

    python bench/reload.py                          # the tiny model, untied and tied
    python bench/reload.py --preset qwen2-0.5b      # plus a random model with Qwen2-0.5B's shapes (~1 GB in bf16)
    python bench/reload.py --lora 8 --engine hf     # also adapter versions of rank 8, on the transformers engine

For each model, in one process and one run directory: build the model (random weights, the tiny tokenizer), create a
run, publish a copy of its weights as version 1 and 2 the way the trainer does (staging, manifest, LATEST), then time

- cold:   ``make_engine("vllm", ...)`` (what a worker pays at start or after a crash, plus the one-time
          ``import vllm``, timed separately), and its first generate();
- reload: ``verify_version`` + ``engine.load_weights`` (vLLM's in-place reload + prefix-cache reset), best of N;
- raw:    reading the published safetensors files from the filesystem (the page cache cannot be dropped here, so
          this is the in-memory copy cost the reload cannot go below).

Prints the times and the ratios reload/cold (target <= 0.1) and reload/raw.

``--engine`` picks the engine (default vllm where it is installed, else hf: the GPU machines have no vLLM).
``--lora RANK`` also publishes two random peft adapters of that rank for each model (versions 3 and 4, kind adapter)
and times a second engine started with ``lora_rank``: its cold start and the adapter reload (vLLM: a new
``LoRARequest`` registered with ``add_lora``; hf: peft's ``load_adapter``), printed next to the full reload with the
ratio adapter/full.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import SHAPES

PRESETS = {
    "qwen2-0.1b": SHAPES["qwen2-0.1b"],
    "qwen2-0.5b": SHAPES["qwen2.5-0.5b"],
    "qwen2.5-1.5b": SHAPES["qwen2.5-1.5b"],
    "qwen2.5-7b": SHAPES["qwen2.5-7b"],
}


def build_model(out: Path, preset: str, dtype: str) -> Path:
    """The tiny model, or a random model with a preset's shapes next to the tiny tokenizer."""
    from shardrl.tiny_model import build_tiny_model

    if preset in ("tiny", "tiny-tied"):
        return build_tiny_model(out, tied=preset == "tiny-tied")
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tiny = build_tiny_model(out.parent / f"{out.name}-tokenizer")
    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = Qwen2Config(
        **{**PRESETS[preset], "max_position_embeddings": 4096},
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def publish_copy(run, model_dir: Path, version: int, dtype: str) -> None:  # type: ignore[no-untyped-def]
    from buffer import weights

    staging = weights.staging_dir(run.layout, version)
    for f in model_dir.glob("*.safetensors"):
        shutil.copy(f, staging / f.name)
    shutil.copy(model_dir / "config.json", staging / "config.json")
    weights.commit_version(run.layout, version, staging, step=version, dtype=dtype)


def publish_adapter(run, model_dir: Path, version: int, dtype: str, rank: int) -> float:  # type: ignore[no-untyped-def]
    """A random peft adapter of ``rank`` for ``model_dir``, published as ``version`` (kind adapter); its MiB."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from buffer import weights
    from buffer.config import LORA_TARGETS

    torch.manual_seed(version)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    staging = weights.staging_dir(run.layout, version)
    peft.save_pretrained(staging)
    weights.commit_version(
        run.layout,
        version,
        staging,
        step=version,
        dtype=dtype,
        kind="adapter",
        adapter=".",
        base_model=str(model_dir),
        base_sha256=weights.base_model_hash(model_dir),
    )
    return (run.layout.weight_version(version) / "adapter_model.safetensors").stat().st_size / 2**20


def raw_read_s(files: list[Path]) -> float:
    start = time.perf_counter()
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - start


def time_engine(  # type: ignore[no-untyped-def]
    kind: str, model_dir: Path, dtype: str, run, versions: tuple[int, int], repeat: int, lora_rank: int = 0
) -> dict[str, float]:
    """Cold start, first generate and the best/median reload alternating between ``versions``."""
    from buffer.weights import verify_version
    from rollout_worker.engines import SamplingSpec, make_engine

    start = time.perf_counter()
    engine = make_engine(
        kind,
        model_dir,
        dtype=dtype,
        seed=0,
        max_model_len=256,
        vllm_options={"cpu_kvcache_space_gib": 1},
        lora_rank=lora_rank,
    )
    cold = time.perf_counter() - start
    spec = SamplingSpec(max_tokens=8, n=2, seed=0)
    prompt = [[5, 6, 7, 8, 9]]
    start = time.perf_counter()
    engine.generate(prompt, spec)
    first_generate = time.perf_counter() - start
    reloads = []
    for i in range(repeat):
        start = time.perf_counter()
        wv = verify_version(run.layout, versions[i % 2])
        engine.load_weights(wv.path)
        reloads.append(time.perf_counter() - start)
        engine.generate(prompt, spec)  # the engine still works after each reload
    engine.close()
    return {
        "cold_s": cold,
        "first_generate_s": first_generate,
        "reload_s": min(reloads),
        "reload_median_s": statistics.median(reloads),
    }


def bench_one(root: Path, preset: str, dtype: str, repeat: int, kind: str, lora: int) -> dict[str, float]:
    from buffer.config import ShardRLConfig
    from shardrl.runs import init_run

    model_dir = build_model(root / preset, preset, dtype)
    run = init_run(
        root / f"run-{preset}",
        ShardRLConfig.model_validate(
            {"model": {"path": str(model_dir), "dtype": dtype}, "reward": {"function": "max_digit"}}
        ),
    )
    for v in (1, 2):
        publish_copy(run, model_dir, v, dtype)
    files = sorted(run.layout.weight_version(1).glob("*.safetensors"))
    size_mb = sum(f.stat().st_size for f in files) / 2**20
    out = {"size_mb": size_mb, **time_engine(kind, model_dir, dtype, run, (1, 2), repeat)}
    out["raw_read_s"] = min(raw_read_s(files) for _ in range(repeat))
    if lora:
        out["adapter_mb"] = publish_adapter(run, model_dir, 3, dtype, lora)
        publish_adapter(run, model_dir, 4, dtype, lora)
        timed = time_engine(kind, model_dir, dtype, run, (3, 4), repeat, lora_rank=lora)
        out.update({f"lora_{k}": v for k, v in timed.items()})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", action="append", default=[], choices=sorted(PRESETS), help="add a bigger model"
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="dtype of bigger models"
    )
    p.add_argument(
        "--repeat", type=int, default=5, help="reloads (and raw reads) timed; the best is reported"
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="where to build models and runs (default: a temp dir)"
    )
    p.add_argument(
        "--engine", choices=["vllm", "hf"], default=None, help="default: vllm where installed, else hf"
    )
    p.add_argument(
        "--lora", type=int, default=0, metavar="RANK", help="also time adapter versions of this rank"
    )
    args = p.parse_args(argv)
    from rollout_worker.engines import resolve_kind

    kind = resolve_kind(args.engine or "auto")
    root = args.dir or Path(tempfile.mkdtemp(prefix="shardrl-reload-"))
    start = time.perf_counter()
    if kind == "vllm":
        import vllm  # noqa: F401  (once, outside the timings: every cold start below pays engine start only)

    import_s = time.perf_counter() - start
    rows = [(p, bench_one(root, p, "float32", args.repeat, kind, args.lora)) for p in ("tiny", "tiny-tied")]
    rows += [(p, bench_one(root, p, args.dtype, args.repeat, kind, args.lora)) for p in args.preset]
    print(f"\nengine: {kind}")
    print(
        f"\n{'model':<12} {'MiB':>8} {'cold s':>8} {'1st gen s':>9} {'reload s':>9} {'(median)':>9} {'raw read s':>10}"
        f" {'reload/cold':>11} {'reload/raw':>10}"
    )
    for name, r in rows:
        print(
            f"{name:<12} {r['size_mb']:>8.1f} {r['cold_s']:>8.2f} {r['first_generate_s']:>9.2f} {r['reload_s']:>9.3f}"
            f" {r['reload_median_s']:>9.3f} {r['raw_read_s']:>10.3f} {r['reload_s'] / r['cold_s']:>11.4f}"
            f" {r['reload_s'] / max(r['raw_read_s'], 1e-9):>10.1f}"
        )
    if args.lora:
        print(
            f"\nLoRA rank {args.lora}: {'model':<12} {'adapter MiB':>11} {'cold s':>8} {'reload s':>9} "
            f"{'(median)':>9} {'full reload s':>13} {'adapter/full':>12}"
        )
        for name, r in rows:
            print(
                f"{'':<14}{name:<12} {r['adapter_mb']:>11.2f} {r['lora_cold_s']:>8.2f} {r['lora_reload_s']:>9.3f}"
                f" {r['lora_reload_median_s']:>9.3f} {r['reload_s']:>13.3f}"
                f" {r['lora_reload_s'] / max(r['reload_s'], 1e-9):>12.3f}"
            )
    if kind == "vllm":
        print(f"(a worker's cold start also pays `import vllm` once: {import_s:.1f}s here)")
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
