"""client-go leader election as a peer for the benchmarks: a tiny Go elector of our own
(``main.go``, built by ``build.sh``), its Python driver and a ledger worker (unfenced, or
fenced with the term's start) that logs its acts as our worker does."""
