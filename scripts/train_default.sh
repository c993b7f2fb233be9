#!/usr/bin/env bash
# The recipe that made models/clover-tiny and its autoregressive peer models/qwen3.5-moe-tiny (2-core
# CPU, both runs at once, one thread each, same steps and the same batches: the batch for step s is a
# pure function of seed and s). Then the bf16 export, the evaluations and the calibration.
set -euo pipefail
cd "$(dirname "$0")/.."
CLOVER=.venv/bin/clover
STEPS=${STEPS:-1600}
mkdir -p runs
if [ -z "${TOKENIZER:-}" ]; then  # the byte-level BPE with three-digit number tokens, about 20 s
  TOKENIZER=runs/tokenizer
  $CLOVER tokenizer --out "$TOKENIZER"
fi
$CLOVER train --preset clover-tiny --recipe default --max-steps "$STEPS" --threads 1 \
  --tokenizer "$TOKENIZER" --out runs/clover-tiny > runs/clover-tiny.out 2>&1 &
$CLOVER train --arch qwen3.5-moe --preset clover-tiny --recipe default --max-steps "$STEPS" --threads 1 \
  --tokenizer "$TOKENIZER" --out runs/qwen3.5-moe-tiny > runs/qwen3.5-moe-tiny.out 2>&1 &
wait
.venv/bin/python scripts/export_model.py runs/clover-tiny models/clover-tiny
.venv/bin/python scripts/export_model.py runs/qwen3.5-moe-tiny models/qwen3.5-moe-tiny
$CLOVER eval --model models/clover-tiny --n 20 --block-size 1 --json models/clover-tiny/eval_b1.json
$CLOVER eval --model models/qwen3.5-moe-tiny --n 20 --json models/qwen3.5-moe-tiny/eval.json
$CLOVER calibrate --model models/clover-tiny
.venv/bin/python scripts/eval_by_messages.py --messages 1 2 4 8 20 --n 20 --out models/eval_by_messages.json
