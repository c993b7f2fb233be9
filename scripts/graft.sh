#!/usr/bin/env bash
# The memory graft, from the all-attention model to a trained hybrid (issue 30; src/cloverlm/training/graft/).
#   scripts/graft.sh 1 MINUTES [clover train options]   stage 1: every attention layer of TEACHER grafted to
#       memory (GRAFT, made when missing), each memory layer fitted to its attention (stage1.py), in OUT
#   scripts/graft.sh select [graft-select options]      the KEEP layers that go back to attention, scored by KL and
#       recall (select.py), in runs/graft-select; its hybrid (stage 1's mixers kept) in runs/graft-select/hybrid
#   scripts/graft.sh 2 MINUTES [clover train options]   stage 2: that hybrid on logit KL against TEACHER (stage2.py)
#   scripts/graft.sh all MINUTES [graft-select options] the three in turn, each resumed where it stopped or skipped
#       when done, within MINUTES of wall clock: the one command that builds the hybrid on a fresh clone
#   scripts/graft.sh continue MINUTES [clover train options]  the CPU campaign's step for a published hybrid
#       (HYBRID=models/smollm2-clover-hybrid): stage 1, then stage 2, each continued where the folder's record
#       stopped (on any machine) and published back into it with every checkpoint
# Stages 1 and 2 train MINUTES and resume from their last checkpoint; the schedule spans STAGE1_STEPS (4900: 5M
# tokens at 2 rows of 512) or STAGE2_STEPS (2000) steps, so several sessions make one run. They run in the
# background (FOREGROUND=1: wait) with the log in $OUT/stage.out, the curve in $OUT/stage1_loss.png or
# $OUT/stage2_kl.png and the trained student in $OUT/student. Settings by environment:
#   TEACHER=models/smollm2-clover  RUNS=runs (the root of every folder here)  GRAFT=$RUNS/graft/all-memory  KEEP=8
#   STAGE1_STEPS=4900  STAGE2_STEPS=2000  OUT=$RUNS/graft-stage{1,2} (stages 1 and 2 alone)
#   STUDENT=... (stage 1: GRAFT; select: stage 1's student; stage 2: the selection's hybrid)
#   PUBLISH=DIR: stages 1 and 2 also write the student as a graft folder (convert/graft_folder.py) with every
#       checkpoint; given as STUDENT on another machine, the stage's run continues from it (fresh Adam moments)
# Stage 1 is layer-local, so it may also train some layers at a time (--layers): models/README.md's run
# trained the every-fourth hybrid's 23 memory layers first, then grafted and trained the other 7.
set -euo pipefail
cd "$(dirname "$0")/.."
USAGE="usage: scripts/graft.sh 1|2 MINUTES [clover train options] | select [graft-select options] | all MINUTES [graft-select options] | continue MINUTES [clover train options]"
WHAT=${1:?$USAGE}
shift
TEACHER=${TEACHER:-models/smollm2-clover}
RUNS=${RUNS:-runs}
GRAFT=${GRAFT:-$RUNS/graft/all-memory}
SELECTION=$RUNS/graft-select
KEEP=${KEEP:-8}
STAGE1_STEPS=${STAGE1_STEPS:-4900}
STAGE2_STEPS=${STAGE2_STEPS:-2000}
source scripts/background.sh

finished() {  # OUT: true when OUT's checkpoint has taken every step of its schedule
  .venv/bin/python - "$1/checkpoint/train_state.json" <<'EOF'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
state = json.loads(path.read_text())["state"] if path.is_file() else None
sys.exit(0 if state and state["step"] >= state["max_steps"] else 1)
EOF
}

is_student() {  # FOLDER: true when FOLDER holds a model, as weights or as a graft folder (convert/graft_folder.py)
  [ -f "$1/model.safetensors" ] || [ -f "$1/clover_graft.json" ]
}

published_step() {  # FOLDER RECIPE: the step of RECIPE's run that graft folder FOLDER records, -1 for none
  .venv/bin/python - "$1/clover_graft.json" "$2" <<'EOF'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1])
runs = json.loads(path.read_text())["runs"] if path.is_file() else {}
print(runs[sys.argv[2]]["state"]["step"] if sys.argv[2] in runs else -1)
EOF
}

stage_command() {  # STAGE MINUTES [options]: sets OUT and CMD, the `clover train` call of the stage
  local stage=$1 minutes=$2 student steps
  shift 2
  OUT=${OUT_OVERRIDE:-$RUNS/graft-stage$stage}
  if [ "$stage" = 1 ]; then
    student=${STUDENT:-$GRAFT}; steps=$STAGE1_STEPS
    if [ ! -f "$OUT/checkpoint/train_state.json" ] && ! is_student "$student"; then
      mkdir -p "$OUT"
      .venv/bin/clover convert --graft memory --source "$TEACHER" --memory-layers all --out "$student" 2>&1 | tee -a "$OUT/stage.out"
    fi
  else
    student=${STUDENT:-$SELECTION/hybrid}; steps=$STAGE2_STEPS
  fi
  if ! is_student "$student" && [ ! -f "$OUT/checkpoint/train_state.json" ]; then
    echo "no student at $student: run the stage before it first ($USAGE)" >&2
    exit 2
  fi
  mkdir -p "$OUT"
  local run_flags=()
  if [ -f "$OUT/checkpoint/train_state.json" ] || [ -f "$OUT/checkpoint.old/train_state.json" ] \
     || [ "$(published_step "$student" "graft-stage$stage")" -ge 0 ]; then
    run_flags=(--resume)
  fi
  [ -z "${PUBLISH:-}" ] || run_flags+=(--publish "$PUBLISH")
  # --minutes beside --max-steps is a wall-clock limit on this call; the cosine schedule spans all the steps
  CMD=(.venv/bin/clover train --recipe "graft-stage$stage" --teacher "$TEACHER" --student "$student" --out "$OUT"
       --max-steps "$steps" --minutes "$minutes" --threads "$(nproc)" "${run_flags[@]}" "$@")
}

