#!/usr/bin/env bash
# The recipe that made models/clover-tiny and its memory-only ablation (2-core CPU, both runs at
# once, one thread each, same steps, same data). Then the shipped bf16 export and the evaluation.
set -euo pipefail
cd "$(dirname "$0")/.."
CLOVER=.venv/bin/clover
$CLOVER tokenizer --out runs/tokenizer
for preset in clover-tiny clover-tiny-memory; do
  $CLOVER train --preset "$preset" --recipe default --max-steps 700 --threads 1 \
    --tokenizer runs/tokenizer --out "runs/$preset" > "runs/$preset.out" 2>&1 &
done
wait
for preset in clover-tiny clover-tiny-memory; do
  .venv/bin/python scripts/export_model.py "runs/$preset" "models/$preset"
  $CLOVER eval --model "models/$preset" --n 20 --block-size 1 --json "models/$preset/eval_b1.json"
done
