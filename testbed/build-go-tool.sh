#!/usr/bin/env bash
# Builds one of the release tools from its Go module, with the Go build.sh uses (the machine's,
# or the pinned one from the Go module proxy), into a cache folder keyed by its version, and
# prints that folder on its last line:
#
#   bash testbed/build-go-tool.sh actionlint   # the linter of GitHub Actions workflows (tests/release/test_release_workflow.py)
#   bash testbed/build-go-tool.sh syft         # the image's SBOM in `make dist` (singleton_testbed/dist.py)
#
# `go install module@version` builds with the module's own go.mod and go.sum, so the
# dependencies are those of the release (syft: about 5 minutes and 90 MB the first time).
#
#   SINGLETON_TESTBED_CACHE  cache root (default ~/.cache/singleton/testbed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "${1:-}" in
  actionlint) package=github.com/rhysd/actionlint/cmd/actionlint version=v1.7.12 ;;
  syft) package=github.com/anchore/syft/cmd/syft version=v1.57.1 ;;
  *) echo "usage: $0 actionlint|syft" >&2; exit 2 ;;
esac
name=$1
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -trimpath"

root=${SINGLETON_TESTBED_CACHE:-$HOME/.cache/singleton/testbed}
dest="$root/${name}-${version}"
if [ ! -x "$dest/$name" ]; then
  printf '[testbed-build] building %s %s (first time only)\n' "$name" "$version" >&2
  mkdir -p "$dest"
  gobin=$(python3 "$here/singleton_testbed/gotoolchain.py" bin)
  PATH="$gobin:$PATH"
  # Both print this as their version (main.version); syft's other build facts stay unset.
  GOBIN="$dest/.tmp.$$" go install -ldflags "-s -w -X main.version=${version}" "${package}@${version}"
  mv "$dest/.tmp.$$/$name" "$dest/$name"
  rmdir "$dest/.tmp.$$"
fi
echo "$dest"
