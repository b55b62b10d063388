//go:build tools

// Package tools pins the etcd server the test bed builds.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
)
