#!/usr/bin/env bash
# The machine's prerequisites, the one list: what shows each is there, the Debian package that
# provides it, and what needs it. `make test`, `make demo`, `make testbed`, `make image`, every
# target that makes the venv, and .ci/run call this before anything else (the venv too needs it:
# Debian keeps `python3 -m venv` in a package of its own); `make prerequisites`: everything.
#
#   testbed/prerequisites.sh check   [TARGET...]   say what is missing; non-zero if TARGET cannot run
#   testbed/prerequisites.sh install [TARGET...]   as root with apt: install what is missing first
#
# TARGET is a make target (the Makefile passes its goals): what it needs, below (`needs`).
#   SINGLETON_NO_APT=1  never install: say what is missing and the apt-get line to run
#   PYTHON              the Python the venv is made with (default python3)
#   PG_BIN, PGBOUNCER   PostgreSQL's binaries and PgBouncer from elsewhere (as the test bed reads them)
# Go is no Debian package here (Debian 12's is 1.19): PATH's `go` when new enough, else `install`
# (root or not: it goes into the user's cache) fetches the pinned toolchain from the Go module
# proxy, checked against testbed/go/toolchain.sum (singleton_testbed/gotoolchain.py).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}

# What needs it:
#   venv   the venv and its Python (`make venv`, so every target but `make testbed`)
#   build  the test bed's binaries, built from Go modules (testbed/build.sh)
#   bed    the test bed's servers: PostgreSQL, PgBouncer, the control plane's certificates
#   node   the real node: containerd, runc, the CNI bridge, kube-proxy's tools, the busybox test image
#   image  the image, built from the Dockerfile without an engine (singleton_testbed.images)
#   checks what the tests' own checks run (tests/release: actionlint runs shellcheck on the workflows)
# How it shows: cmd:NAME on PATH; file:PATH exists; deb:PACKAGE installed; otherwise a function below.
list() {
  cat <<'EOF'
python            python3                      venv   the venv's Python (>= 3.11)
python-venv       python3-venv                 venv   makes the venv (Debian keeps ensurepip in python3-venv)
go                golang.org/toolchain         build  builds the control plane, kubelet and helm (testbed/build.sh)
cmd:python3       python3                      build  picks Go or fetches it (testbed/singleton_testbed/gotoolchain.py)
cmd:openssl       openssl                      bed    the test bed's certificates
initdb            postgresql                   bed    the test PostgreSQL server (initdb, postgres; or PG_BIN)
cmd:psql          postgresql-client            bed    sets up the test PostgreSQL's roles and database
pgbouncer         pgbouncer                    bed    the pooler tests (or PGBOUNCER)
file:/usr/bin/containerd      containerd       node   runs the real node's containers
file:/usr/bin/ctr             containerd       node   imports images into the real node
file:/usr/sbin/runc           runc             node   the real node's container runtime
file:/usr/lib/cni/bridge      containernetworking-plugins  node  the real node's pod network
file:/usr/lib/cni/host-local  containernetworking-plugins  node  the real node's pod addresses
file:/usr/lib/cni/loopback    containernetworking-plugins  node  the pods' loopback
cmd:ip            iproute2                     node   the real node's bridge
cmd:iptables      iptables                     node   kube-proxy's rules, faults inside pods' network namespaces
cmd:ip6tables     iptables                     node   kube-proxy's rules (IPv6)
cmd:conntrack     conntrack                    node   kube-proxy clears stale connections
deb:busybox-static  busybox-static             node   the real node's small test image (a static /bin/busybox)
cmd:buildah       buildah                      image  builds the Dockerfile
cmd:mmdebstrap    mmdebstrap                   image  the image's local Debian base
cmd:shellcheck    shellcheck                   checks the workflows' scripts, checked by actionlint in the tests
EOF
}

# Targets: what must be there (required) and what is installed when it can be but may lack
# (wanted: without root the real node cannot run anyway, and its tests skip, saying why).
needs() {
  case $1 in
    testbed) required+=" build" ;;
    image) required+=" venv image" ;;
    test) required+=" venv build bed checks"; wanted+=" node image" ;;
    testbed-up|testbed-node-test|figures) required+=" venv build bed"; wanted+=" node image" ;;
    ci|prerequisites) required+=" venv build bed node image checks" ;;
    demo|e2e-existing) required+=" venv build bed node image" ;;
    unit) required+=" venv checks" ;;
    *) required+=" venv" ;;
  esac
}

# One run of PYTHON answers both of its checks (a pyenv shim takes a third of a second).
python_found=
python_probe() {
  [ -z "$python_found" ] || return 0
  python_found=0 python_old=0 python_venv=0
  command -v "$PYTHON" >/dev/null || return 0
  python_found=1
  local answer
  answer=$("$PYTHON" -c 'import sys, importlib.util as u
print(int(sys.version_info < (3, 11)), int(all(u.find_spec(m) for m in ("ensurepip", "venv"))))' 2>/dev/null) || true
  read -r python_old python_venv <<<"${answer:-1 0}"
}

# check_one WHAT: 0 there; 1 missing (apt can install it); 2 there but unfit (the reason in $unfit);
# 3 fetched from the Go module proxy (what, in $unfit).
check_one() {
  unfit=
  case $1 in
    cmd:*) command -v "${1#cmd:}" >/dev/null ;;
    file:*) [ -e "${1#file:}" ] ;;
    deb:*) dpkg-query -W -f '${Status}' "${1#deb:}" 2>/dev/null | grep -q ' installed$' ;;
    python)
      python_probe
      [ "$python_found" = 1 ] || return 1
      [ "$python_old" = 1 ] || return 0
      unfit="$PYTHON is $("$PYTHON" -V 2>&1); the project needs Python >= 3.11 (set PYTHON=python3.X)"
      return 2 ;;
    python-venv) python_probe; [ "$python_venv" = 1 ] ;;
    go)
      # Without python3 the line cmd:python3 says so; after apt-get installs it, this runs again.
      command -v "$PYTHON" >/dev/null || return 0
      local status=0
      unfit=$("$PYTHON" "$here/singleton_testbed/gotoolchain.py" check 2>&1 >/dev/null) || status=$?
      case $status in
        0|3) return "$status" ;;
        *) unfit=${unfit:-"gotoolchain.py check failed ($status)"}; return 2 ;;
      esac ;;
    initdb)
      [ -n "${PG_BIN:-}" ] && [ -x "$PG_BIN/initdb" ] && return 0
      command -v initdb >/dev/null && return 0
      compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null ;;
    pgbouncer)
      [ -n "${PGBOUNCER:-}" ] && [ -x "$PGBOUNCER" ] && return 0
      command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] ;;
    *) echo "prerequisites.sh: unknown check $1" >&2; return 2 ;;
  esac
}