select_command() {  # [options]: sets CMD, the graft-select call on stage 1's student
  local student=${STUDENT:-$RUNS/graft-stage1/student}
  if ! is_student "$student"; then
    echo "no stage-1 student at $student: run stage 1 first (scripts/graft.sh 1 MINUTES)" >&2
    exit 2
  fi
  mkdir -p "$SELECTION"
  CMD=(.venv/bin/clover graft-select --teacher "$TEACHER" --student "$student" --keep "$KEEP" --save-hybrid
       --out "$SELECTION" --threads "$(nproc)" "$@")
}

OUT_OVERRIDE=${OUT:-}
refuse_if_training
make -s venv
case "$WHAT" in
  1|2)
    MINUTES=${1:?$USAGE}
    shift
    stage_command "$WHAT" "$MINUTES" "$@"
    launch "$OUT" "$OUT/stage.out" "graft stage $WHAT" "${CMD[@]}"
    echo "$OUT/train_log.jsonl has a line a step"
    ;;
  select)
    select_command "$@"
    launch "$SELECTION" "$SELECTION/select.out" "graft layer selection" "${CMD[@]}"
    ;;
  all)
    MINUTES=${1:?$USAGE}
    shift
    if [ -z "${FOREGROUND:-}" ]; then  # the whole chain in the background, one pid for refuse_if_training
      mkdir -p "$RUNS/graft-all"
      launch "$RUNS/graft-all" "$RUNS/graft-all/all.out" "the graft, stage 1 to stage 2" env FOREGROUND=1 "$0" all "$MINUTES" "$@"
      exit 0
    fi
    OUT_OVERRIDE=""; unset STUDENT  # each stage's own folders
    deadline=$(( $(date +%s) + 60 * MINUTES ))
    left() { echo $(( (deadline - $(date +%s)) / 60 )); }
    finished "$RUNS/graft-stage1" || { stage_command 1 "$(left)"; "${CMD[@]}"; }
    finished "$RUNS/graft-stage1" || { echo "stage 1 goes on: run scripts/graft.sh all MINUTES again"; exit 0; }
    [ -f "$SELECTION/hybrid/model.safetensors" ] || { select_command "$@"; "${CMD[@]}"; }
    [ "$(left)" -ge 1 ] || { echo "time is up before stage 2: run scripts/graft.sh all MINUTES again"; exit 0; }
    stage_command 2 "$(left)"
    "${CMD[@]}"
    finished "$RUNS/graft-stage2" && echo "the hybrid: $RUNS/graft-stage2/student" || echo "stage 2 goes on: run scripts/graft.sh all MINUTES again"
    ;;
  continue)
    MINUTES=${1:?$USAGE}
    shift
    HYBRID=${HYBRID:-models/smollm2-clover-hybrid}
    if [ ! -f "$HYBRID/clover_graft.json" ]; then
      echo "no graft folder at $HYBRID: build one (scripts/graft.sh all, or a stage with PUBLISH=DIR)" >&2
      exit 2
    fi
    if [ -z "${FOREGROUND:-}" ]; then
      mkdir -p "$RUNS/hybrid"
      launch "$RUNS/hybrid" "$RUNS/hybrid/continue.out" "the hybrid's stages" env FOREGROUND=1 "$0" continue "$MINUTES" "$@"
      exit 0
    fi
    # this hybrid's own run folders: a checkpoint there is of this hybrid, not of another run's student
    STUDENT=$HYBRID; PUBLISH=$HYBRID
    deadline=$(( $(date +%s) + 60 * MINUTES ))
    left() { echo $(( (deadline - $(date +%s)) / 60 )); }
    for stage in 1 2; do
      steps=$([ "$stage" = 1 ] && echo "$STAGE1_STEPS" || echo "$STAGE2_STEPS")
      if [ "$(published_step "$HYBRID" "graft-stage$stage")" -lt "$steps" ]; then
        [ "$(left)" -ge 1 ] || { echo "time is up before stage $stage: run scripts/graft.sh continue MINUTES again"; exit 0; }
        OUT_OVERRIDE=$RUNS/hybrid-stage$stage
        stage_command "$stage" "$(left)" "$@"
        "${CMD[@]}"
      fi
      if [ "$(published_step "$HYBRID" "graft-stage$stage")" -lt "$steps" ]; then
        echo "stage $stage goes on: run scripts/graft.sh continue MINUTES again"
        exit 0
      fi
    done
    echo "the hybrid's stages are done: $HYBRID"
    ;;
  *) echo "$USAGE" >&2; exit 2 ;;
esac
