"""Shard publish/read throughput against the raw bandwidth of the same directory, measured in the same run.

    python bench/buffer_io.py [--dir DIR] [--samples 4096] [--tokens 2048] [--shards 5]

Raw limit: one large file written with a single write + fsync, and read back, in the same directory.  Shard path:
``publish_shard`` (serialize with a streaming CRC-32, tmp, fsync, rename, fsync dir) and ``read_shard`` (read,
CRC-32, Arrow footer, schema and value checks).  Building the table from Python lists is timed apart: it is the
producer's cost, not the storage path's.  Prints MB/s of both, their ratio, and the per-shard publish overhead for a tiny shard.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer import shards
from buffer.layout import RunLayout


def rows(n: int, tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompt = [rng.randrange(150_000) for _ in range(tokens // 4)]
    out = []
    for i in range(n):
        resp_len = rng.randint(tokens // 2, tokens - tokens // 4)
        out.append(
            {
                "group_id": f"g{i // 8}",
                "prompt_ids": prompt,
                "response_ids": [rng.randrange(150_000) for _ in range(resp_len)],
                "response_logprobs": [-rng.random() * 5 for _ in range(resp_len)],
                "reward": rng.random(),
                "policy_version": 3,
                "finish_reason": "stop",
            }
        )
    return out


def raw_bandwidth(directory: Path, nbytes: int, repeat: int) -> tuple[float, float]:
    """Best of ``repeat``: new files written with one write + fsync each, then read back (from the page cache).

    The files are kept until the end, as the shards are: both sides then pay the same page-cache allocation.
    """
    data = os.urandom(nbytes)
    ws, rs, paths = [], [], []
    for i in range(repeat):
        path = directory / f"raw-{i}.bin"
        paths.append(path)
        t = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        ws.append(time.perf_counter() - t)
        t = time.perf_counter()
        path.read_bytes()
        rs.append(time.perf_counter() - t)
    for path in paths:
        path.unlink()
    return nbytes / min(ws), nbytes / min(rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=None, help="directory to measure (default: a temp dir)")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--shards", type=int, default=5)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.dir))
    layout = RunLayout.of(base / "run")
    layout.create()
    data = [dict(r, sample_id=f"s{i}") for i, r in enumerate(rows(args.samples, args.tokens, 0))]
    t = time.perf_counter()
    table = shards.build_table(data, "bench", "w0", 0)
    build_s = time.perf_counter() - t
    writer = shards.ShardWriter(layout, "bench", "w0")
    write_s, read_s, sizes = [], [], []
    for seq in range(args.shards):
        t = time.perf_counter()
        path = shards.publish_shard(layout, table, "w0", writer.incarnation, seq)
        write_s.append(time.perf_counter() - t)
        sizes.append(path.stat().st_size)
        t = time.perf_counter()
        shards.read_shard(path, vocab_size=150_000)
        read_s.append(time.perf_counter() - t)
    size = statistics.median(sizes)
    raw_w, raw_r = raw_bandwidth(base, int(size), args.shards)
    shard_w, shard_r = size / min(write_s), size / min(read_s)
    tiny = []
    for _ in range(50):
        writer.add(dict(data[0]))
        t = time.perf_counter()
        writer.flush()
        tiny.append(time.perf_counter() - t)
    mb = 1e6
    print(f"shard: {args.samples} samples, {size / mb:.1f} MB; best of {args.shards} for every figure")
    print(f"building the Arrow table from Python lists (the worker's side, not I/O): {build_s * 1e3:.0f} ms")
    print(
        f"raw write+fsync {raw_w / mb:8.0f} MB/s   shard publish {shard_w / mb:8.0f} MB/s   ratio {shard_w / raw_w:.2f}"
    )
    print(
        f"raw read        {raw_r / mb:8.0f} MB/s   shard read+validate {shard_r / mb:8.0f} MB/s   ratio {shard_r / raw_r:.2f}"
    )
    print(
        f"per-shard publish overhead (1-sample shard, median of 50): {statistics.median(tiny) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
