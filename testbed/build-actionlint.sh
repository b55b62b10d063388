#!/usr/bin/env bash
# Builds actionlint (the linter of GitHub Actions workflows, which tests/test_release_workflow.py
# runs on .github/workflows) from its Go module with the Go build.sh uses (the machine's, or the
# pinned one from the Go module proxy), into a cache folder keyed by its version. `go install module@version` builds with the
# module's own go.mod and go.sum, so the dependencies are those of the release. Prints the
# folder on its last line.
#
#   SINGLETON_TESTBED_CACHE  cache root (default ~/.cache/singleton/testbed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ACTIONLINT_VERSION=v1.7.12
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -trimpath"

root=${SINGLETON_TESTBED_CACHE:-$HOME/.cache/singleton/testbed}
dest="$root/actionlint-${ACTIONLINT_VERSION}"
if [ ! -x "$dest/actionlint" ]; then
  printf '[testbed-build] building actionlint %s (first time only)\n' "$ACTIONLINT_VERSION" >&2
  mkdir -p "$dest"
  gobin=$(python3 "$here/singleton_testbed/gotoolchain.py" bin)
  PATH="$gobin:$PATH"
  GOBIN="$dest/.tmp.$$" go install -ldflags "-s -w -X main.version=${ACTIONLINT_VERSION}" \
    "github.com/rhysd/actionlint/cmd/actionlint@${ACTIONLINT_VERSION}"
  mv "$dest/.tmp.$$/actionlint" "$dest/actionlint"
  rmdir "$dest/.tmp.$$"
fi
echo "$dest"
