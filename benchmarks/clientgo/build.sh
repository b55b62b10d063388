#!/usr/bin/env bash
# Builds clientgo-elector (client-go leader election, the benchmarks' reference peer)
# with the test bed's Go (the machine's, or the pinned one from the Go module proxy) into a cache folder outside the repository, keyed by
# the client-go version in go.mod. Skips the build when the binary exists and was built
# from the same sources (a hash of main.go, go.mod, go.sum is kept beside it). Prints the
# binary's path on its last line.
#
#   SINGLETON_CLIENTGO_CACHE  cache root (default ~/.cache/singleton/clientgo)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -trimpath"

version=$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$here/go.mod")
dest="${SINGLETON_CLIENTGO_CACHE:-$HOME/.cache/singleton/clientgo}/$version"
binary="$dest/clientgo-elector"
sources=$(cd "$here" && cat main.go go.mod go.sum | sha256sum | cut -c1-16)
log() { printf '[clientgo-build] %s\n' "$*" >&2; }

if [ -x "$binary" ] && [ "$(cat "$binary.sources" 2>/dev/null)" = "$sources" ]; then
  log "up to date: $binary"
else
  gobin=$(python3 "$here/../../testbed/singleton_testbed/gotoolchain.py" bin "$here/go.mod")
  PATH="$gobin:$PATH"
  mkdir -p "$dest"
  log "building clientgo-elector with client-go $version ($(go version | cut -d' ' -f3))"
  start=$SECONDS
  (cd "$here" && go build -ldflags "-s -w" -o "$binary.tmp" .)
  mv "$binary.tmp" "$binary"
  echo "$sources" > "$binary.sources"
  log "built $binary in $((SECONDS - start)) s"
fi
echo "$binary"
