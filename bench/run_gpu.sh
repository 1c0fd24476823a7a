#!/bin/bash
# The GPU figures of docs/PERFORMANCE.md, section by section, on a machine with one or more GPUs:
#   bash bench/run_gpu.sh OUT_DIR [SECTION...]      (default: every section, in this order)
# Sections:
#   trainer      trainer step vs bare FSDP2 step, Qwen2.5-1.5B shape, bf16, every GPU
#   trainer7b    the same at the Qwen2.5-7B shape (a full AdamW step fits on one H200: 117.9 GiB at its peak)
#   profile      where the 1.5B step's time goes, bare and trainer side by side (bench/trainer.py --profile), with
#                trainer.kernels eager and compile, PROFILE_RUNS (2) times each
#   profile7b    the same at the 7B shape (bare and trainer, no bare AdamW); PROFILE_KERNELS ("eager compile") picks
#                which trainer.kernels settings run, SAMPLES7 (8) the samples of 2048 tokens a step
#   skip         the 1.5B step, bare and trainer, compiled layers, with each AC_SKIP ("0 14 20") decoder layers left
#                out of activation checkpointing (trainer.activation_checkpointing_skip; the bare path the same)
#   skip7b       the same at the 7B shape, AC_SKIP7 ("0 4"), SAMPLES7 (8) samples of 2048 tokens a step: 32 makes a
#                step of four micro-batches, over which the optimizer's update is spread as in a real RL step
#   skip7b8l     skip7b on an 80 GB GPU: 8 of the 7B shape's 28 decoder layers (bench/trainer.py --preset
#                qwen2.5-7b-8l), AC_SKIP8L ("0 1") of them left out of checkpointing, SAMPLES7 as above
#   profile7b8l  profile7b on skip7b8l's 8 layers, with bare + AdamW too (it fits there); PROFILE_KERNELS and SAMPLES7
#                as in profile7b
#   fusedhead    the LM head alone over 16,384 tokens, whole logits / recomputing / fused / fused with compiled
#                chunks (bench/head.py), then, with compiled layers, the bare step and the trainer step with the
#                recomputing head, the fused head's chunks eager (trainer.compile_head false) and the default (its
#                chunks compiled, as the layers are),
#                FUSED_PRESETS ("qwen2.5-1.5b qwen2.5-7b-8l"), SAMPLES7 samples a step at the 7B width
#   lora7b       the trainer step with a LoRA actor (rank 64) at the 7B shape
#   long7b       the longest single sequences of one H200 at the 7B shape, trainer path, one sample a step:
#                full weights at LONG_FULL (98304) tokens and LoRA-64 at LONG_LORA (262144), each layer's checkpointed
#                input in host memory (trainer.activation_offload); full weights at 65536 without offload beside it
#   offload      the 1.5B trainer step with trainer.cpu_offload, next to the same step without
#   offload7b    the 7B trainer step with trainer.cpu_offload (16 bytes per parameter in host memory: 122 GB on one
#                GPU's host, more than a 128 GB host has; 61 GB per rank on two GPUs)
#   publish      publish vs naive vs the disk's parallel write limit, 1.5B and 7B shapes
#   lora         adapter vs merged full publish at the 1.5B and 7B shapes
#   delta7b      the 7B line of delta alone
#   delta        delta vs full versions after one optimizer step at lr 1e-6 (bf16 published): bytes, publish and node
#                reload time as ratios delta/full; 1.5B with AdamW and with the stateless sign step (AdamW's first
#                step), 7B with the sign step (AdamW's state does not fit one GPU beside the bench's copies); needs
#                the zstandard package, which bench/gpu_install.sh installs
#   reload       hf-engine reload of full weights and of adapters at the 1.5B and 7B shapes
#   buffer       shard I/O on the local disk
#   e2e          bench/e2e.py, sync vs staleness 1 and 2: a random Qwen2.5-0.5B-shaped model with the demo's tokens,
#                hf worker and trainer on GPUs of their own (trainer on GPU 0, worker on GPU 1) when there are two,
#                both on GPU 0 when there is one.  E2E_WORKERS (1) workers share the worker GPU; E2E_MODES (sync,1,2;
#                sK = streaming workers at bound K); E2E_RESPONSE (32) response tokens; E2E_LENGTHS=loguniform with
#                E2E_MIN (16): long-tailed lengths; E2E_ALONE=1: the streaming engine alone too; E2E_STEPS (5); E2E_SAMPLES (1024) per step
#                E2E_ENGINE (hf) or vllm: a vLLM worker with CUDA graphs, E2E_VLLM_MEM (0.35) of the GPU's memory
#                (the trainer shares GPU 0 with it when there is one GPU), E2E_VLLM_SEQS (512) sequences at once;
#                E2E_SHAPE (qwen2.5-0.5b) the model's shape; E2E_SET: more KEY=VALUE overrides, space-separated
#   alone        the streaming vLLM engine alone (bench/engine_alone.py) with the e2e workers' options (CUDA graphs,
#                E2E_VLLM_MEM of the memory, E2E_VLLM_SEQS in flight) on the E2E_SHAPE model, lengths log-uniform
#                16..E2E_RESPONSE (1024): without the engine's tokenizer (a run without stop strings) and with it,
#                ALONE_RUNS (2) times each, alternating
#   vllm         the gpu-marked vLLM tests (tests/integration/test_gpu_vllm.py); bench/gpu_install.sh installs vLLM
#   stream       the streaming transformers engine's decode step on ragged rows (bench/ragged_decode.py, profiled),
#                then the streaming and the batch engines alone on long-tailed lengths (bench/engine_alone.py), on a
#                random Qwen2.5-0.5B-shaped model with the demo's tokens, bf16
#   tests        the gpu-marked tests
# Each section writes OUT_DIR/SECTION.txt; a section that fails or runs out of memory does not stop the others.
set -u
OUT=${1:?usage: bench/run_gpu.sh OUT_DIR [SECTION...]}
shift
SECTIONS=${*:-trainer trainer7b lora7b offload offload7b publish lora delta reload buffer e2e tests}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SITE=${SHARDRL_GPU_SITE:-/root/shardrl-site}
# shellcheck disable=SC1091
[ -f "$SITE/env.sh" ] && source "$SITE/env.sh"  # what bench/gpu_install.sh installed
# The project itself, where it is not pip-installed: bench/e2e.py starts its processes with `python -P`, which
# leaves the working directory off the path.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
RUN="python -m torch.distributed.run --nproc_per_node=$NGPU"
{ nvidia-smi -L; free -g | head -2; python -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, transformers.__version__)"; } \
    2>&1 | tee "$OUT/env.txt"
