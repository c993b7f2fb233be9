#!/usr/bin/env bash
# The shipped recipe (models/README.md): the converted Clover (LoRA, conversion objective) and its
# autoregressive peer (the same base, LoRA, next-token loss) on the same step batches, in two phases each:
#   1. STEPS1 steps of TOKENS1 clean tokens per row, lr 5e-4 (cosine);
#   2. a warm start from phase 1 (fresh optimizer, 10 warm-up steps, seed 1): STEPS2 steps of TOKENS2, lr 2e-4.
# Then the shipped folders and the evaluation. Defaults are the run that made the shipped adapters on one
# H200 (CUDA when available, bf16 autocast); on this 2-core CPU the same run takes days, so set smaller
# STEPS1/STEPS2 there. Resumable: rerun after an interruption and each phase continues from its last
# checkpoint. `clover train --recipe distill --init-adapter models/smollm2-clover` trains further on the
# model's own right answers.
set -euo pipefail
cd "$(dirname "$0")/.."
CLOVER=.venv/bin/clover
STEPS1=${STEPS1:-387} TOKENS1=${TOKENS1:-4000} STEPS2=${STEPS2:-91} TOKENS2=${TOKENS2:-8000}
COMMON=(--recipe convert --eval-every 100 --checkpoint-every 20 ${THREADS:+--threads "$THREADS"})
mkdir -p runs
resume() { [ -d "$1/checkpoint" ] && echo --resume || true; }
for arch in clover ar; do
  run=runs/convert-$arch
  $CLOVER train "${COMMON[@]}" --arch $arch --out $run-1 --max-steps "$STEPS1" --tokens-per-step "$TOKENS1" \
    $(resume $run-1) >> $run-1.out 2>&1
  $CLOVER train "${COMMON[@]}" --arch $arch --out $run-2 --max-steps "$STEPS2" --tokens-per-step "$TOKENS2" \
    --init-adapter $run-1/adapter --lr 2e-4 --warmup-steps 10 --seed 1 $(resume $run-2) >> $run-2.out 2>&1
done
for pair in "convert-clover smollm2-clover" "convert-ar smollm2-peer"; do
  set -- $pair
  rm -rf "models/$2" && cp -r "runs/$1-2/adapter" "models/$2"
  cat "runs/$1-1/train_log.jsonl" "runs/$1-2/train_log.jsonl" > "models/$2/train_log.jsonl"
done
.venv/bin/python scripts/eval_convert.py --model models/smollm2-clover --peer models/smollm2-peer \
  --n 20 --peer-n 20 --json models/smollm2-clover/eval.json
