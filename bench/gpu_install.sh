#!/bin/bash
# vLLM (CUDA build) and shardrl's own dependencies on a GPU node that reaches no package index, from local wheels.
#
#   bash bench/gpu_install.sh fetch DIR            where pip reaches an index: download the pinned wheels into DIR
#   bash bench/gpu_install.sh split DIR OUT        cut DIR into folders OUT/p1.. and OUT/d1.. of at most ~60 MiB each
#   bash bench/gpu_install.sh stash FOLDER         on the GPU node: add one folder's files to the stash
#   bash bench/gpu_install.sh slim DIR OUT         where the wheels are: a Hopper-only vLLM tree, packed with zstd
#                                                  into two parts OUT/s1, OUT/s2 (two calls of 64 MiB instead of five)
#   bash bench/gpu_install.sh install              on the GPU node: join, verify, install the stash into SITE
#   bash bench/gpu_install.sh install-slim         on the GPU node: the same from s1, s2 and the d* folders
#   bash bench/gpu_install.sh deps                 on the GPU node: install the stash's other wheels, no vLLM (the
#                                                  trainer and publish benches need only shardrl's own: folders d*)
#   source "$SITE/env.sh"                          then: python3 -c "import vllm"
#
# The pins (bench/gpu_wheels.txt) are vLLM 0.26.0, the release built for torch 2.11.0, and the versions pip resolves
# for it against an image that already holds torch 2.11.0+cu130, torchvision, torchaudio, transformers, numpy, numba
# and Triton 3.6: those, and vLLM's optional kernel packages (cutlass-dsl, tilelang, quack, tokenspeed, ...), are
# not in the list.  The vLLM wheel (290 MiB) is cut into parts when it has to travel in pieces; `install` joins the
# parts and checks the whole wheel's sha256 before anything is installed.  Everything goes to SITE with
# `pip --no-index --no-deps --target`, so the image's own packages are never replaced.
set -euo pipefail
STASH=${SHARDRL_WHEEL_STASH:-/root/shardrl-wheels}
SITE=${SHARDRL_GPU_SITE:-/root/shardrl-site}
HERE=$(cd "$(dirname "$0")" && pwd)
VLLM_WHEEL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_SHA256=adb1e4c9b46d0dfdb094121ae5aad670a42412dd813ed4e5db069ed6a15006de
SLIM=vllm-0.26.0-sm90.tar.zst
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)

imports_vllm() {  # the check both installs end with: vLLM imports from SITE, beside the image's torch
    # shellcheck disable=SC1091
    source "$SITE/env.sh"
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.version.cuda)"
}

case ${1:-} in
fetch)
    DIR=${2:?usage: gpu_install.sh fetch DIR}
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DIR" -r "$HERE/gpu_wheels.txt"
    echo "$(ls "$DIR" | wc -l) wheels in $DIR"
    ;;
