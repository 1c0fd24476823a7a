"""Benchmark of trainer.publish: the parallel publish against the naive rank-0 path and the raw disk.

    python -m torch.distributed.run --nproc_per_node=N bench/publish.py --preset qwen2.5-1.5b
    python bench/publish.py --preset tiny            # one process, a smoke check on CPU

Builds a randomly initialised Qwen2 with a published model's shapes on the current device (GPU when there is one,
else CPU), shards it with FSDP2 like the trainer does, and times, in the same run and directory:

- raw:     every rank writes its share of the publish's byte count into a file of its own with fsync, all at once:
           the same writers and bytes as the publish (one file per rank), so what the disk alone costs in parallel;
- publish: ``publish_weights`` (cast before the exchange, byte-balanced owners, one file per rank, index/manifest);
- naive:   ``get_model_state_dict(full_state_dict, cpu_offload)`` to rank 0, cast, one safetensors file, fsync.

Prints each time (best of ``--repeat``) and the ratios publish/raw and naive/raw, and checks that the two paths
wrote the same tensors.

``--lora RANK`` puts LoRA adapters of that rank on the model (the trainer's ``trainer.lora.apply_lora``: base frozen
in the compute dtype) and times, next to raw, the two versions a LoRA run publishes:

- adapter: ``publish_weights(lora=...)``, the adapter gathered to rank 0 and written in peft's format;
- full:    ``publish_weights(lora=..., merged=True)``, base + B @ A merged per shard and written by all ranks (plus
           the adapter), what every ``model.lora.merge_every`` versions and the end of a run cost;

and prints full/adapter and the sizes.

``--delta`` times delta versions (``trainer.publish_full_every`` > 1) against full ones, in the same run: it publishes
a full base version (kept as the base, as the trainer does), then for each repetition takes one real AdamW step at
``--lr`` (default 1e-6) on a random batch (fp32 master weights, published as ``--dtype``, bf16 by default, like the
trainer) and publishes the same weights twice, in full and as a delta against the base.  For each it prints the
bytes of the version's weight files, the publish time and the node reload time (``buffer.localcache.NodeCache``: copy
from the run directory, verify, and for the delta rebuild the full files against the base, which a following node
already holds; the engine's load of the rebuilt local files that follows is the same for both), each as a ratio
delta/full.  Every rebuilt delta is checked to be byte-identical to its full twin.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import SHAPES

PRESETS = {k: SHAPES[k] for k in ("tiny", "qwen2-0.1b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dir", type=Path, default=Path("/tmp/shardrl-bench-publish"), help="scratch directory")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="--delta: the node caches' directory (default: under --dir); another disk, as a node's local disk is, "
        "when --dir has no room for a 7B run's versions and its caches' copies",
    )
    p.add_argument("--repeat", type=int, default=2, help="timed repetitions of each path (best is reported)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--bucket-mib", type=int, default=512, help="publish exchange bucket size")
    p.add_argument("--lora", type=int, default=0, metavar="RANK", help="time adapter publishes of this rank")
    p.add_argument("--delta", action="store_true", help="time delta versions against full ones")
    p.add_argument("--lr", type=float, default=1e-6, help="--delta: learning rate of the optimizer step")
    p.add_argument(
        "--optimizer",
        choices=["adamw", "sign"],
        default="adamw",
        help="--delta: the step: AdamW (16 bytes of state per parameter in all), or sign, which moves each weight "
        "by lr x sign(grad): AdamW's own first step, with no state (a 7B step on one GPU)",
    )
    return p.parse_args(argv)


def raw_write(path: Path, nbytes: int, block: int = 64 << 20) -> None:
    buf = memoryview(bytearray(min(block, max(nbytes, 1))))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_shares(raw_file: Path, nbytes: int) -> None:
    """This rank's share of ``nbytes`` (the rest of an uneven split goes to rank 0), in a file of its own."""
    from trainer import dist as tdist

    me, world = tdist.rank(), tdist.world()
    share = nbytes // world + (nbytes % world if me == 0 else 0)
    raw_write(raw_file.with_name(f"{raw_file.name}.{me}"), share)


