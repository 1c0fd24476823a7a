"""Where a node's rollout workers run: the GPUs this process may use, grouped for tensor parallelism, or a share of
the CPU cores each; the node supervisor sizes its capacity and each worker's environment from it."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from buffer.config import ShardRLConfig
from rollout_worker.engines import resolve_kind
from rollout_worker.engines.gpu_start import named_gpus


def visible_gpus() -> list[str]:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else what ``nvidia-smi -L`` lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return named_gpus(env)
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(ln for ln in out.stdout.splitlines() if ln.startswith("GPU "))]


@dataclass(frozen=True)
class Devices:
    """Where the workers of this node run: one GPU group each, or a share of the CPU cores."""

    capacity: int
    gpu_groups: list[str]  # CUDA_VISIBLE_DEVICES value per GPU group; empty on a CPU node
    cores: list[int]
    threads: int | None  # OMP threads per worker (always set on a CPU node)

    def env(self, local: int, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.gpu_groups:
            # more slots than GPU groups (an explicit --max-local-workers) share GPUs round-robin
            env["CUDA_VISIBLE_DEVICES"] = self.gpu_groups[local % len(self.gpu_groups)]
            if self.threads:
                env["OMP_NUM_THREADS"] = str(self.threads)
            return env
        threads, n = self.threads or 1, len(self.cores)
        mine = sorted({self.cores[(local * threads + k) % n] for k in range(threads)})
        env["OMP_NUM_THREADS"] = str(len(mine))
        # vLLM's CPU backend pins its OpenMP threads here; the engine module leaves a value already set alone
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
        return env


def local_devices(cfg: ShardRLConfig) -> Devices:
    """Capacity = ``rollout.max_local_workers`` when set, else one worker per GPU group, else ``cpu_workers``."""
    r = cfg.rollout
    gpus = visible_gpus()
    tp = r.vllm.tensor_parallel_size if r.vllm is not None and resolve_kind(r.engine) == "vllm" else 1
    groups = [",".join(gpus[i : i + tp]) for i in range(0, len(gpus) - tp + 1, tp)]
    capacity = r.max_local_workers if r.max_local_workers is not None else (len(groups) or r.cpu_workers)
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cores = list(range(os.cpu_count() or 1))
    threads = r.threads_per_worker
    if not groups and threads is None:
        threads = max(1, len(cores) // max(capacity, 1))
    return Devices(capacity, groups, cores, threads)
