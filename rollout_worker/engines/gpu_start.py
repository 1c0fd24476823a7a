"""One vLLM engine start at a time per GPU of a node.

vLLM sizes its KV cache at start-up by profiling: it measures the GPU's free memory before and after a dummy forward
pass and takes any change as its own.  It assumes that nothing else on the GPU allocates or frees memory meanwhile,
and aborts ("Error in memory profiling ... current free memory") when free memory grows during the profile, or
undersizes its cache when another process allocates.  Two workers starting at once on one GPU (a supervisor with
more slots than GPUs, or a worker restarting its engine beside another) break that assumption.  So a CUDA engine
holds a lock per GPU it uses, from before the engine is built until it is serving; workers on other GPUs do not wait.

The locks are node-local files (``flock``; the kernel drops a lock when its holder dies, so a killed worker never
leaves one behind), one directory per user.  A GPU is named as ``CUDA_VISIBLE_DEVICES`` names it (an index or a
UUID): workers that name one GPU differently do not see each other's starts.  A start that waits longer than the
timeout goes ahead and says so, rather than leaving a worker blocked behind a hung start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# a vLLM start (weights, profile, KV cache, CUDA graphs) of a large model takes minutes
WAIT_S = 900.0


def named_gpus(visible: str) -> list[str]:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value names, in its order (indices or UUIDs).  CUDA stops at the first
    entry that names no device, so a negative index hides itself and every entry after it."""
    names: list[str] = []
    for entry in (d.strip() for d in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        names.append(entry)
    return names


def engine_gpus(tensor_parallel_size: int, visible: str | None = None) -> list[str]:
    """The GPUs an engine with ``tensor_parallel_size`` ranks uses: the first ones ``CUDA_VISIBLE_DEVICES`` names,
    or the first indices when it is unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    size = max(1, tensor_parallel_size)
    if visible is None:
        return [str(i) for i in range(size)]
    return named_gpus(visible)[:size]


def lock_dir() -> Path:
    """Where the node's start locks live: local to the node, one directory per user (``SHARDRL_GPU_LOCK_DIR``
    overrides it)."""
    return Path(
        os.environ.get("SHARDRL_GPU_LOCK_DIR") or Path(tempfile.gettempdir()) / f"shardrl-{os.getuid()}"
    )


@contextlib.contextmanager
def one_start_per_gpu(
    gpus: list[str], *, wait_s: float = WAIT_S, where: Path | None = None
) -> Iterator[None]:
    """Hold the start lock of each GPU in ``gpus`` (in sorted order, so that engines sharing several GPUs cannot
    deadlock) while the body starts an engine."""
    from filelock import FileLock, Timeout

    where = lock_dir() if where is None else where
    where.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with contextlib.ExitStack() as held:
        for gpu in sorted(set(gpus)):
            lock = FileLock(str(where / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}.start.lock"))
            left = max(0.0, wait_s - (time.monotonic() - began))
            try:
                held.enter_context(lock.acquire(timeout=left))
            except Timeout:
                log.warning(
                    "GPU %s: another engine has been starting on it for over %.0f s (%s); starting beside it, "
                    "whose memory profile may then be off",
                    gpu,
                    wait_s,
                    lock.lock_file,
                )
        waited = time.monotonic() - began
        if waited >= 1.0:
            log.info("waited %.1f s for another engine's start on GPU %s", waited, ",".join(gpus))
        yield


def engine_start(kwargs: dict[str, object], *, cpu: bool) -> contextlib.AbstractContextManager[None]:
    """What a vLLM engine built with ``kwargs`` holds while it starts: the start locks of its GPUs; nothing on the
    CPU build, which sizes its KV cache from a setting (``VLLM_CPU_KVCACHE_SPACE``), not from a memory profile."""
    if cpu:
        return contextlib.nullcontext()
    tp = kwargs.get("tensor_parallel_size", 1)
    return one_start_per_gpu(engine_gpus(tp if isinstance(tp, int) else 1))
