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

srun --nodes="$TRAIN_NODES" --nodelist="$TRAIN" --ntasks-per-node=1 --output="$RUN/logs/trainer-%j-%N.log" \
    "$PYTHON" -m torch.distributed.run --nnodes="$TRAIN_NODES" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_ADDR:$PORT" --rdzv_id="$SLURM_JOB_ID" -m trainer --run-dir "$RUN" &
train=$!
srun --nodes=$(( ${#NODES[@]} - TRAIN_NODES )) --nodelist="$ROLL" --ntasks-per-node=1 \
    --output="$RUN/logs/rollout-%j-%N.log" "$PYTHON" -m rollout_worker --run "$RUN" "$@" &
roll=$!
forward() { kill -TERM "$train" "$roll" 2>/dev/null || true; wait || true; exit 0; }
trap forward TERM INT
# The run ends when the trainer does (max steps reached); then the rollout fleet is drained.
wait "$train" || true
kill -TERM "$roll" 2>/dev/null || true
wait "$roll" || true
