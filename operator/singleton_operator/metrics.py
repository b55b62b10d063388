"""The operator's Prometheus metrics, on its health port's /metrics."""

from __future__ import annotations

import importlib.metadata
import platform

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

GROUP_LABELS = ("namespace", "group")


def operator_version() -> str:
    """The version of the distribution that installed this package (whatever its name)."""
    for distribution in importlib.metadata.packages_distributions().get(__package__ or "", []):
        return importlib.metadata.version(distribution)
    return "unknown"


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.is_leader = Gauge("singleton_operator_is_leader", "1 while this operator replica is the active one",
                               registry=self.registry)
        self.reconciles = Counter("singleton_operator_reconciles", "SingletonService reconciles started",
                                  registry=self.registry)
        self.reconcile_errors = Counter("singleton_operator_reconcile_errors",
                                        "reconciles that found a problem the user must fix, per group and reason",
                                        [*GROUP_LABELS, "reason"], registry=self.registry)
        self.leader_changes = Counter("singleton_operator_leader_changes",
                                      "new leaders the operator saw per group (the LeaderChanged Events)",
                                      GROUP_LABELS, registry=self.registry)
        # From the pods' role labels the operator reads for each status write: "no leader"
        # can be told without scraping any sidecar (charts/singleton/files/alerts.yaml).
        self.group_leaders = Gauge("singleton_group_leaders",
                                   "pods of the group the operator sees labelled leader or draining",
                                   GROUP_LABELS, registry=self.registry)
        build_info = Gauge("singleton_operator_build_info", "always 1; the operator's version in labels",
                           ["version", "python_version"], registry=self.registry)
        build_info.labels(version=operator_version(), python_version=platform.python_version()).set(1)
        self._error_reasons: dict[tuple[str, str], set[str]] = {}
        self.status_updates = Counter("singleton_operator_status_updates", "status writes to SingletonServices",
                                      registry=self.registry)
        self.deposed_relabelled = Counter(
            "singleton_operator_deposed_leaders_relabelled",
            "pods whose leader label the operator took off because another pod leads with a greater token "
            "(their sidecar cut off from the API server)", registry=self.registry)
        self.admission_seconds = Histogram(
            "singleton_operator_pod_admission_seconds", "time to answer one pod AdmissionReview (webhook)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0), registry=self.registry)

    def reconcile_failed(self, namespace: str, group: str, reason: str) -> None:
        self.reconcile_errors.labels(namespace, group, reason).inc()
        self._error_reasons.setdefault((namespace, group), set()).add(reason)

    def forget(self, namespace: str, group: str) -> None:
        """Drop a deleted group's series."""
        self.leader_changes.remove(namespace, group)
        self.group_leaders.remove(namespace, group)
        for reason in self._error_reasons.pop((namespace, group), set()):
            self.reconcile_errors.remove(namespace, group, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
