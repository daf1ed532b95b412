#!/usr/bin/env bash
# build_llmc_gpu.sh — builds llm.c's GPU trainer (train_gpt2cu) as the peer for
# scripts/bench_gpu_vs_peers.py --llmc, with cuDNN's flash attention (as ours uses) and without MPI
# and NCCL (one GPU). Two changes llm.c needs under CUDA 13, applied to a copy, never to the checkout:
#   - cudaMemAdvise takes a cudaMemLocation, no longer a device number (llmc/cuda_utils.cuh)
#   - the newest cudnn-frontend compiles kernels at run time: link nvrtc and the driver API too
#
#   scripts/build_llmc_gpu.sh LLMC_CHECKOUT CUDNN_FRONTEND_CHECKOUT OUT_DIR [sm]
#     e.g. scripts/build_llmc_gpu.sh ~/llm.c ~/cudnn-frontend out/llmc 90
#   -> OUT_DIR/train_gpt2cu_cudnn and OUT_DIR/train_gpt2cu_nocudnn (llm.c's own attention kernels)
#
# Without a GPU here (building for a GPU machine elsewhere) name the compute capability (90 for
# H100/H200); libnvidia-ml, which llm.c links and only the GPU driver installs, is then stood in for
# at link time by an empty library of the same name, and the driver's own is used at run time.
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,13p' "$0"; exit 2; }
llmc=$(realpath "$1"); frontend=$(realpath "$2"); out=$(realpath -m "$3")
sm=${4:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.')}
[ -n "$sm" ] || { echo "error: no GPU here: name its compute capability (e.g. 90)" >&2; exit 2; }
[ -f "$llmc/train_gpt2.cu" ] || { echo "error: $llmc/train_gpt2.cu is missing: not an llm.c checkout" >&2; exit 1; }
[ -d "$frontend/include" ] || { echo "error: $frontend/include is missing: not a cudnn-frontend checkout" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$llmc/." "$work/"
ln -s "$frontend" "$work/cudnn-frontend"
sed -i 's/cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})/' \
    "$work/llmc/cuda_utils.cuh"
libs="-lcublas -lcublasLt -lnvidia-ml"
if ! ldconfig -p | grep -q libnvidia-ml.so; then
    mkdir "$work/nvml"
    echo "void nvmlInit_v2(void) {}" > "$work/nvml/stub.c"
    gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 "$work/nvml/stub.c" -o "$work/nvml/libnvidia-ml.so"
    libs="-lcublas -lcublasLt -L$work/nvml -lnvidia-ml"
fi
stubs=$(dirname "$(command -v nvcc)")/../lib64/stubs
mkdir -p "$out"
common=(GPU_COMPUTE_CAPABILITY="$sm" NO_MULTI_GPU=1 NO_USE_MPI=1)
make -C "$work" train_gpt2cu "${common[@]}" USE_CUDNN=0 NVCC_LDFLAGS="$libs"
mv "$work/train_gpt2cu" "$out/train_gpt2cu_nocudnn"
make -C "$work" train_gpt2cu "${common[@]}" USE_CUDNN=1 NVCC_LDFLAGS="$libs -lcudnn -lnvrtc -L$stubs -lcuda"
mv "$work/train_gpt2cu" "$out/train_gpt2cu_cudnn"
echo "built $out/train_gpt2cu_cudnn and $out/train_gpt2cu_nocudnn (llm.c $(git -C "$llmc" rev-parse --short HEAD 2>/dev/null || echo '?'), sm_$sm)"
