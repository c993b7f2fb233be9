#!/usr/bin/env bash
# The GPU check of issue 6: the CUDA tests (fla's fused kernel against the pure-PyTorch reference), then
# training and batch-1 decoding speed of clover-1b-a0.3b (random init, bf16) on one GPU, as JSON.
#
#   scripts/gpu_check.sh [OUT.json]     # default bench/results/<date>-<gpu>.json
#
# Uses $PYTHON when given (an environment that already has CUDA torch and flash-linear-attention),
# else the venv $VENV (default .venv-cuda), created and filled with `pip install -e ".[cuda]"` when
# it lacks them. Never the CPU .venv: fla installed there breaks transformers' CPU fallback.
# The measurement is capped at 6 minutes (SECONDS_BUDGET of measuring, plus model building).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-}
SECONDS_BUDGET=${SECONDS_BUDGET:-300}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
else
  VENV=${VENV:-.venv-cuda}
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 1
  PY=$VENV/bin/python
fi
if ! "$PY" -c "import torch, fla, cloverlm, pytest" 2>/dev/null; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0  # the default index's Linux wheel is the CUDA build
  "$PY" -m pip install -q -e ".[cuda]" pytest || exit 1
fi
"$PY" - <<'PY' || exit 1
import torch
from cloverlm.ops import fla_backend
assert torch.cuda.is_available(), "torch sees no CUDA device"
assert fla_backend.fla_chunk_function() is not None, "flash-linear-attention does not import"
print(f"{torch.cuda.get_device_name()} torch {torch.__version__} fla {fla_backend.fla_version()}")
PY

"$PY" -m pytest tests/test_cuda.py -q -p no:cacheprovider -rs 2>&1 | tee /tmp/clover_gpu_check_pytest.log
tests_rc=${PIPESTATUS[0]}
summary=$(grep -E "passed|failed|error" /tmp/clover_gpu_check_pytest.log | tail -1)

timeout 360 "$PY" scripts/gpu_check.py --device cuda --preset clover-1b-a0.3b --seconds "$SECONDS_BUDGET" \
  --pytest-summary "$summary" ${OUT:+--out "$OUT"}
bench_rc=$?
if [ "$tests_rc" -ne 0 ]; then
  echo "tests/test_cuda.py failed (exit $tests_rc): see above" >&2
  exit "$tests_rc"
fi
exit "$bench_rc"
