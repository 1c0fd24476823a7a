#!/usr/bin/env bash
# Pre-flight check of the nodes a shardrl run will use; run it inside the allocation before the real jobs:
#
#   srun --ntasks-per-node=1 deploy/check_env.sh RUN_DIR    # every node, compared with each other
#   deploy/check_env.sh RUN_DIR                             # this node only
#
# Prints one "PASS|FAIL|SKIP [node] check: detail" line per check and exits 1 when any check fails:
#   python          ${SHARDRL_PYTHON:-python3} imports the project
#   storage         RUN_DIR takes a tmp -> fsync -> rename write and an exclusive create (link), through buffer/fsio
#   versions        python/torch/CUDA/NCCL/driver/vLLM/transformers of this node
#   visibility      under srun on several nodes: every node sees the marker file every other node wrote
#   versions-match  under srun on several nodes: task 0 finds the same versions on every node
#   gpus            GPUs torch can use (SKIP when the node has none)
#   nccl            an all-reduce across this node's GPUs with torchrun (SKIP with fewer than 2)
# The checks themselves are `shardrl check-env` (shardrl/check_env.py); this script only adds the python check and
# is what srun fans out.  Files go to RUN_DIR/logs/check_env/JOB.STEP/; CHECK_ENV_WAIT (seconds, default 60) bounds
# the wait for the other nodes.
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 RUN_DIR   (under srun: srun --ntasks-per-node=1 $0 RUN_DIR)" >&2
    exit 2
fi
PY=${SHARDRL_PYTHON:-python3}
NODE=${SLURMD_NODENAME:-$(hostname -s)}

# -P: a `shardrl/` or `buffer/` in the directory the job starts from must not shadow the installed project.
if ! out=$("$PY" -P -c 'import shardrl.check_env' 2>&1); then
    printf 'FAIL [%s] python: %s cannot import the project: %s\n' "$NODE" "$PY" "$(tail -n 1 <<<"$out")"
    exit 1
fi
exec "$PY" -P -m shardrl.cli check-env "$1" --wait-s "${CHECK_ENV_WAIT:-60}"
