#!/usr/bin/env bash
# The recipe that made models/clover-tiny and its autoregressive peer models/qwen3.5-moe-tiny (2-core
# CPU, both runs at once, one thread each, same steps and the same batches: the batch for step s is a
# pure function of seed and s). Then the bf16 export, the evaluation and the calibration.
set -euo pipefail
cd "$(dirname "$0")/.."
CLOVER=.venv/bin/clover
TOKENIZER=${TOKENIZER:-models/clover-tiny}  # the shipped tokenizer; `clover tokenizer --out DIR` retrains one
STEPS=${STEPS:-1200}
$CLOVER train --preset clover-tiny --recipe default --max-steps "$STEPS" --threads 1 \
  --tokenizer "$TOKENIZER" --out runs/clover-tiny > runs/clover-tiny.out 2>&1 &
$CLOVER train --arch qwen3.5-moe --preset clover-tiny --recipe default --max-steps "$STEPS" --threads 1 \
  --tokenizer "$TOKENIZER" --out runs/qwen3.5-moe-tiny > runs/qwen3.5-moe-tiny.out 2>&1 &
wait
.venv/bin/python scripts/export_model.py runs/clover-tiny models/clover-tiny
.venv/bin/python scripts/export_model.py runs/qwen3.5-moe-tiny models/qwen3.5-moe-tiny
$CLOVER eval --model models/clover-tiny --n 20 --block-size 1 --json models/clover-tiny/eval_b1.json
$CLOVER calibrate --model models/clover-tiny
