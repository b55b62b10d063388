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
#   wake      a FIFO: the sidecar writes a line to it after each change of the files above, so
#             this script acts on a change at once instead of at its next check
# On SIGTERM (its container is stopping) this script writes "$dir/draining.requested", so
# the sidecar hands the term over, stops the app and exits.
# What "the app" is: as PID 1 of its container (the operator's wiring) every other process of
# the container, whatever session or group it moved to (setsid, detached children, daemons);
# elsewhere only the app's process group, and a warning says so.
dir=${SINGLETON_GATE_DIR:-$(dirname "$0")}
grace=100
child=""
stopping=0
last_deadline=""
trap 'stopping=1' TERM INT
woke=0
trap 'woke=1' USR1  # the wake reader's signal (below): the flags changed since the loop looked

# Sets now to the boot-time clock in centiseconds. A variable, not "$(now_cs)": a command
# substitution forks, and on a busy node each fork is a wait for the CPU that a handover pays.
now_cs() {
  read -r up _ < /proc/uptime
  now=$(( ${up%.*} * 100 + 1${up#*.} - 100 ))
}

# True while the flag is there, not draining, and its deadline has not passed.
leading() {
  [ -f "$dir/leader" ] && [ ! -f "$dir/draining" ] || return 1
  read -r token deadline flag_grace < "$dir/leader" 2>/dev/null || return 1
  [ -n "$flag_grace" ] && grace=$flag_grace
  [ -n "$deadline" ] && last_deadline=$deadline && now_cs && [ "$now" -lt "$deadline" ] || return 1
  SINGLETON_TOKEN=$token
  export SINGLETON_TOKEN
}

# True while the term may still act (draining included): the app is not killed then.
may_finish() {
  [ -f "$dir/leader" ] && [ -f "$dir/draining" ] || return 1
  read -r _ deadline _ < "$dir/leader" 2>/dev/null || return 1
  [ -n "$deadline" ] && now_cs && [ "$now" -lt "$deadline" ]
}

# "$dir/idle" is written in place (a builtin, where mv and rm would fork): truncated, then one
# short write, so a reader sees the old line, nothing, or the new line; empty means "not idle".
acked=""
acknowledge() {
  nonce=""
  read -r nonce < "$dir/stop" 2>/dev/null
  [ "$nonce" = "$acked" ] && [ -s "$dir/idle" ] && return 0
  printf '%s\n' "$nonce" > "$dir/idle" && acked=$nonce
}

# The app runs in a session of its own where the image has setsid (util-linux, busybox), so
# the children it starts are stopped with it; without setsid only the app process is signalled.
own_group=0
start_app() {
  if command -v setsid >/dev/null 2>&1; then own_group=1; setsid "$@" 9<&- & else own_group=0; "$@" 9<&- & fi
  child=$!
}

# The session of this script (and of the subshells and sleeps it forks): never the app's,
# since the app starts in a session of its own and no process can join another session.
own_session() {
  read -r line < /proc/$$/stat
  # shellcheck disable=SC2086
  set -- ${line##*) }
  echo "$4"
}
whole_container=0
if [ "$$" = 1 ] && command -v setsid >/dev/null 2>&1; then
  whole_container=1
  session=$(own_session)
else
  echo "gate.sh: not PID 1 of a container (or no setsid): only the app's process group is stopped;" \
    "children that leave it (setsid, detached, daemons) are not. Use the exec gate there." >&2
fi

# Every live process of the PID namespace as lines "pid ppid pgrp session" (zombies waiting
# to be reaped left out).
snapshot() {
  procs=""
  for stat in /proc/[0-9]*/stat; do
    read -r line 2>/dev/null < "$stat" || continue
    pid=${stat#/proc/}; pid=${pid%/stat}
    # shellcheck disable=SC2086
    set -- ${line##*) }
    [ "$1" = Z ] || procs="$procs$pid $2 $3 $4
"
  done
}

# Processes that entered the container from outside (kubectl exec, exec probes: their parent
# is outside the PID namespace, so their ppid reads 0) and their children are not the app's.
foreign_processes() {
  foreign=" "
  grown=1
  while [ "$grown" = 1 ]; do
    grown=0
    while read -r pid ppid _; do
      case "$foreign" in *" $pid "*) continue ;; esac
      case "$ppid" in 0) [ "$pid" = "$$" ] && continue ;; *) case "$foreign" in *" $ppid "*) ;; *) continue ;; esac ;; esac
      foreign="$foreign$pid " grown=1
    done <<EOF
$procs
EOF
  done
}

# Runs "$1 <pid>" for every live process of the app and is true when there was one.
each_app_process() {
  action=$1 found=1
  snapshot
  [ "$whole_container" = 1 ] && foreign_processes
  while read -r pid _ pgrp sess; do
    [ -n "$pid" ] || continue
    if [ "$whole_container" = 1 ]; then
      [ "$pid" != "$$" ] || continue
      case "$foreign" in *" $pid "*) continue ;; esac
      [ "$sess" != "$session" ] || [ "$pid" = "$child" ] || continue
    elif [ "$own_group" = 1 ]; then
      [ "$pgrp" = "$child" ] || continue
    else
      [ "$pid" = "$child" ] || continue
    fi
    found=0
    $action "$pid"
  done <<EOF
$procs
EOF
  return $found
}
app_alive() { each_app_process : ; }

