#!/bin/bash
# The GPU figures of docs/PERFORMANCE.md, in one go, on a machine with >= 2 GPUs:
#   bash bench/run_gpu.sh OUT_DIR
# Trainer step vs bare FSDP2 step (Qwen2.5-1.5B shape, NCCL, bf16), publish vs naive vs raw disk, shard I/O on the
# local disk, and the gpu-marked tests.
set -u
OUT=${1:?usage: bench/run_gpu.sh OUT_DIR}
mkdir -p "$OUT"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
{ nvidia-smi -L; python -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)"; } \
    2>&1 | tee "$OUT/env.txt"
python -m torch.distributed.run --nproc_per_node="$NGPU" bench/trainer.py --bare-adam 2>&1 | tee "$OUT/trainer.txt"
python -m torch.distributed.run --nproc_per_node="$NGPU" bench/publish.py --preset qwen2.5-1.5b 2>&1 | tee "$OUT/publish.txt"
python bench/buffer_io.py --shards 5 2>&1 | tee "$OUT/buffer_io.txt"
python -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
