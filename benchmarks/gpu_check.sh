#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with a CUDA GPU and a PyTorch that has CUDA:
#   1. the CUDA tests (tests/test_cuda.py and the CUDA branch of the lossless tests);
#   2. codec throughput on the GPU (commpress bench codecs --device cuda), fp32 and bf16;
#   3. whether NCCL accepts two ranks on one GPU (it refuses on current NCCL versions; the
#      tests then run NCCL with one rank and gloo with two).
# Usage: benchmarks/gpu_check.sh [tests] [bench] [nccl]   (default: all three)
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
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None,
"gpus", torch.cuda.device_count())'
} 2>&1 | tee "$OUT/env.txt"

want() { [ -z "$STAGES" ] || [[ " $STAGES " == *" $1 "* ]]; }
STAGES="$*"  # any of: tests bench nccl (default: all)

if want tests; then
python3 -m pytest -q -p no:cacheprovider --timeout 300 tests/test_cuda.py \
  "tests/test_lossless.py::test_noncontiguous_and_cuda_like_inputs" 2>&1 | tee "$OUT/pytest.log"
fi

want bench && for dtype in fp32 bf16; do
  python3 -m commpress bench codecs --device cuda --size-mb 64 --repeat 5 --dtype "$dtype" \
    --json "$OUT/codecs-cuda-$dtype.json" 2>&1 | tee "$OUT/codecs-cuda-$dtype.txt" | tail -25
done

if want nccl; then
  NCCL_DEBUG=WARN timeout 90 python3 benchmarks/nccl_one_gpu.py 2>&1 | tail -12 \
    | tee "$OUT/nccl-one-gpu.txt"
fi
