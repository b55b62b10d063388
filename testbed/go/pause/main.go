// Command pause is the test bed's pod sandbox process (the "pause" container of
// every pod run by the real node): it holds the pod's namespaces open, reaps the
// zombies of processes that share its PID namespace, and exits on SIGINT/SIGTERM.
// Built from this stdlib-only module because nothing may come from an image registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		// Reap every finished child: with a shared PID namespace this process is
		// PID 1, and orphans of other containers become its children.
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