# 7B: the run's three versions (~31 GB) fill most of the 64 GB disk; the node caches go to memory
delta7b() { $RUN bench/publish.py --preset qwen2.5-7b --delta --repeat 2 --optimizer sign --cache-dir /dev/shm; }
skip7() {  # PRESET "K...": the compiled 7B-wide step, bare and trainer, with K layers left out of checkpointing
    for k in $2; do
        $RUN bench/trainer.py --preset "$1" --paths bare,trainer --kernels compile --ac-skip "$k" \
            --samples-per-rank "${SAMPLES7:-8}" --warmup 1 --steps 3
    done
}
profile7() {  # PRESET PATHS: the 7B-wide step phase by phase, once for each of PROFILE_KERNELS
    for k in ${PROFILE_KERNELS:-eager compile}; do
        $RUN bench/trainer.py --preset "$1" --paths "$2" --bare-adam --profile --kernels "$k" \
            --samples-per-rank "${SAMPLES7:-8}" --warmup 1 --steps 3
    done
}
for s in $SECTIONS; do
    echo "=== $s" | tee "$OUT/$s.txt"
    case $s in
        trainer) $RUN bench/trainer.py --bare-adam ;;
        trainer7b)
            $RUN bench/trainer.py --preset qwen2.5-7b --paths bare,trainer --warmup 1 --steps 3
            $RUN bench/trainer.py --preset qwen2.5-7b --bare-adam --paths bare-adam --warmup 1 --steps 3 ;;
        profile)
            for ((run = 0; run < ${PROFILE_RUNS:-2}; run++)); do
                for k in eager compile; do $RUN bench/trainer.py --bare-adam --profile --kernels $k; done
            done ;;
        profile7b) profile7 qwen2.5-7b bare,trainer ;;
        long7b)
            L7="$RUN bench/trainer.py --preset qwen2.5-7b --samples-per-rank 1 --paths trainer"
            $L7 --seq-len "${LONG_FULL:-98304}" --microbatch-tokens "${LONG_FULL:-98304}" --activation-offload --warmup 1 --steps 2
            $L7 --seq-len "${LONG_LORA:-262144}" --microbatch-tokens "${LONG_LORA:-262144}" --activation-offload --lora 64 --warmup 0 --steps 1
            $L7 --seq-len 65536 --microbatch-tokens 65536 --warmup 1 --steps 2 ;;
        skip)
            for k in ${AC_SKIP:-0 14 20}; do $RUN bench/trainer.py --paths bare,trainer --kernels compile --ac-skip "$k"; done ;;
        skip7b) skip7 qwen2.5-7b "${AC_SKIP7:-0 4}" ;;
        skip7b8l) skip7 qwen2.5-7b-8l "${AC_SKIP8L:-0 1}" ;;
        profile7b8l) profile7 qwen2.5-7b-8l bare,bare-adam,trainer ;;
        fusedhead)
            for p in ${FUSED_PRESETS:-qwen2.5-1.5b qwen2.5-7b-8l}; do
                python bench/head.py --preset "${p%-8l}" --tokens 16384
                n=8; [ "$p" = qwen2.5-1.5b ] || n=${SAMPLES7:-8}
                $RUN bench/trainer.py --preset "$p" --paths bare,trainer-recompute,trainer-eager-head,trainer --kernels compile \
                    --samples-per-rank "$n" --warmup 1 --steps 3
            done ;;
        lora7b) $RUN bench/trainer.py --preset qwen2.5-7b --lora 64 --paths trainer --warmup 1 --steps 3 ;;
        offload) $RUN bench/trainer.py --paths trainer && $RUN bench/trainer.py --cpu-offload --paths trainer ;;
        offload7b) $RUN bench/trainer.py --preset qwen2.5-7b --cpu-offload --paths trainer --warmup 1 --steps 2 ;;
        publish)
            $RUN bench/publish.py --preset qwen2.5-1.5b
            $RUN bench/publish.py --preset qwen2.5-7b --repeat 1 ;;
        lora)
            $RUN bench/publish.py --preset qwen2.5-1.5b --lora 16
            $RUN bench/publish.py --preset qwen2.5-7b --lora 16 --repeat 1 ;;
        delta)
            $RUN bench/publish.py --preset qwen2.5-1.5b --delta --repeat 2
            $RUN bench/publish.py --preset qwen2.5-1.5b --delta --repeat 2 --optimizer sign
            delta7b ;;
        delta7b) delta7b ;;
        reload)
            python bench/reload.py --engine hf --lora 16 --preset qwen2.5-1.5b --repeat 3
            python bench/reload.py --engine hf --lora 16 --preset qwen2.5-7b --repeat 2 ;;
        buffer) python bench/buffer_io.py --shards 5 ;;
        e2e)
            W=$([ "$NGPU" -ge 2 ] && echo 1 || echo 0)
            N=${E2E_WORKERS:-1}
            DEV=cuda:$W; for ((i = 1; i < N; i++)); do DEV=$DEV,$W; done
            ENGINE=${E2E_ENGINE:-hf}
            VLLM=()
            [ "$ENGINE" = vllm ] && VLLM=(--set rollout.vllm.enforce_eager=false
                --set "rollout.vllm.gpu_memory_utilization=${E2E_VLLM_MEM:-0.35}"
                --set "rollout.vllm.max_num_seqs=${E2E_VLLM_SEQS:-512}")
            EXTRA=(); for kv in ${E2E_SET:-}; do EXTRA+=(--set "$kv"); done
            python bench/e2e.py --engine "$ENGINE" --shape "${E2E_SHAPE:-qwen2.5-0.5b}" --set model.dtype=bfloat16 \
                "${VLLM[@]}" "${EXTRA[@]}" --timeout-s "${E2E_TIMEOUT:-1800}" --trainer-device cuda:0 \
                --worker-device "$DEV" --workers "$N" --modes "${E2E_MODES:-sync,1,2}" \
                --response-length "${E2E_RESPONSE:-32}" --samples-per-step "${E2E_SAMPLES:-1024}" --steps "${E2E_STEPS:-5}" \
                --lengths "${E2E_LENGTHS:-natural}" --min-response-length "${E2E_MIN:-16}" ${E2E_ALONE:+--engine-alone} \
                --out "$OUT/e2e_${ENGINE}_w$N.json" ;;
        stream)
            M=/tmp/model-qwen2.5-0.5b
            [ -d "$M" ] || python -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from e2e import build_shaped_model; build_shaped_model('qwen2.5-0.5b', Path('$M'))"
            python bench/ragged_decode.py --model "$M" --device cuda --dtype bfloat16 --rows 105 --length 550 --steps 30 --profile
            python bench/ragged_decode.py --model "$M" --device cuda --dtype bfloat16 --rows 176 --length 550 --steps 30
            A="--model $M --engine hf --samples 704 --in-flight 176 --lengths loguniform --min-response-length 16 --max-response-length 512 --dtype bfloat16"
            for run in 1 2; do
                python bench/engine_alone.py $A
                python bench/engine_alone.py $A --batch
            done
            SHARDRL_ENGINE_TIMINGS=1 python bench/engine_alone.py $A ;;
        alone)
            M=/tmp/model-${E2E_SHAPE:-qwen2.5-0.5b}
            [ -d "$M" ] || python -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; from e2e import build_shaped_model; build_shaped_model('${E2E_SHAPE:-qwen2.5-0.5b}', Path('$M'))"
            O="{\"enforce_eager\": false, \"gpu_memory_utilization\": ${E2E_VLLM_MEM:-0.35}, \"max_num_seqs\": ${E2E_VLLM_SEQS:-512}}"
            for ((run = 0; run < ${ALONE_RUNS:-2}; run++)); do
                for d in "" --detokenize; do
                    python bench/engine_alone.py --model "$M" --engine vllm --samples $((2 * ${E2E_VLLM_SEQS:-512})) \
                        --in-flight "${E2E_VLLM_SEQS:-512}" --lengths loguniform --min-response-length 16 \
                        --max-response-length "${E2E_RESPONSE:-1024}" --dtype bfloat16 --vllm-options "$O" $d 2>&1 | tail -1
                done
            done ;;
        tests) python -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_gpu.py tests/unit/test_packing.py tests/unit/test_activation_offload.py tests/unit/test_lazy_batches.py 2>&1 | tail -15 ;;
        vllm) python -m pytest -q -s -m gpu -p no:cacheprovider tests/integration/test_gpu_vllm.py 2>&1 | tail -40 ;;
        *) echo "unknown section $s" ;;
    esac 2>&1 | awk '!/[Ww][Aa][Rr][Nn]/ || /passed|failed|error/' | tee -a "$OUT/$s.txt"  # pytest's summary says "warnings"
done
