"""The operator's Prometheus metrics, on its health port's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.is_leader = Gauge("singleton_operator_is_leader", "1 while this operator replica is the active one",
                               registry=self.registry)
        self.reconciles = Counter("singleton_operator_reconciles", "SingletonService reconciles started",
                                  registry=self.registry)
        self.reconcile_errors = Counter("singleton_operator_reconcile_errors",
                                        "reconciles that found a problem the user must fix", registry=self.registry)
        self.status_updates = Counter("singleton_operator_status_updates", "status writes to SingletonServices",
                                      registry=self.registry)
        self.admission_seconds = Histogram(
            "singleton_operator_pod_admission_seconds", "time to answer one pod AdmissionReview (webhook)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0), registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
