#!/bin/bash
# Trainer job for the GPU training partition: one torchrun per node, c10d rendezvous on the first node.
#
#   sbatch [--partition=P --nodes=N --gres=gpu:G --time=T] deploy/trainer_only.sh RUN [--max-steps N] [--section.key value ...]
#
# Requeue-safe: a requeued (or cancelled and resubmitted) job resumes from the run's newest complete checkpoint and
# replays the recorded plans after it, so no sample is consumed twice; an older incarnation still running is fenced
# out by the consumption log.  Logs: RUN/logs/trainer-<job>-<node>.log.
#SBATCH --job-name=shardrl-train
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:1
#SBATCH --time=24:00:00
#SBATCH --requeue
# TERM to this script 5 minutes before the time limit: the step in progress is finished and checkpointed in time
#SBATCH --signal=B:TERM@300
#SBATCH --open-mode=append
#SBATCH --output=shardrl-train-%j.out
set -euo pipefail

RUN=${1:?usage: sbatch deploy/trainer_only.sh RUN [--max-steps N] [--section.key value ...]}
shift
PYTHON=${SHARDRL_PYTHON:-python3}
# Safe-path mode (also for the processes torchrun and the supervisor start): a `trainer.py` or `buffer/` in the
# directory the job starts from must not shadow the installed project.
export PYTHONSAFEPATH=1
mkdir -p "$RUN/logs"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
# Rendezvous on the first node's address as Slurm knows it (node names need not resolve in DNS).
HEAD_ADDR=$(scontrol show node "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
HEAD_ADDR=${HEAD_ADDR:-$HEAD}
PORT=$((29500 + SLURM_JOB_ID % 1000))
# Ranks per node = GPUs Slurm gave each node; a CPU-only allocation runs SHARDRL_CPU_RANKS (default 1) gloo ranks.
if [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "${SLURM_GPUS_ON_NODE}" -gt 0 ] 2>/dev/null; then
    NPROC=$SLURM_GPUS_ON_NODE
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    NPROC=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
    NPROC=${SHARDRL_CPU_RANKS:-1}
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    NPROC=${SHARDRL_CPU_RANKS:-1}
fi
echo "trainer job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): ${#NODES[@]} node(s) x $NPROC rank(s), rendezvous $HEAD_ADDR:$PORT"

srun --job-name=shardrl-train --ntasks-per-node=1 --kill-on-bad-exit=1 --output="$RUN/logs/trainer-%j-%N.log" --open-mode=append \
    "$PYTHON" -m torch.distributed.run --nnodes="${#NODES[@]}" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_ADDR:$PORT" --rdzv_id="$SLURM_JOB_ID" \
    -m trainer --run-dir "$RUN" "$@" &
step=$!
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
# TERM/INT: torchrun passes it to the ranks, which finish the step, checkpoint and exit.
forward() { signal_step shardrl-train "$step"; wait "$step" || true; exit 0; }
trap forward TERM INT
wait "$step"