split)
    DIR=${2:?usage: gpu_install.sh split DIR OUT}
    OUT=${3:?usage: gpu_install.sh split DIR OUT}
    mkdir -p "$OUT"
    split -b 60M -d -a 1 "$DIR/$VLLM_WHEEL" "$OUT/$VLLM_WHEEL.part"
    for f in "$OUT/$VLLM_WHEEL".part*; do p="$OUT/p$((${f##*part} + 1))"; mkdir -p "$p"; mv "$f" "$p/"; done
    n=1 size=0 limit=$((56 << 20))
    mkdir -p "$OUT/d1"
    for f in $(ls -S "$DIR"/*.whl | grep -v "/$VLLM_WHEEL\$"); do
        s=$(stat -c %s "$f")
        if ((size + s > limit)); then n=$((n + 1)) size=0; mkdir -p "$OUT/d$n"; fi
        cp "$f" "$OUT/d$n/"
        size=$((size + s))
    done
    du -sh "$OUT"/*
    ;;
stash)
    FOLDER=${2:?usage: gpu_install.sh stash FOLDER}
    mkdir -p "$STASH"
    cp "$FOLDER"/* "$STASH/"
    echo "stash: $(ls "$STASH" | wc -l) files, $(du -sh "$STASH" | cut -f1)"
    ;;
slim)
    # What a Hopper GPU (H100, H200) never loads: FlashAttention 2's kernels (vLLM picks FA3 on SM90 unless a model
    # uses ALiBi, which Qwen2 does not), the Rust HTTP front end (used only with VLLM_USE_RUST_FRONTEND), the CUDA
    # headers of DeepGEMM's and the SM100 attention's JIT (FP8 and Blackwell), and other Pythons' builds.
    DIR=${2:?usage: gpu_install.sh slim DIR OUT}
    OUT=${3:?usage: gpu_install.sh slim DIR OUT}
    tree=$(mktemp -d)
    unzip -q "$DIR/$VLLM_WHEEL" -d "$tree"
    rm -rf "$tree"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$tree"/vllm/vllm-rs \
        "$tree"/vllm/third_party/deep_gemm/include "$tree"/vllm/third_party/fmha_sm100/cutlass
    find "$tree"/vllm/third_party -name '*.cpython-3*.so' ! -name '*cpython-312*' -delete
    mkdir -p "$OUT/s1" "$OUT/s2"
    tar -C "$tree" -cf - . | zstd -q -T0 -19 --long=30 -o "$OUT/$SLIM"
    rm -rf "$tree"
    (cd "$OUT" && sha256sum "$SLIM" >"s1/$SLIM.sha256")
    split -n 2 -d -a 1 "$OUT/$SLIM" "$OUT/$SLIM.part"
    mv "$OUT/$SLIM.part0" "$OUT/s1/" && mv "$OUT/$SLIM.part1" "$OUT/s2/" && rm "$OUT/$SLIM"
    du -sh "$OUT"/s1 "$OUT"/s2
    ;;
install-slim)
    bash "$HERE/gpu_install.sh" deps
    cd "$STASH"
    cat "$SLIM".part* >"$SLIM"
    sha256sum -c --quiet "$SLIM.sha256" || {
        echo "gpu_install: $STASH/$SLIM: sha256 mismatch (a part missing or damaged); stash s1 and s2 again" >&2
        rm -f "$SLIM"
        exit 1
    }
    # the zstandard module `deps` installed, so that the node needs no zstd binary
    PYTHONPATH=$SITE python3 -c "
import sys, tarfile, zstandard
with open(sys.argv[1], 'rb') as f, zstandard.ZstdDecompressor(max_window_size=1 << 31).stream_reader(f) as z:
    tarfile.open(fileobj=z, mode='r|').extractall(sys.argv[2], filter='data')
" "$SLIM" "$SITE"
    rm -f "$SLIM" "$SLIM".part*
    imports_vllm
    ;;
install)
    cd "$STASH"
    if ! [ -f "$VLLM_WHEEL" ]; then
        cat "$VLLM_WHEEL".part* >"$VLLM_WHEEL.tmp"
        mv "$VLLM_WHEEL.tmp" "$VLLM_WHEEL"
    fi
    echo "$VLLM_SHA256  $VLLM_WHEEL" | sha256sum -c --quiet || {
        echo "gpu_install: $STASH/$VLLM_WHEEL: sha256 mismatch (a part missing or damaged); stash again" >&2
        rm -f "$VLLM_WHEEL"
        exit 1
    }
    rm -f "$VLLM_WHEEL".part*
    bash "$HERE/gpu_install.sh" site ./*.whl
    imports_vllm
    ;;
deps)
    cd "$STASH"
    # shellcheck disable=SC2046
    bash "$HERE/gpu_install.sh" site $(ls ./*.whl | grep -v "/$VLLM_WHEEL\$")
    # shellcheck disable=SC1091
    source "$SITE/env.sh"
    python3 -c "import pydantic, zstandard, watchdog; print('shardrl dependencies installed without vLLM')"
    ;;
site)
    shift
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$@"
    cat >"$SITE/env.sh" <<EOF
export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}
# vLLM's FlashInfer sampler compiles its kernels on first use; shardrl asks for processed logprobs, which that
# sampler cannot give, so it is never the one used: skip its probe.
export VLLM_USE_FLASHINFER_SAMPLER=0
EOF
    ;;
*)
    sed -n 2,8p "$0"
    exit 2
    ;;
esac
