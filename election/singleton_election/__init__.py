"""singleton's election, shared by the sidecar, the operator and ``kubectl singleton``: the
contract (names on pods, Leases and CRs), the election core (``core``), the lock backends
(``backends``: PostgreSQL, Kubernetes Lease, both), the small Kubernetes request client
(``kube``, on ``httpclient``) and the plumbing every process of the project uses (``logs``,
``early_stop``, ``settings``). Layers, checked by ``lint-imports``: apps -> backends -> kube
client -> core -> contract."""