# survey: fills missing_required / missing_wanted (lines "PACKAGE  why (WHAT)"), unfit_lines and
# fetch_lines (Go, when PATH has none new enough; go_failed: fetching it failed).
go_failed=
survey() {
  missing_required='' missing_wanted='' unfit_lines='' fetch_lines=''
  local what package group why status
  while read -r what package group why; do
    case " $required $wanted " in *" $group "*) ;; *) continue ;; esac
    status=0; check_one "$what" || status=$?
    [ "$status" = 0 ] && continue
    if [ "$status" = 3 ] && [ -z "$go_failed" ]; then
      fetch_lines+="  $unfit"$'\n'
      continue
    fi
    [ "$status" = 3 ] && unfit+=" (fetching it failed, above)"
    if [ "$status" = 2 ] || [ "$status" = 3 ]; then
      case " $required " in *" $group "*) unfit_lines+="  $unfit"$'\n' ;; esac
      continue
    fi
    local shows=${what#*:} line
    case $what in python) shows=$PYTHON ;; python-venv) shows="$PYTHON -m venv" ;; esac
    line=$(printf '  %-28s %s (%s)' "$package" "$why" "$shows")
    case " $required " in
      *" $group "*) missing_required+="$line"$'\n' ;;
      *) missing_wanted+="$line"$'\n' ;;
    esac
  done < <(list)
}

packages() { # the distinct packages of survey lines
  awk 'NF && !seen[$1]++ { printf "%s%s", sep, $1; sep = " " }' <<<"$1"
}

report() { # what is still missing, with the apt-get line; non-zero when a target cannot run
  local rc=0
  if [ -n "$fetch_lines" ]; then # testbed/build.sh fetches it too, so the target can run
    echo "$label: Go comes from the Go module proxy (\`$0 install\` or testbed/build.sh fetch it):" >&2
    printf '%s' "$fetch_lines" >&2
  fi
  if [ -n "$missing_wanted" ]; then
    echo "$label: without these, the real node's and the image's tests skip or fail, saying why:" >&2
    printf '%s' "$missing_wanted" >&2
    echo "  as root: apt-get install $(packages "$missing_wanted")" >&2
  fi
  if [ -n "$missing_required" ] || [ -n "$unfit_lines" ]; then
    echo "$label cannot run here:" >&2
    printf '%s' "$missing_required" "$unfit_lines" >&2
    if [ -n "$missing_required" ]; then
      echo "  as root: apt-get install $(packages "$missing_required")" >&2
    fi
    rc=1
  fi
  return $rc
}

fetch_go() { # no root, no apt: into the user's cache, so before the reasons to install nothing
  [ -n "$fetch_lines" ] || return 0
  echo "$label: fetching Go from the Go module proxy:" >&2
  printf '%s' "$fetch_lines" >&2
  "$PYTHON" "$here/singleton_testbed/gotoolchain.py" fetch >/dev/null || go_failed=1
  survey
}

mode=${1:-check}
[ $# -gt 0 ] && shift
[ $# -gt 0 ] || set -- venv
label="make $*"
[ "$*" = ci ] && label=.ci/run
required='' wanted=''
for target in "$@"; do needs "$target"; done
survey

case $mode in
  check) report ;;
  install)
    fetch_go
    if [ -z "$missing_required$missing_wanted" ]; then report; exit; fi
    if [ "${SINGLETON_NO_APT:-}" = 1 ]; then
      echo "prerequisites: SINGLETON_NO_APT=1, installing nothing" >&2
      report; exit
    fi
    if [ "$(id -u)" != 0 ]; then
      echo "prerequisites: not root, installing nothing" >&2
      report; exit
    fi
    if ! command -v apt-get >/dev/null; then
      echo "prerequisites: no apt-get here, installing nothing" >&2
      report; exit
    fi
    install=$(packages "$missing_required$missing_wanted")
    echo "$label: installing with apt-get (SINGLETON_NO_APT=1 to only check):" >&2
    printf '%s' "$missing_required$missing_wanted" >&2
    # A failed apt-get decides nothing by itself: what is still missing after it does (below).
    apt-get update -qq || echo "prerequisites: apt-get update failed" >&2
    # shellcheck disable=SC2086  # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $install || echo "prerequisites: apt-get install failed" >&2
    survey
    fetch_go # when apt-get has just brought python3
    if [ -n "$missing_required$missing_wanted" ]; then
      echo "prerequisites: still missing after apt-get install $install" >&2
    fi
    report ;;
  *) echo "usage: $0 check|install [TARGET...]" >&2; exit 2 ;;
esac
