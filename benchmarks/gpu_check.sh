#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU and a PyTorch that has CUDA.
# Stages (default: all, in this order; name some to run only those):
#   bench    every codec on CUDA tensors, fp32 and bf16, 64 MB, plus the fixed cost of a call
#            (benchmarks/gpu_codecs.py -> gpu-codecs.json)
#   triton   the Triton kernels' tests compiled for the GPU, on CUDA tensors
#            (TRITON_INTERPRET=0; the same tests CI runs in the interpreter)
#   nvcomp   lossless: nvCOMP's codecs, grouping + nvCOMP ANS and netzip on the same tensors
#            (benchmarks/nvcomp_compare.py -> nvcomp.json; needs nvidia-nvcomp-cu13/cu12)
#   why      where each codec's time goes: host (Python, launches, synchronizations) or device,
#            from torch.profiler (benchmarks/gpu_profile.py -> gpu-profile.txt)
#   python   the Python functions with the most host time per call, per codec, 1024 elements
#            (benchmarks/gpu_profile.py --python 15 -> gpu-python.txt)
#   torch    the codecs on the plain torch path (COMMPRESS_KERNELS=torch), beside the kernels
#            (-> gpu-codecs-torch.json)
#   cuda     tests/test_cuda.py (codecs, collectives, p2p and the DDP hook on GPU tensors)
#   profile  the device profile the performance model loads (--codec-speeds)
#   nccl     whether NCCL accepts two ranks on one GPU
# Results go to $OUT (default ./gpu-results). Python packages missing on the machine can be
# given as wheels in .whl/ (installed into /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  date -u
  nvidia-smi -L
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"

STAGES="$*"
want() { [ -z "$STAGES" ] || [[ " $STAGES " == *" $1 "* ]]; }
stage() { echo; echo "=== $1 ($(date -u +%T))"; }

if want bench; then
  stage bench
  timeout "${BENCH_S:-200}" python3 benchmarks/gpu_codecs.py --json "$OUT/gpu-codecs.json"
fi
if want triton; then
  stage triton
  TRITON_INTERPRET=0 timeout "${TRITON_S:-180}" python3 -m pytest -q -p no:cacheprovider \
    -n "${WORKERS:-8}" --timeout 150 -rfE tests/test_kernels_triton.py \
    tests/test_kernels_triton_fused.py tests/test_kernels_triton_select.py \
    tests/test_kernels_triton_sparse_thc.py tests/test_kernels_triton_topkc.py \
    tests/test_sparse_exponent_sync.py >"$OUT/pytest-triton.log" 2>&1
  echo "rc $?"; tail -40 "$OUT/pytest-triton.log"
fi
if want nvcomp; then
  stage nvcomp
  timeout "${NVCOMP_S:-100}" python3 benchmarks/nvcomp_compare.py --json "$OUT/nvcomp.json"
fi
if want why; then
  stage why
  timeout "${WHY_S:-150}" python3 benchmarks/gpu_profile.py --out "$OUT/gpu-profile.txt"
fi
if want python; then
  stage python
  timeout "${PYTHON_S:-120}" python3 benchmarks/gpu_profile.py --python 15 --out "$OUT/gpu-python.txt" \
    >/dev/null 2>&1; echo "rc $?"
fi
if want torch; then
  stage torch
  COMMPRESS_KERNELS=torch timeout "${TORCH_S:-90}" python3 benchmarks/gpu_codecs.py \
    --json "$OUT/gpu-codecs-torch.json" --dtypes "${TORCH_DTYPES:-fp32}"
fi
if want cuda; then
  stage cuda
  timeout "${CUDA_S:-240}" python3 -m pytest -q -p no:cacheprovider --timeout 100 -rfE \
    tests/test_cuda.py >"$OUT/pytest-cuda.log" 2>&1
  echo "rc $?"; tail -30 "$OUT/pytest-cuda.log"
fi
if want profile; then
  stage profile
  timeout "${PROFILE_S:-60}" python3 -m commpress bench codecs --device cuda \
    --profile "$OUT/profile-cuda.json" --repeat "${PROFILE_REPEAT:-3}" \
    --profile-sizes "${PROFILE_SIZES:-4096,1048576,16777216,67108864}" 2>&1 | tail -20
fi
if want nccl; then
  stage nccl
  NCCL_DEBUG=WARN timeout 90 python3 benchmarks/nccl_one_gpu.py 2>&1 | tail -12
fi
stage done
