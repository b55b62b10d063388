//go:build tools

// Package tools pins the helm command the test bed builds.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
