"""``make demo``: singleton on an embedded cluster, in about two minutes.

The test bed's control plane and PostgreSQL, a real node (containerd + runc + CNI bridge,
kubelet and kube-proxy) running the project's image (built with buildah, cached), the
operator with the Helm chart's RBAC, and a SingletonService of three sample pollers
(``demo/feed-poller.yaml``); then a live view while the leader's sidecar container is
killed, the leader pod deleted and a spec change rolled out, and a summary of the handovers
judged from the fenced ledger the pollers wrote.

    python -m demo run [--no-live]      # make demo
    python -m demo env                  # the exports for exploring the running cluster
    python -m demo down                 # make demo-down

State (pids, paths) lives in ``$SINGLETON_DEMO_STATE`` (default ``~/.cache/singleton/run/demo``).
"""
