#!/bin/sh
# singleton file gate: run "$@" only while the sidecar says this replica leads.
# Needs only /bin/sh, sleep, kill and /proc/uptime (no date, no synchronised clock).
# The sidecar keeps in "$dir":
#   leader    "<token> <deadline> <grace>" while this replica may act; deadline on the node's
#             boot-time clock in centiseconds (as /proc/uptime), rewritten on every renewal;
#             grace: centiseconds from SIGTERM to SIGKILL
#   draining  the term is draining: stop the app and let it finish, without a kill
#   stop      a nonce; this script copies it into "$dir/idle" once no gated process runs,
#             which is how the sidecar knows the app has stopped ("exited" once this script
#             has stopped the app and exited for good)
# On SIGTERM (its container is stopping) this script writes "$dir/draining.requested", so
# the sidecar hands the term over, stops the app and exits.
dir=${SINGLETON_GATE_DIR:-$(dirname "$0")}
grace=100
child=""
stopping=0
trap 'stopping=1' TERM INT

now_cs() {
  read -r up _ < /proc/uptime
  echo $(( ${up%.*} * 100 + 1${up#*.} - 100 ))
}

# True while the flag is there, not draining, and its deadline has not passed.
leading() {
  [ -f "$dir/leader" ] && [ ! -f "$dir/draining" ] || return 1
  read -r token deadline flag_grace < "$dir/leader" 2>/dev/null || return 1
  [ -n "$flag_grace" ] && grace=$flag_grace
  [ -n "$deadline" ] && [ "$(now_cs)" -lt "$deadline" ] || return 1
  SINGLETON_TOKEN=$token
  export SINGLETON_TOKEN
}

# True while the term may still act (draining included): the app is not killed then.
may_finish() {
  [ -f "$dir/leader" ] && [ -f "$dir/draining" ] || return 1
  read -r _ deadline _ < "$dir/leader" 2>/dev/null || return 1
  [ -n "$deadline" ] && [ "$(now_cs)" -lt "$deadline" ]
}

acked=""
acknowledge() {
  nonce=""
  read -r nonce < "$dir/stop" 2>/dev/null
  [ "$nonce" = "$acked" ] && [ -f "$dir/idle" ] && return 0
  printf '%s\n' "$nonce" > "$dir/idle.tmp" && mv -f "$dir/idle.tmp" "$dir/idle" && acked=$nonce
}

# The app runs in a process group of its own where the image has setsid (util-linux, busybox),
# so the children it starts are stopped with it; without setsid only the app process is signalled.
own_group=0
start_app() {
  if command -v setsid >/dev/null 2>&1; then own_group=1; setsid "$@" & else own_group=0; "$@" & fi
  child=$!
}

# True while a process of the app's group is alive (zombies waiting to be reaped do not count).
app_alive() {
  if [ "$own_group" = 0 ]; then kill -0 "$child" 2>/dev/null; return; fi
  for stat in /proc/[0-9]*/stat; do
    read -r line 2>/dev/null < "$stat" || continue
    # shellcheck disable=SC2086
    set -- ${line##*) }
    [ "$3" = "$child" ] && [ "$1" != Z ] && return 0
  done
  return 1
}
signal_app() {
  kill "-$1" "-$child" 2>/dev/null || kill "-$1" "$child" 2>/dev/null
}

stop_child() {
  [ -n "$child" ] || return 0
  signal_app TERM
  kill_at=""
  while app_alive; do
    # Draining waits for the app; a term that ended (or whose deadline passed) kills after the grace.
    if ! may_finish; then
      [ -z "$kill_at" ] && kill_at=$(( $(now_cs) + grace ))
      [ "$(now_cs)" -ge "$kill_at" ] && signal_app KILL
    fi
    sleep 0.05
  done
  wait "$child" 2>/dev/null
  child=""
}

rm -f "$dir/draining.requested"
acknowledge
while :; do
  if [ "$stopping" = 1 ]; then
    : > "$dir/draining.requested"
    stop_child
    # Whatever the sidecar asks from now on, no gated process will run: say so for good.
    printf 'exited\n' > "$dir/idle.tmp" && mv -f "$dir/idle.tmp" "$dir/idle"
    exit 0
  fi
  if [ -n "$child" ] && ! app_alive; then
    wait "$child" 2>/dev/null  # the app and everything it started have exited
    child=""
  fi
  if leading; then
    if [ -z "$child" ]; then
      rm -f "$dir/idle"
      start_app "$@"
    fi
  else
    stop_child
    acknowledge
  fi
  sleep 0.1
done
