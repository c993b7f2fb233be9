#!/usr/bin/env bash
# GPU window with WHAT=graft, step 4 (here, after call 2 and `prepare.sh end`): the memory graft's student
# rebuilt from what call 2 returned (FILES_AT: the reply's files_at folder): the teacher grafted again, the
# trained mixers joined (split.py) and put in (run_graft.py rebuild: keys, shapes and the teacher's digest
# checked), each stage's log and curve beside it. Then it prints what reads the student next.
#   scripts/gpu_window/collect_graft.sh FILES_AT [OUT=runs/gpu-graft] [TEACHER=models/smollm2-clover]
set -euo pipefail
cd "$(dirname "$0")/../.."
FILES_AT=${1:?usage: collect_graft.sh FILES_AT [OUT] [TEACHER]}
OUT=${2:-runs/gpu-graft}
TEACHER=${3:-models/smollm2-clover}
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
[ -f "$FILES_AT/graft_meta.tar.gz" ] || { echo "no graft_meta.tar.gz in $FILES_AT" >&2; exit 1; }
if [ -e "$OUT/student" ] && [ -z "${FORCE:-}" ]; then
  echo "$OUT/student exists: choose another OUT, or FORCE=1 to replace it" >&2; exit 1
fi
mkdir -p "$OUT"
tar -xzf "$FILES_AT/graft_meta.tar.gz" -C "$OUT"
[ ! -f "$FILES_AT/device.log" ] || cp "$FILES_AT/device.log" "$OUT/device.log"
"$PY" scripts/gpu_window/split.py join "$FILES_AT/mixers" "$OUT/mixers.safetensors" --prefix mixers --dtype fp32
rm -rf "$OUT/student"
"$PY" scripts/gpu_window/run_graft.py rebuild "$TEACHER" "$OUT/mixers.safetensors" "$OUT/student"
echo
echo "$OUT/student: the mixers of $(cat "$OUT/student_from") (on the GPU machine); curves: $OUT/stage*/*.png. Next:"
echo "  STUDENT=$OUT/student OUT=runs/graft-stage2 scripts/graft.sh 2 MINUTES   # stage 2 goes on here (a fresh run)"
echo "  .venv/bin/clover graft-select --teacher $TEACHER --student $OUT/student --out $OUT/select   # which layers stay attention"
echo "  .venv/bin/clover bench --sections context_scaling --hybrid $OUT/student     # what the memory buys"