def naive_publish(actor, path: Path, dtype, tied: bool) -> None:
    """All weights gathered in fp32 to rank 0's CPU, cast, written as one file there."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainer import dist as tdist
    from trainer.publish import hf_name

    sd = get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if tdist.is_main():
        out = {}
        for k, v in sd.items():
            name = hf_name(k.removeprefix("lm."))
            if not (tied and name == "lm_head.weight"):
                out[name] = v.to(dtype) if v.is_floating_point() else v
        save_file(out, str(path), metadata={"format": "pt"})
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        del out
    del sd
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(fn) -> float:
    from trainer import dist as tdist

    tdist.barrier()
    t0 = time.perf_counter()
    fn()
    tdist.barrier()
    return time.perf_counter() - t0


def same_tensors(published: Path, naive: Path) -> bool:
    from safetensors.torch import load_file

    a: dict = {}
    for f in sorted(published.glob("model-*.safetensors")):
        a.update(load_file(str(f)))
    b = load_file(str(naive))
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from buffer.layout import RunLayout
    from buffer.weights import garbage_collect
    from trainer import dist as tdist
    from trainer.model import shard_actor
    from trainer.publish import PUBLISH_DTYPES, publish_weights

    device = tdist.init()
    me, world = tdist.rank(), tdist.world()
    cfg = Qwen2Config(**{**PRESETS[args.preset], "max_position_embeddings": 4096})
    tied = bool(cfg.tie_word_embeddings)
    scratch = args.dir / args.preset
    layout, src, naive_file, raw_file = (
        RunLayout.of(scratch / "run"),
        scratch / "src",
        scratch / "naive.safetensors",
        scratch / "raw.bin",
    )
    if me == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        layout.create()
        cfg.save_pretrained(src)
    tdist.barrier()

    t0 = time.perf_counter()
    torch.manual_seed(0)  # the same weights on every rank before sharding
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(cfg).float()
    lora = None
    if args.lora:
        from buffer.config import LoraConfig
        from trainer.lora import maybe_lora

        lora = LoraConfig(rank=args.lora)
        maybe_lora(lm, lora, "auto", device, "--lora")
    actor = shard_actor(lm, device)
    n_params = sum(p.numel() for p in actor.parameters())
    dtype = PUBLISH_DTYPES[args.dtype]
    nbytes = (
        sum(p.numel() for p in actor.parameters() if not p.requires_grad or lora is None) * dtype.itemsize
    )
    if me == 0:
        print(
            f"preset {args.preset}: {n_params / 1e6:.1f}M params, {nbytes / 2**30:.2f} GiB as {args.dtype}, "
            f"{world} rank(s) on {device.type}, built in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )

    def publish(v: int) -> None:
        publish_weights(
            actor,
            layout,
            v,
            v,
            dtype=args.dtype,
            tied=tied,
            src_model_dir=src,
            bucket_bytes=args.bucket_mib << 20,
        )

    if lora is not None:
        lora_bench(actor, layout, args, lora, tied, src, raw_file, nbytes)
        return
    if args.delta:
        delta_bench(actor, layout, args, tied, src, cfg.vocab_size)
        return
    publish(1)  # warm-up: communicators, pinned buffers, code paths
    times: dict[str, list[float]] = {"raw": [], "publish": [], "naive": []}
    for r in range(args.repeat):
        times["raw"].append(timed(lambda: raw_shares(raw_file, nbytes)))
        times["publish"].append(timed(lambda r=r: publish(r + 2)))
        times["naive"].append(timed(lambda: naive_publish(actor, naive_file, dtype, tied)))
        if me == 0:
            garbage_collect(layout, keep=1, in_use=[])
    if me == 0:
        latest = layout.weight_version(args.repeat + 1)
        ok = same_tensors(latest, naive_file)
        best = {k: min(v) for k, v in times.items()}
        gib = nbytes / 2**30
        for k in ("raw", "publish", "naive"):
            runs = " ".join(f"{t:.3f}" for t in times[k])
            print(f"{k:8s} {best[k]:7.3f}s  {gib / best[k]:6.2f} GiB/s   runs: {runs}")
        print(
            f"publish/raw {best['publish'] / best['raw']:.2f}   naive/raw {best['naive'] / best['raw']:.2f}   "
            f"naive/publish {best['naive'] / best['publish']:.2f}   same tensors: {ok}",
            flush=True,
        )
        shutil.rmtree(scratch, ignore_errors=True)
    tdist.teardown()


def lora_bench(actor, layout, args, lora, tied: bool, src: Path, raw_file: Path, nbytes: int) -> None:  # type: ignore[no-untyped-def]
    """Adapter and merged full publishes of the same LoRA model, best of ``--repeat`` each, next to raw."""
    from buffer.weights import garbage_collect
    from trainer import dist as tdist
    from trainer.publish import publish_weights

    me = tdist.rank()
    adapter_bytes = sum(p.numel() for p in actor.parameters() if p.requires_grad) * (
        2 if args.dtype != "float32" else 4
    )

    def publish(v: int, merged: bool) -> None:
        publish_weights(
            actor,
            layout,
            v,
            v,
            dtype=args.dtype,
            tied=tied,
            src_model_dir=src,
            bucket_bytes=args.bucket_mib << 20,
            lora=lora,
            merged=merged,
        )

    publish(1, False)  # warm-up of both paths
    publish(2, True)
    v = 3
    times: dict[str, list[float]] = {"raw": [], "adapter": [], "full": []}
    for _ in range(args.repeat):
        times["raw"].append(timed(lambda: raw_shares(raw_file, nbytes)))
        times["adapter"].append(timed(lambda v=v: publish(v, False)))
        times["full"].append(timed(lambda v=v: publish(v + 1, True)))
        v += 2
        if me == 0:
            garbage_collect(layout, keep=2, in_use=[])
    if me == 0:
        best = {k: min(t) for k, t in times.items()}
        sizes = {"raw": nbytes, "adapter": adapter_bytes, "full": nbytes + adapter_bytes}
        for k in ("raw", "adapter", "full"):
            runs = " ".join(f"{t:.3f}" for t in times[k])
            print(f"{k:8s} {best[k]:7.3f}s  {sizes[k] / 2**20:10.1f} MiB   runs: {runs}")
        print(
            f"lora rank {args.lora}: full/adapter {best['full'] / best['adapter']:.1f}   "
            f"adapter/raw {best['adapter'] / best['raw']:.3f}   bytes full/adapter {sizes['full'] / sizes['adapter']:.0f}",
            flush=True,
        )
        shutil.rmtree(args.dir / args.preset, ignore_errors=True)
    tdist.teardown()


def _step(actor, vocab: int, lr: float, seed: int, optimizer: str) -> None:  # type: ignore[no-untyped-def]
    """One optimizer step on a random batch (every rank the same tokens): Adam moves every weight by about ``lr``.

    ``sign`` is that step without Adam's state: at its first step Adam's update is m / sqrt(v) = g / |g| (bias
    corrected, eps aside), so lr x sign(g) changes the weights as AdamW's first step does, and later steps by the
    same ``lr`` per weight (Adam's by at most about ``lr``)."""
    import torch

    from trainer import dist as tdist
    from trainer.optim import build_optimizer

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, 32), generator=g).to(tdist.current_device())
    out = actor(ids)  # the actor's (logprobs, entropy) of each token
    out[0].float().mean().backward()
    if optimizer == "adamw":
        if getattr(actor, "_bench_opt", None) is None:
            actor._bench_opt = build_optimizer(actor, lr=lr)  # fused on GPU, like the trainer
        actor._bench_opt.step()
        actor._bench_opt.zero_grad(set_to_none=True)
        return
    with torch.no_grad():
        for p in actor.parameters():
            if p.grad is not None:
                p.add_(torch.sign(p.grad), alpha=-lr)
                p.grad = None


