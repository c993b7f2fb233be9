#!/usr/bin/env bash
# The memory graft's training (issue 30; src/cloverlm/training/graft/): STAGE 1 fits each grafted memory layer
# to the teacher's attention, layer by layer (stage1.py); STAGE 2 trains the whole graft on logit KL against
# the teacher (stage2.py), from stage 1's student. MINUTES of training, resumed from the last checkpoint when
# there is one; the schedule spans STEPS steps in all (stage 1: 4900, 5M tokens at 2 rows of 512; stage 2:
# 2000), so several sessions make one run. Runs in the background and returns; the log is $OUT/stage.out, the
# curve $OUT/stage1_loss.png or $OUT/stage2_kl.png, the trained student $OUT/student. Stage 1 grafts the
# student first if it is missing. Extra arguments go to `clover train` (e.g. --rows-per-step 4, --device cuda).
#   scripts/graft.sh 1 120                 # two hours of stage 1 in the background
#   FOREGROUND=1 scripts/graft.sh 2 10     # wait for it
#   TEACHER=models/smollm2-clover STUDENT=runs/graft/hybrid OUT=runs/graft-stage1 STEPS=4900 scripts/graft.sh 1 60
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?usage: scripts/graft.sh STAGE MINUTES [clover train options]}
MINUTES=${2:?usage: scripts/graft.sh STAGE MINUTES [clover train options]}
shift 2
case "$STAGE" in
  1) STUDENT=${STUDENT:-runs/graft/hybrid}; STEPS=${STEPS:-4900} ;;
  2) STUDENT=${STUDENT:-runs/graft-stage1/student}; STEPS=${STEPS:-2000} ;;
  *) echo "STAGE is 1 or 2, got $STAGE" >&2; exit 2 ;;
esac
TEACHER=${TEACHER:-models/smollm2-clover}
OUT=${OUT:-runs/graft-stage$STAGE}
mkdir -p "$OUT"
source scripts/background.sh
refuse_if_training
make -s venv
if [ "$STAGE" = 1 ] && [ ! -f "$STUDENT/model.safetensors" ]; then
  .venv/bin/clover convert --graft memory --source "$TEACHER" --out "$STUDENT" 2>&1 | tee -a "$OUT/stage.out"
fi
if [ ! -f "$STUDENT/model.safetensors" ]; then
  echo "no student at $STUDENT: run stage 1 first (scripts/graft.sh 1 MINUTES)" >&2
  exit 2
fi
RESUME=()
if [ -f "$OUT/checkpoint/train_state.json" ] || [ -f "$OUT/checkpoint.old/train_state.json" ]; then
  RESUME=(--resume)
fi
# --minutes beside --max-steps is a wall-clock limit on this call; the cosine schedule spans all STEPS
launch "$OUT" "$OUT/stage.out" "graft stage $STAGE" .venv/bin/clover train --recipe "graft-stage$STAGE" --teacher "$TEACHER" \
  --student "$STUDENT" --out "$OUT" --max-steps "$STEPS" --minutes "$MINUTES" --threads "$(nproc)" "${RESUME[@]}" "$@"
echo "$OUT/train_log.jsonl has a line a step"
