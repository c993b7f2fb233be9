#!/usr/bin/env bash
# GPU window with WHAT=graft, step 4 (here, after the calls and `prepare.sh end`): the memory graft's student
# rebuilt from what calls 2 and 3 returned (each reply's files_at folder; call 3 only where call 2 printed
# CALL 3 NEEDED): the teacher grafted again, the trained mixers joined (split.py: every piece there, none
# twice) and put in (run_graft.py rebuild: keys, shapes and the teacher's digest checked), each stage's log
# and curve beside it. Then it prints what reads the student next.
#   [OUT=runs/gpu-graft] [TEACHER=models/smollm2-clover] scripts/gpu_window/collect_graft.sh FILES_AT_2 [FILES_AT_3]
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: collect_graft.sh FILES_AT_OF_CALL_2 [FILES_AT_OF_CALL_3]" >&2; exit 2; }
OUT=${OUT:-runs/gpu-graft}
TEACHER=${TEACHER:-models/smollm2-clover}
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1
[ -f "$1/graft_meta.tar.gz" ] || { echo "no graft_meta.tar.gz in $1 (call 2's files_at comes first)" >&2; exit 1; }
if [ -e "$OUT/student" ] && [ -z "${FORCE:-}" ]; then
  echo "$OUT/student exists: choose another OUT, or FORCE=1 to replace it" >&2; exit 1
fi
mkdir -p "$OUT"
tar -xzf "$1/graft_meta.tar.gz" -C "$OUT"
[ ! -f "$1/device.log" ] || cp "$1/device.log" "$OUT/device.log"
pieces=$(mktemp -d)
trap 'rm -rf "$pieces"' EXIT
for files_at in "$@"; do  # the pieces of every call side by side (read-only folders: linked, not moved)
  for piece in "$files_at"/mixers/mixers-*.safetensors; do
    [ -e "$piece" ] && ln -s "$(realpath "$piece")" "$pieces/"
  done
done
"$PY" scripts/gpu_window/split.py join "$pieces" "$OUT/mixers.safetensors" --prefix mixers --dtype fp32 \
  || { echo "the mixers do not join: every piece must come back (call 3's files_at too, where call 2 printed CALL 3 NEEDED)" >&2; exit 1; }
rm -rf "$OUT/student"
"$PY" scripts/gpu_window/run_graft.py rebuild "$TEACHER" "$OUT/mixers.safetensors" "$OUT/student"
echo
echo "$OUT/student: the mixers of $(cat "$OUT/student_from") (on the GPU machine); curves: $OUT/stage*/*.png. Next:"
if grep -q stage2 "$OUT/student_from"; then  # the selection ran there: its scores are in $OUT/select
  echo "  STUDENT=$OUT/student OUT=runs/graft-stage2 scripts/graft.sh 2 MINUTES   # stage 2 goes on here (a fresh run)"
else  # stage 1's all-memory student: the selection and stage 2 are still to do
  echo "  STUDENT=$OUT/student scripts/graft.sh select   # which layers stay attention, then scripts/graft.sh 2 MINUTES"
fi
echo "  .venv/bin/clover bench --sections context_scaling --hybrid $OUT/student     # what the memory buys"