def _weight_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.name.endswith((".safetensors", ".xor.zst")))


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    return names == sorted(p.name for p in b.glob("*.safetensors")) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


def delta_bench(actor, layout, args, tied: bool, src: Path, vocab: int) -> None:  # type: ignore[no-untyped-def]
    """Full vs delta versions of the same weights after each optimizer step: bytes, publish and reload times."""
    from buffer.localcache import NodeCache
    from trainer import dist as tdist
    from trainer.delta_base import DeltaBase
    from trainer.publish import publish_weights

    me = tdist.rank()
    base = DeltaBase()

    def publish(v: int, **kw) -> None:  # type: ignore[no-untyped-def]
        publish_weights(actor, layout, v, v, dtype=args.dtype, tied=tied, src_model_dir=src, **kw)

    publish(1, base=base)  # the base, and the warm-up of the code paths
    caches = (args.cache_dir or args.dir) / args.preset / "caches"
    rows = []
    v = 2
    for r in range(args.repeat):
        _step(actor, vocab, args.lr, seed=r, optimizer=args.optimizer)
        t_full = timed(lambda v=v: publish(v))
        t_delta = timed(lambda v=v: publish(v + 1, delta_base=1, base=base))
        if me == 0:
            full_cache = NodeCache(layout, caches / f"full-{r}")
            start = time.perf_counter()
            full_cache.materialise(v)
            reload_full = time.perf_counter() - start
            read_full = full_cache.shared_bytes_read
            shutil.rmtree(caches / f"full-{r}")  # room for the delta's cache: the run's copy is the full twin
            delta_cache = NodeCache(layout, caches / f"delta-{r}")
            delta_cache.materialise(1)  # a following node holds the base already
            before = delta_cache.shared_bytes_read
            start = time.perf_counter()
            rebuilt = delta_cache.materialise(v + 1)
            reload_delta = time.perf_counter() - start
            ok = _same_files(rebuilt.path, layout.weight_version(v))
            rows.append(
                {
                    "full_bytes": _weight_bytes(layout.weight_version(v)),
                    "delta_bytes": _weight_bytes(layout.weight_version(v + 1)),
                    "read_full": read_full,
                    "read_delta": delta_cache.shared_bytes_read - before,
                    "publish_full": t_full,
                    "publish_delta": t_delta,
                    "reload_full": reload_full,
                    "reload_delta": reload_delta,
                    "same": ok,
                }
            )
            shutil.rmtree(caches, ignore_errors=True)
            for done in (v, v + 1):  # only the base is needed again
                shutil.rmtree(layout.weight_version(done), ignore_errors=True)
        tdist.barrier()
        v += 2
    if me == 0:
        step = "AdamW" if args.optimizer == "adamw" else "sign (AdamW's first step, stateless)"
        print(f"delta vs full after one {step} step at lr {args.lr:g}, published as {args.dtype}:")
        print(
            f"{'step':>4} {'full MiB':>9} {'delta MiB':>9} {'bytes d/f':>9} {'read d/f':>9} {'publish full s':>14} "
            f"{'delta s':>8} {'pub d/f':>7} {'reload full s':>13} {'delta s':>8} {'reload d/f':>10}  same bytes"
        )
        for i, row in enumerate(rows, 1):
            print(
                f"{i:>4} {row['full_bytes'] / 2**20:>9.1f} {row['delta_bytes'] / 2**20:>9.2f} "
                f"{row['delta_bytes'] / row['full_bytes']:>9.4f} {row['read_delta'] / row['read_full']:>9.4f} "
                f"{row['publish_full']:>14.3f} {row['publish_delta']:>8.3f} "
                f"{row['publish_delta'] / row['publish_full']:>7.3f} {row['reload_full']:>13.3f} "
                f"{row['reload_delta']:>8.3f} {row['reload_delta'] / row['reload_full']:>10.3f}  {row['same']}",
                flush=True,
            )
        shutil.rmtree(args.dir / args.preset, ignore_errors=True)
    tdist.teardown()


if __name__ == "__main__":
    main()
