#!/bin/bash
# Rollout job for cheap partitions: one node supervisor per node, workers per GPU of the allocation.
#
#   shardrl init RUN --config CFG.toml            # once
#   sbatch [--partition=P --nodes=N --gres=gpu:G --time=T] deploy/rollout_only.sh RUN [--section.key value ...]
#   echo '{"action":"add","count":2}' > RUN/control.json   # rescale while it runs
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
mkdir -p "$RUN/logs"
echo "rollout job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-$(hostname)}: run $RUN"

# One supervisor per node; each counts the GPUs Slurm gave its node (CUDA_VISIBLE_DEVICES) as its worker slots.
srun --ntasks-per-node=1 --kill-on-bad-exit=0 --output="$RUN/logs/rollout-%j-%N.log" \
    "$PYTHON" -m rollout_worker --run "$RUN" "$@" &
step=$!

# Forward TERM/INT to the job step (srun relays it to every supervisor) and wait for their drain.
forward() { kill -TERM "$step" 2>/dev/null || true; wait "$step" || true; exit 0; }
trap forward TERM INT
wait "$step"
