#!/usr/bin/env bash
# Builds Prometheus' promtool (and, when asked, the server) from Go modules with the
# Go that build.sh uses (the machine's, or the pinned one from the Go module proxy), into a cache folder of its own keyed by the version
# (so that the control plane's folder keeps its key). Only missing binaries are built.
# Prints the folder on its last line.
#
#   build-prometheus.sh [promtool] [prometheus]     (default: promtool)
#   SINGLETON_TESTBED_CACHE  cache root (default ~/.cache/singleton/testbed)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/go/versions.env"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -trimpath"

root=${SINGLETON_TESTBED_CACHE:-$HOME/.cache/singleton/testbed}
dest="$root/prometheus-${PROMETHEUS_VERSION}"
mkdir -p "$dest"

log() { printf '[testbed-build] %s\n' "$*" >&2; }

# remove_all_sd leaves out the service discoveries of plugins/ (AWS, Azure, GCE, Consul...;
# file and http stay): the alert tests need none. promtool still compiles the Kubernetes SD,
# which it imports itself.
# Module v0.3XX.Y is Prometheus 3.XX.Y: the version its release build (.promu.yml) stamps.
release=${PROMETHEUS_VERSION#v0.3}; release="3.${release%%.*}.${release#*.}"
ldflags="-s -w -X github.com/prometheus/common/version.Version=${release}"
for name in "${@:-promtool}"; do
  case $name in
    promtool|prometheus) ;;
    *) echo "build-prometheus.sh: unknown binary $name (promtool, prometheus)" >&2; exit 2 ;;
  esac
  if [ -x "$dest/$name" ]; then continue; fi
  gobin=$(python3 "$here/singleton_testbed/gotoolchain.py" bin)
  PATH="$gobin:$PATH"
  log "building $name from github.com/prometheus/prometheus ${PROMETHEUS_VERSION} (first time only; this takes minutes)"
  start=$SECONDS
  (cd "$here/go/prometheus" && go build -tags remove_all_sd -ldflags "$ldflags" -o "$dest/$name.tmp.$$" \
    "github.com/prometheus/prometheus/cmd/$name")
  mv "$dest/$name.tmp.$$" "$dest/$name"
  log "built $name in $((SECONDS - start)) s"
done
echo "$dest"