# SIGTERM once per process (some apps take a second one as "quit now"), including those the
# app starts while it stops.
termed=" "
term_once() {
  case "$termed" in *" $1 "*) return ;; esac
  termed="$termed$1 "
  kill -TERM "$1" 2>/dev/null
}
kill_now() { kill -KILL "$1" 2>/dev/null; }

stop_child() {
  [ -n "$child" ] || app_alive || return 0
  termed=" "
  kill_at=""
  while each_app_process term_once; do
    # Draining waits for the app; a term that ended (or whose deadline passed) kills after the
    # grace, counted from the deadline when it has passed already (this script may notice late).
    if ! may_finish; then
      now_cs
      if [ -z "$kill_at" ]; then
        kill_at=$(( now + grace ))
        [ -n "$last_deadline" ] && [ $(( last_deadline + grace )) -lt "$kill_at" ] && kill_at=$(( last_deadline + grace ))
      fi
      [ "$now" -ge "$kill_at" ] && each_app_process kill_now
    fi
    sleep 0.01  # only while stopping: the handover waits for the acknowledgement that follows
  done
  [ -z "$child" ] || wait "$child" 2>/dev/null
  child=""
}

# The wake pipe: held open here (fd 9, left to apps: 0-2 and low fds are theirs) for reading and
# writing, so a wake written while this script is busy waits in the pipe; read by a subshell that
# turns each line into a USR1 to this script. The subshell holds a read end only: once this
# script is gone (even killed) no writer is left, its read ends and so does it. Until the pipe
# is there (an older sidecar, not made yet, no permission) the files are checked every 0.1 s.
reader=""
open_wake_pipe() {
  [ -p "$dir/wake" ] && { command exec 9<>"$dir/wake"; } 2>/dev/null || return 0
  { exec 9<&-; while read -r _ && kill -USR1 $$ 2>/dev/null; do :; done; } < "$dir/wake" &
  reader=$!
}
open_wake_pipe

# Waits until a wake, a SIGTERM or the next check: while the app runs, the flag's deadline or
# half a second (an app that exited is started again within it), else a second; 0.1 s without
# the wake pipe. The sleep runs in the background so that a signal ends the wait; one cut short
# is killed (SIGKILL: until it has exec'd sleep, the forked shell still has this script's TERM
# trap) and reaped here, so none is left behind.
pause() {
  [ -n "$reader" ] || open_wake_pipe
  nap=100
  [ -n "$child" ] && nap=50
  [ -n "$reader" ] || nap=10
  if [ -n "$child" ] && [ -n "$last_deadline" ]; then
    now_cs
    left=$(( last_deadline - now + 1 ))
    [ "$left" -lt "$nap" ] && nap=$left
    [ "$nap" -lt 2 ] && nap=2
  fi
  # A wake or SIGTERM that came while the loop was busy ends the pause before it starts (one
  # that comes later ends the wait itself).
  [ "$woke" = 1 ] || [ "$stopping" = 1 ] && return 0
  sleep "$(( nap / 100 )).$(( nap % 100 / 10 ))$(( nap % 10 ))" &
  nap_pid=$!
  if [ "$woke" = 1 ] || [ "$stopping" = 1 ] || ! wait "$nap_pid"; then
    kill -KILL "$nap_pid" 2>/dev/null
    wait "$nap_pid" 2>/dev/null
  fi
}

rm -f "$dir/draining.requested"
acknowledge
while :; do
  woke=0  # before reading the files: a change after this wakes the next pause
  if [ "$stopping" = 1 ]; then
    : > "$dir/draining.requested"
    stop_child
    # Whatever the sidecar asks from now on, no gated process will run: say so for good.
    printf 'exited\n' > "$dir/idle"
    [ -z "$reader" ] || kill "$reader" 2>/dev/null
    exit 0
  fi
  if [ -n "$child" ] && ! app_alive; then
    wait "$child" 2>/dev/null  # the app and everything it started have exited
    child=""
  fi
  if leading; then
    if [ -z "$child" ]; then
      # Never start with an old acknowledgement left in place: the sidecar would take it for
      # this app's stop. A folder this script cannot write to is looked at again later.
      : > "$dir/idle" 2>/dev/null || { pause; continue; }
      start_app "$@"
    fi
  else
    stop_child
    acknowledge
  fi
  pause
done
