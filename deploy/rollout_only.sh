#!/bin/bash
# Rollout job for cheap partitions: one node supervisor per node, workers per GPU of the allocation.
#
#   shardrl init RUN --config CFG.toml            # once
#   sbatch [--partition=P --nodes=N --gres=gpu:G --time=T] deploy/rollout_only.sh RUN [--section.key value ...]
#   echo '{"action":"add","count":2}' > RUN/control.json   # rescale while it runs
#   sbatch --nodes=1 --gres=gpu:1 deploy/rollout_only.sh RUN --eval   # the evaluator instead (one is enough)
#
# Submit it any number of times, on any partitions: all supervisors share RUN and together run exactly the desired
# number of workers.  On SIGTERM (time limit, preemption, scancel) the supervisors drain their workers well inside
# KillWait (30 s by default) and publish nothing partial.  Logs: RUN/logs/rollout-<job>-<node>.log.
#SBATCH --job-name=shardrl-rollout
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:1
#SBATCH --time=04:00:00
#SBATCH --output=shardrl-rollout-%j.out
set -euo pipefail

RUN=${1:?usage: sbatch deploy/rollout_only.sh RUN [--section.key value ...]}
shift
PYTHON=${SHARDRL_PYTHON:-python3}
# Safe-path mode (also for the processes torchrun and the supervisor start): a `trainer.py` or `buffer/` in the
# directory the job starts from must not shadow the installed project.
export PYTHONSAFEPATH=1
mkdir -p "$RUN/logs"
echo "rollout job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-$(hostname)}: run $RUN"
# With --eval the same command is the evaluator (greedy scores of published versions), not a supervisor.

# One supervisor per node; each counts the GPUs Slurm gave its node (CUDA_VISIBLE_DEVICES) as its worker slots.
srun --job-name=shardrl-rollout --ntasks-per-node=1 --kill-on-bad-exit=0 --output="$RUN/logs/rollout-%j-%N.log" \
    "$PYTHON" -m rollout_worker --run "$RUN" "$@" &
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
# Forward TERM/INT to every supervisor of the job step and wait for their drain.
forward() { signal_step shardrl-rollout "$step"; wait "$step" || true; exit 0; }
trap forward TERM INT
wait "$step"
