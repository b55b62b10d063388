//go:build tools

// Package tools pins the Prometheus commands the alert tests use (promtool,
// and the server for the scrape test).
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
