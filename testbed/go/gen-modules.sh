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

# gen_kubernetes VERSION DIR: the wrapper module of one Kubernetes version.
gen_kubernetes() {
  local version=$1 dir=$2 gomod staging_version="v0.${1#v1.}"
  gomod=$(go mod download -json "k8s.io/kubernetes@${version}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  mkdir -p "$here/$dir"
  # tools.go (the commands the test bed builds) keeps their modules in go.sum through the tidy.
  [ "$dir" = kubernetes ] || cp "$here/kubernetes/tools.go" "$here/$dir/tools.go"
  {
    echo "module singleton.dev/testbed/$dir"
    echo
    echo "go $(awk '/^go /{print $2; exit}' "$gomod")"
    echo
    echo "require k8s.io/kubernetes ${version}"
    echo
    echo "replace ("
    grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
    echo ")"
  } > "$here/$dir/go.mod"
  (cd "$here/$dir" && rm -f go.sum && go mod tidy)
}
gen_kubernetes "$KUBERNETES_VERSION" kubernetes
gen_kubernetes "$KUBERNETES_NEWEST_VERSION" kubernetes-newest

printf 'module singleton.dev/testbed/etcd\n\ngo 1.24\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" > "$here/etcd/go.mod"
(cd "$here/etcd" && rm -f go.sum && go mod tidy)

printf 'module singleton.dev/testbed/helm\n\ngo 1.24\n\nrequire helm.sh/helm/v3 %s\n' "$HELM_VERSION" > "$here/helm/go.mod"
(cd "$here/helm" && rm -f go.sum && go mod tidy)

printf 'module singleton.dev/testbed/prometheus\n\ngo 1.24\n\nrequire github.com/prometheus/prometheus %s\n' "$PROMETHEUS_VERSION" > "$here/prometheus/go.mod"
(cd "$here/prometheus" && rm -f go.sum && go mod tidy)
