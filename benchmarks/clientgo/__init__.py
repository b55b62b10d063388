"""client-go leader election as a peer for the benchmarks: a tiny Go elector of our own
(``main.go``, built by ``build.sh``), its Python driver and an unfenced ledger worker."""
