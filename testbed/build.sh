#!/usr/bin/env bash
# Builds the test bed's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, helm, and for the real node kubelet, kube-proxy and
# the sandbox's pause) from Go modules with the machine's Go toolchain when it
# is new enough, else with the pinned one fetched from the Go module proxy
# (singleton_testbed/gotoolchain.py), into a cache folder outside the repository
# keyed by versions. Only missing binaries are built. Prints the folder on its last line.
#
#   SINGLETON_KUBERNETES_VERSION  which pinned Kubernetes: KUBERNETES_VERSION of go/versions.env
#                            (the default, the oldest supported) or KUBERNETES_NEWEST_VERSION
#   SINGLETON_TESTBED_CACHE  cache root (default ~/.cache/singleton/testbed)
#   SINGLETON_GO_CACHE       where a fetched Go goes (default ~/.cache/singleton/go)
#   GOPROXY                  where it is fetched from (default https://proxy.golang.org)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/go/versions.env"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -trimpath"

# Each pinned Kubernetes has its wrapper module (go/gen-modules.sh); etcd, helm and pause are shared.
case ${SINGLETON_KUBERNETES_VERSION:-$KUBERNETES_VERSION} in
  "$KUBERNETES_VERSION") k8s_module=kubernetes ;;
  "$KUBERNETES_NEWEST_VERSION") k8s_module=kubernetes-newest KUBERNETES_VERSION=$KUBERNETES_NEWEST_VERSION ;;
  *) echo "SINGLETON_KUBERNETES_VERSION=$SINGLETON_KUBERNETES_VERSION is not pinned: use $KUBERNETES_VERSION" \
       "or $KUBERNETES_NEWEST_VERSION (testbed/go/versions.env)" >&2; exit 2 ;;
esac

root=${SINGLETON_TESTBED_CACHE:-$HOME/.cache/singleton/testbed}
dest="$root/k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_helm-${HELM_VERSION}"
mkdir -p "$dest"

log() { printf '[testbed-build] %s\n' "$*" >&2; }

go_ready=
use_go() { # once, and only when something is built: it may fetch Go (python3: stdlib only)
  [ -z "$go_ready" ] || return 0
  local gobin
  gobin=$(python3 "$here/singleton_testbed/gotoolchain.py" bin)
  PATH="$gobin:$PATH" go_ready=1
}

build() { # build NAME MODULE_DIR PACKAGE LDFLAGS
  local name=$1 dir=$2 pkg=$3 ldflags=$4
  if [ -x "$dest/$name" ]; then return 0; fi
  use_go
  log "building $name from $pkg with $(go env GOVERSION) (first time only; this takes minutes)"
  local start=$SECONDS
  (cd "$here/go/$dir" && go build -ldflags "$ldflags" -o "$dest/$name.tmp" "$pkg")
  mv "$dest/$name.tmp" "$dest/$name"
  log "built $name in $((SECONDS - start)) s"
}

# The same version variables the Kubernetes release build sets
# (hack/lib/version.sh), so /version and `kubectl version` tell the truth.
k8s_minor=${KUBERNETES_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
k8s_ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ld+=" -X $pkg.gitVersion=${KUBERNETES_VERSION} -X $pkg.gitMajor=1 -X $pkg.gitMinor=${k8s_minor}"
  k8s_ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build etcd etcd go.etcd.io/etcd/server/v3 "-s -w"
build kube-apiserver "$k8s_module" k8s.io/kubernetes/cmd/kube-apiserver "$k8s_ld"
build kubectl "$k8s_module" k8s.io/kubernetes/cmd/kubectl "$k8s_ld"
build kube-controller-manager "$k8s_module" k8s.io/kubernetes/cmd/kube-controller-manager "$k8s_ld"
build kube-scheduler "$k8s_module" k8s.io/kubernetes/cmd/kube-scheduler "$k8s_ld"
build kubelet "$k8s_module" k8s.io/kubernetes/cmd/kubelet "$k8s_ld"
build kube-proxy "$k8s_module" k8s.io/kubernetes/cmd/kube-proxy "$k8s_ld"
# Static (CGO_ENABLED=0 above), so it runs alone in the sandbox image's rootfs.
build pause pause singleton.dev/testbed/pause "-s -w"
build helm helm helm.sh/helm/v3/cmd/helm "-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
echo "$dest"
