"""The test bed: a real PostgreSQL server and a real Kubernetes control plane
(etcd, kube-apiserver, and on request kube-controller-manager and kube-scheduler),
started from local binaries for tests, benchmarks and humans (`singleton-testbed up`)."""
