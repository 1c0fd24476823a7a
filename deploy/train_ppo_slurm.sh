#!/bin/bash
# Both roles in one allocation: the first SHARDRL_TRAIN_NODES node(s) train, the rest roll out.
#
#   sbatch --nodes=N [--partition=P --gres=gpu:G --time=T] deploy/train_ppo_slurm.sh RUN [--max-steps N] [--trainer.key V] [--rollout.key V]
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
# Safe-path mode (also for the processes torchrun and the supervisor start): a `trainer.py` or `buffer/` in the
# directory the job starts from must not shadow the installed project.
export PYTHONSAFEPATH=1
TRAIN_NODES=${SHARDRL_TRAIN_NODES:-1}
# Overrides go to the process they configure: --trainer.* and --max-steps to the trainer, --rollout.* to the rollout
# supervisors (each refuses the other's keys); anything else is a run-wide key, fixed by `shardrl init`.
TRAIN_ARGS=()
ROLL_ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
    --trainer.*=* | --max-steps=*) TRAIN_ARGS+=("$1"); shift ;;
    --trainer.* | --max-steps) TRAIN_ARGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --rollout.*=*) ROLL_ARGS+=("$1"); shift ;;
    --rollout.*) ROLL_ARGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    *) echo "train_ppo_slurm.sh: $1 is neither a --trainer.* nor a --rollout.* override (run-wide keys are set by shardrl init)" >&2; exit 2 ;;
    esac
done
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
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_ADDR:$PORT" --rdzv_id="$SLURM_JOB_ID" -m trainer --run-dir "$RUN" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"} &
train=$!
srun --job-name=shardrl-rollout --nodes="$ROLL_NODES" --ntasks="$ROLL_NODES" --nodelist="$ROLL" --ntasks-per-node=1 \
    --output="$RUN/logs/rollout-%j-%N.log" "$PYTHON" -m rollout_worker --run "$RUN" ${ROLL_ARGS[@]+"${ROLL_ARGS[@]}"} &
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
