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
source scripts/background.sh
refuse_if_training
make -s venv
launch "$OUT" "$OUT/campaign.out" campaign .venv/bin/clover campaign --minutes "$MINUTES" --out "$OUT" --threads "$(nproc)" "$@"
echo "$OUT/smollm2-clover/train_log.jsonl has a line a step"
