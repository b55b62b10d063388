#!/usr/bin/env bash
# Regenerates the wrapper modules that pin the test bed's Go programs.
# Run it only to change a version; the generated go.mod/go.sum are committed.
#
# k8s.io/kubernetes cannot be required as is: its go.mod replaces every
# k8s.io/* staging module with a local path, which a dependent module does not
# see. We copy that list from the exact tag's go.mod and point each entry at
# the published v0.<minor>.<patch> module instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/versions.env"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
gobin=$(python3 "$here/../singleton_testbed/gotoolchain.py" bin)  # the test bed's Go, fetched if need be
PATH="$gobin:$PATH"

staging_version="v0.${KUBERNETES_VERSION#v1.}"

gomod=$(go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
{
  echo "module singleton.dev/testbed/kubernetes"
  echo
  echo "go 1.24"
  echo
  echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
  echo
  echo "replace ("
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} > "$here/kubernetes/go.mod"
(cd "$here/kubernetes" && rm -f go.sum && go mod tidy)

printf 'module singleton.dev/testbed/etcd\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" > "$here/etcd/go.mod"
(cd "$here/etcd" && rm -f go.sum && go mod tidy)

printf 'module singleton.dev/testbed/helm\n\ngo 1.24\n\nrequire helm.sh/helm/v3 %s\n' "$HELM_VERSION" > "$here/helm/go.mod"
(cd "$here/helm" && rm -f go.sum && go mod tidy)

printf 'module singleton.dev/testbed/prometheus\n\ngo 1.24\n\nrequire github.com/prometheus/prometheus %s\n' "$PROMETHEUS_VERSION" > "$here/prometheus/go.mod"
(cd "$here/prometheus" && rm -f go.sum && go mod tidy)
