#!/bin/sh
# singleton file gate: run "$@" only while the sidecar says this replica leads.
# Needs only /bin/sh, date, sleep and kill. The sidecar keeps "$dir/leader" holding
# "<token> <expiry epoch seconds>" while this replica leads, "$dir/draining" while it
# drains; this script keeps "$dir/idle" while no gated process runs.
dir=${SINGLETON_GATE_DIR:-$(dirname "$0")}
grace_ticks=$(( ${SINGLETON_KILL_GRACE_MS:-1000} / 100 ))
child=""
stopping=0
trap 'stopping=1' TERM INT

leading() {
  [ -f "$dir/leader" ] && [ ! -f "$dir/draining" ] || return 1
  read -r token expiry < "$dir/leader" 2>/dev/null || return 1
  [ -n "$expiry" ] && [ "$(date +%s)" -lt "$expiry" ] || return 1
  SINGLETON_TOKEN=$token
  export SINGLETON_TOKEN
}

stop_child() {
  [ -n "$child" ] || return 0
  kill -TERM "$child" 2>/dev/null
  ticks=0
  while kill -0 "$child" 2>/dev/null; do
    # Draining waits for the app; a lost term kills after the grace.
    if [ ! -f "$dir/draining" ] || ! [ -f "$dir/leader" ]; then
      [ "$ticks" -ge "$grace_ticks" ] && kill -KILL "$child" 2>/dev/null
      ticks=$((ticks + 1))
    fi
    sleep 0.1
  done
  wait "$child" 2>/dev/null
  child=""
  : > "$dir/idle"
}

: > "$dir/idle"
while :; do
  if [ "$stopping" = 1 ]; then
    : > "$dir/draining.requested"
    stop_child
    exit 0
  fi
  if [ -n "$child" ] && ! kill -0 "$child" 2>/dev/null; then
    wait "$child" 2>/dev/null
    child=""
    : > "$dir/idle"
  fi
  if leading; then
    if [ -z "$child" ]; then
      rm -f "$dir/idle"
      "$@" &
      child=$!
    fi
  elif [ -n "$child" ]; then
    stop_child
  fi
  sleep 0.1
done
