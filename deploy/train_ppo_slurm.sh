#!/bin/bash
# Both roles in one allocation: the first SHARDRL_TRAIN_NODES node(s) train, the rest roll out.
#
#   sbatch --nodes=N [--partition=P --gres=gpu:G --time=T] deploy/train_ppo_slurm.sh RUN [--section.key value ...]
#
# The two roles still meet only in RUN; either may be restarted alone with trainer_only.sh / rollout_only.sh.
#SBATCH --job-name=shardrl-ppo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:1
#SBATCH --time=24:00:00
#SBATCH --output=shardrl-ppo-%j.out
set -euo pipefail

RUN=${1:?usage: sbatch deploy/train_ppo_slurm.sh RUN [--section.key value ...]}
shift
PYTHON=${SHARDRL_PYTHON:-python3}
TRAIN_NODES=${SHARDRL_TRAIN_NODES:-1}
mkdir -p "$RUN/logs"
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${#NODES[@]}" -le "$TRAIN_NODES" ]; then
    echo "train_ppo_slurm.sh: need more than SHARDRL_TRAIN_NODES=$TRAIN_NODES nodes, got ${#NODES[@]}" >&2
    exit 2
fi
TRAIN=$(IFS=,; echo "${NODES[*]:0:$TRAIN_NODES}")
ROLL=$(IFS=,; echo "${NODES[*]:$TRAIN_NODES}")
HEAD=${NODES[0]}
# Rendezvous on the first node's address as Slurm knows it (node names need not resolve in DNS).
HEAD_ADDR=$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
HEAD_ADDR=${HEAD_ADDR:-$HEAD}
PORT=$((29500 + SLURM_JOB_ID % 1000))
NPROC=${SLURM_GPUS_ON_NODE:-1}
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || NPROC=${SHARDRL_CPU_RANKS:-1}

# Explicit --ntasks: inside the allocation srun would otherwise inherit the job's task count for each step.
ROLL_NODES=$(( ${#NODES[@]} - TRAIN_NODES ))
srun --job-name=shardrl-train --nodes="$TRAIN_NODES" --ntasks="$TRAIN_NODES" --nodelist="$TRAIN" --ntasks-per-node=1 --output="$RUN/logs/trainer-%j-%N.log" \
    "$PYTHON" -m torch.distributed.run --nnodes="$TRAIN_NODES" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_ADDR:$PORT" --rdzv_id="$SLURM_JOB_ID" -m trainer --run-dir "$RUN" &
train=$!
srun --job-name=shardrl-rollout --nodes="$ROLL_NODES" --ntasks="$ROLL_NODES" --nodelist="$ROLL" --ntasks-per-node=1 \
    --output="$RUN/logs/rollout-%j-%N.log" "$PYTHON" -m rollout_worker --run "$RUN" "$@" &
roll=$!
# Signal the tasks of our job step by name (scancel --signal delivers it without cancelling the step); signalling
# srun itself would cancel the step and SIGKILL the tasks after KillWait, cutting a drain short.
signal_step() {
    local ids
    ids=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null | awk -v n="$1" '$2 == n {print $1}')
    if [ -n "$ids" ]; then
        for id in $ids; do scancel --signal=TERM "$id" 2>/dev/null || true; done
    else
        kill -TERM "$2" 2>/dev/null || true
    fi
}
forward() { signal_step shardrl-train "$train"; signal_step shardrl-rollout "$roll"; wait || true; exit 0; }
trap forward TERM INT
# The run ends when the trainer does (max steps reached); then the rollout fleet is drained.  The job's exit status
# is the trainer's.
rc=0
wait "$train" || rc=$?
signal_step shardrl-rollout "$roll"
wait "$roll" || true
exit "$rc"
