#!/usr/bin/env bash
# Stage 1 of the memory graft (issue 30; src/cloverlm/training/graft_stage1.py): MINUTES of layer-by-layer
# training of the grafted memory layers against the teacher's attention, resumed from the last checkpoint
# when there is one. The schedule spans STEPS steps in all (default 4900: 5M tokens at 2 rows of 512); each
# call trains until its MINUTES run out, then checkpoints, so that several sessions make one run. Runs in
# the background and returns; the log is $OUT/stage1.out, the loss curve per layer $OUT/stage1_loss.png, the
# trained student $OUT/student. The student is grafted first if it is missing. Extra arguments go to
# `clover train` (e.g. --rows-per-step 4, --device cuda).
#   scripts/graft_stage1.sh 120                 # two hours in the background
#   FOREGROUND=1 scripts/graft_stage1.sh 10     # wait for it
#   TEACHER=models/smollm2-clover STUDENT=runs/graft/hybrid OUT=runs/graft-stage1 STEPS=4900 scripts/graft_stage1.sh 60
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:?usage: scripts/graft_stage1.sh MINUTES [clover train options]}
shift
TEACHER=${TEACHER:-models/smollm2-clover}
STUDENT=${STUDENT:-runs/graft/hybrid}
OUT=${OUT:-runs/graft-stage1}
STEPS=${STEPS:-4900}
mkdir -p "$OUT"
source scripts/background.sh
refuse_if_training
make -s venv
if [ ! -f "$STUDENT/model.safetensors" ]; then
  .venv/bin/clover convert --graft memory --source "$TEACHER" --out "$STUDENT" 2>&1 | tee -a "$OUT/stage1.out"
fi
RESUME=()
if [ -f "$OUT/checkpoint/train_state.json" ] || [ -f "$OUT/checkpoint.old/train_state.json" ]; then
  RESUME=(--resume)
fi
# --minutes beside --max-steps is a wall-clock limit on this call; the cosine schedule spans all STEPS
launch "$OUT" "$OUT/stage1.out" "graft stage 1" .venv/bin/clover train --recipe graft-stage1 --teacher "$TEACHER" \
  --student "$STUDENT" --out "$OUT" --max-steps "$STEPS" --minutes "$MINUTES" --threads "$(nproc)" "${RESUME[@]}" "$@"
echo "$OUT/train_log.jsonl has a line a step"
