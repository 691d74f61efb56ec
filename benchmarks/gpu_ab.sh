#!/usr/bin/env bash
# Two source trees side by side on one GPU machine, alternating, so that their ratios come
# from one run: the host time per call layer by layer (benchmarks/gpu_layers.py, 1024 and
# LAYERS_NUMEL elements) and the codecs on CUDA tensors (benchmarks/gpu_codecs.py, AB_DTYPES,
# AB_CODECS: default every codec, AB_REPEAT).
#   OLD=.ab/old/src OUT=results bash benchmarks/gpu_ab.sh
# OLD is the other tree's src folder (git archive REV src | tar -x -C .ab/old); the scripts
# are this tree's. Results: $OUT/{old,new}-layers-{small,large}.txt, $OUT/{old,new}-codecs.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-ab}
OLD=${OLD:?OLD must name the src folder of the other tree}
mkdir -p "$OUT"
extra=""
[ -n "${EXTRA_PATH:-}" ] && extra=":$EXTRA_PATH"
export PYTHONUNBUFFERED=1
for round in ${AB_ROUNDS:-1}; do
  for tree in old new; do
    src=src; [ "$tree" = old ] && src="$OLD"
    echo "=== $tree round $round ($(date -u +%T))"
    PYTHONPATH="$src:tests$extra" timeout "${LAYERS_S:-60}" python3 benchmarks/gpu_layers.py \
      --out "$OUT/$tree-layers-small.txt"
    PYTHONPATH="$src:tests$extra" timeout "${LAYERS_S:-60}" python3 benchmarks/gpu_layers.py \
      --numel "${LAYERS_NUMEL:-16777216}" --calls 100 --out "$OUT/$tree-layers-large.txt"
  done
  for tree in old new; do
    src=src; [ "$tree" = old ] && src="$OLD"
    echo "=== $tree codecs round $round ($(date -u +%T))"
    PYTHONPATH="$src:tests$extra" timeout "${CODECS_S:-150}" python3 benchmarks/gpu_codecs.py \
      --dtypes "${AB_DTYPES:-fp32}" ${AB_CODECS:+--codecs $AB_CODECS} \
      --repeat "${AB_REPEAT:-5}" --json "$OUT/$tree-codecs.json" | tail -n +2
  done
done
