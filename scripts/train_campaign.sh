#!/usr/bin/env bash
# The training campaign (src/cloverlm/training/conversion/campaign.py): MINUTES of training for Clover and its peer on
# the same batches, resumed from where the last session stopped, then the fixed held-out evaluation and the
# promotion of what beats the shipped pair. Runs in the background and returns; the log is
# runs/campaign/campaign.out. Extra arguments go to `clover campaign` (e.g. --device cuda, --no-promote).
#   scripts/train_campaign.sh 120                 # two hours of training in the background
#   FOREGROUND=1 scripts/train_campaign.sh 10     # wait for it (the GPU window does)
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES=${1:?usage: scripts/train_campaign.sh MINUTES [clover campaign options]}
shift
OUT=runs/campaign
mkdir -p "$OUT"
if [ -f "$OUT/pid" ] && kill -0 "$(cat "$OUT/pid")" 2>/dev/null; then
  echo "a campaign is already running (pid $(cat "$OUT/pid")); one training at a time" >&2
  exit 1
fi
make -s venv
CMD=(.venv/bin/clover campaign --minutes "$MINUTES" --out "$OUT" --threads "$(nproc)" "$@")
export HF_HUB_OFFLINE=1
if [ -n "${FOREGROUND:-}" ]; then
  "${CMD[@]}" 2>&1 | tee -a "$OUT/campaign.out"
  exit "${PIPESTATUS[0]}"
fi
nohup "${CMD[@]}" >> "$OUT/campaign.out" 2>&1 &
echo $! > "$OUT/pid"
echo "campaign started (pid $!): tail -f $OUT/campaign.out; $OUT/smollm2-clover/train_log.jsonl has a line a step"
