#!/usr/bin/env bash
# `make e2e-existing`: the end-to-end suite (tests/node/test_e2e.py) with USE_EXISTING_CLUSTER=true,
# against the test bed's own real-node cluster known to it only through its kubeconfig: the
# path a user takes with any cluster, proven here without one.
#
# `singleton-testbed up` starts PostgreSQL, the control plane and a real node (root) and
# imports the project's image into it; the suite gets KUBECONFIG and SINGLETON_E2E_POD_DSN
# (the database as the node's pods reach it) and nothing else of the test bed; the test bed
# is torn down afterwards, whatever happened. Skipped tests count as a failure here: on this
# node every step, the sidecar SIGKILL included, must run.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}

if "$BIN/singleton-testbed" status >/dev/null 2>&1; then
  echo "[e2e-existing] a test bed already runs: stop it first (make testbed-down)" >&2
  exit 1
fi
exports=$("$BIN/singleton-testbed" up)
trap '"$BIN/singleton-testbed" down' EXIT
KUBECONFIG=$(sed -n 's/^export KUBECONFIG=//p' <<<"$exports")
POD_DSN=$(sed -n 's/^export SINGLETON_E2E_POD_DSN=//p' <<<"$exports")
PATH_PREFIX=$(sed -n 's/^export PATH=\(.*\):\$PATH$/\1/p' <<<"$exports")
if [ -z "$POD_DSN" ] || ! grep -q '^# image .* imported into the real node' <<<"$exports"; then
  echo "[e2e-existing] the test bed has no real node with the project's image:" >&2
  echo "$exports" >&2
  exit 1
fi

log=$(mktemp)
status=0
env -u SINGLETON_TEST_DSN -u SINGLETON_TEST_ADMIN_DSN \
  PATH="$PATH_PREFIX:$PATH" USE_EXISTING_CLUSTER=true KUBECONFIG="$KUBECONFIG" SINGLETON_E2E_POD_DSN="$POD_DSN" \
  "$BIN/pytest" -ra -p no:cacheprovider tests/node/test_e2e.py "$@" 2>&1 | tee "$log" || status=$?
if [ "$status" -eq 0 ] && grep -Eq '^=+ .*[0-9]+ skipped' "$log"; then
  echo "[e2e-existing] tests were skipped (see above): every step must run against this node" >&2
  status=1
fi
rm -f "$log"
exit "$status"
