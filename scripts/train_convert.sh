#!/usr/bin/env bash
# The shipped recipe: the converted Clover (LoRA, conversion objective) and its autoregressive peer (the
# same base, LoRA, next-token loss on the same examples and steps), one after the other (two cores), then
# the shipped folders and the conversion issue's evaluation. Resumable: rerun after an interruption
# and each run continues from its last checkpoint (every 10 steps).
set -euo pipefail
cd "$(dirname "$0")/.."
CLOVER=.venv/bin/clover
STEPS=${STEPS:-200}
mkdir -p runs
resume() { [ -d "$1/checkpoint" ] && echo --resume || true; }
$CLOVER train --recipe convert --out runs/convert --threads 2 --max-steps "$STEPS" $(resume runs/convert) \
  >> runs/convert.out 2>&1
$CLOVER train --recipe convert --arch ar --out runs/convert-peer --threads 2 --max-steps "$STEPS" \
  $(resume runs/convert-peer) >> runs/convert-peer.out 2>&1
for pair in "convert smollm2-clover" "convert-peer smollm2-peer"; do
  set -- $pair
  rm -rf "models/$2" && cp -r "runs/$1/adapter" "models/$2" && cp "runs/$1/train_log.jsonl" "models/$2/"
done
.venv/bin/python scripts/eval_convert.py --model models/smollm2-clover --peer models/smollm2-peer \
  --n 20 --peer-n 20 --json models/smollm2-clover/eval.json
