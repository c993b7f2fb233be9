#!/usr/bin/env bash
# GPU window, step 4 (here, after call 2 and `prepare.sh end`): rebuild OUT/<name>/checkpoint/ from what
# call 2 returned (FILES_AT: the reply's files_at folder), verify it, and print the next command.
#   scripts/gpu_window/collect.sh FILES_AT [OUT=runs/gpu-campaign] [MODELS=the default of clover campaign]
# split.py joins each run's adapter pieces; rebuild.py checks keys and shapes against the shipped adapter,
# fits the stored config to this machine and empties the optimizer (see its header). Then:
#   .venv/bin/clover campaign --minutes 0 --out OUT     # evaluate on CPU and promote what beats models/
set -euo pipefail
cd "$(dirname "$0")/../.."
FILES_AT=${1:?usage: collect.sh FILES_AT [OUT] [MODELS]}
OUT=${2:-runs/gpu-campaign}
PY=${PY:-.venv/bin/python}
MODELS=${3:-$("$PY" -c 'from cloverlm.training.conversion.campaign import CampaignConfig; print(CampaignConfig.models)')}
DEVICE=${DEVICE:-auto}  # the --device the evaluation run will be given (clover campaign's default: auto)
export HF_HUB_OFFLINE=1
[ -f "$FILES_AT/meta.tar.gz" ] || { echo "no meta.tar.gz in $FILES_AT" >&2; exit 1; }
for name in smollm2-clover smollm2-peer; do
  if [ -e "$OUT/$name/checkpoint" ] && [ -z "${FORCE:-}" ]; then
    echo "$OUT/$name/checkpoint exists: choose another OUT, or FORCE=1 to replace it" >&2; exit 1
  fi
done
mkdir -p "$OUT"
for name in smollm2-clover smollm2-peer; do rm -rf "${OUT:?}/$name/checkpoint" "$OUT/$name/adapter"; done
tar -xzf "$FILES_AT/meta.tar.gz" -C "$OUT"
[ ! -f "$OUT/campaign.out" ] || mv "$OUT/campaign.out" "$OUT/device_campaign.out"
[ ! -f "$FILES_AT/device.log" ] || cp "$FILES_AT/device.log" "$OUT/device.log"
for name in smollm2-clover smollm2-peer; do
  [ -f "$OUT/$name/checkpoint/train_state.json" ] || { echo "$name: no checkpoint came back" >&2; exit 1; }
  "$PY" scripts/gpu_window/split.py join "$FILES_AT/$name" "$OUT/$name/checkpoint/adapter_model.safetensors" \
    --prefix adapter --dtype fp32
done
"$PY" scripts/gpu_window/rebuild.py "$FILES_AT" "$OUT" "$MODELS" "$DEVICE"
models_arg=""
[ "$MODELS" = "$("$PY" -c 'from cloverlm.paths import MODELS; print(MODELS)')" ] || models_arg=" --models $MODELS"
device_arg=""
[ "$DEVICE" = auto ] || device_arg=" --device $DEVICE"
echo
echo "next (evaluates on this CPU, then promotes what beats the shipped pair; --no-promote to only look):"
echo "  HF_HUB_OFFLINE=1 .venv/bin/clover campaign --minutes 0 --out $OUT$models_arg$device_arg"
