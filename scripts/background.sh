# Sourced by the scripts that train for hours (train_campaign.sh, graft.sh). The machine has two
# cores: one training at a time, whichever script started it (every such run keeps runs/<name>/pid).
#   refuse_if_training            exit 1 if a run under runs/ still has a live pid (not this shell's)
#   launch OUT LOG WHAT CMD...    CMD in the background (nohup, OUT/pid), or with FOREGROUND=1 in the
#                                 foreground, its output appended to LOG either way
refuse_if_training() {
  local pid_file
  for pid_file in runs/*/pid ${RUNS:+"$RUNS"/*/pid}; do
    # a chain of stages (graft.sh all) runs under its own pid file: it is not a second training
    if [ -f "$pid_file" ] && [ "$(cat "$pid_file")" != "$$" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
      echo "a training is already running (pid $(cat "$pid_file"), $(dirname "$pid_file")); one training at a time" >&2
      exit 1
    fi
  done
}

launch() {
  local out=$1 log=$2 what=$3
  shift 3
  export HF_HUB_OFFLINE=1
  if [ -n "${FOREGROUND:-}" ]; then
    "$@" 2>&1 | tee -a "$log"
    exit "${PIPESTATUS[0]}"
  fi
  nohup "$@" >> "$log" 2>&1 &
  echo $! > "$out/pid"
  echo "$what started (pid $!): tail -f $log"
}
