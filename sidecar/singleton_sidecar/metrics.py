"""Prometheus metrics of one sidecar, in a registry of its own (no global state).

The metrics are prometheus_client's, which ``singleton-sidecar run`` loads without the package's
heavy ``__init__`` (``singleton_sidecar.package_parts``). ``/metrics`` answers in OpenMetrics (the
library's ``openmetrics.exposition``, light) to a scraper that accepts it, as Prometheus does;
only a client that does not gets the classic text format, whose encoder lives in the module with
the library's HTTP server (loaded then, once).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.metrics import Counter, Gauge, Histogram
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import CollectorRegistry

from singleton_election.core.status import ElectionStatus, Role

OPENMETRICS: str = openmetrics.CONTENT_TYPE_LATEST
CLASSIC = "text/plain; version=0.0.4; charset=utf-8"
encode_openmetrics: Callable[[CollectorRegistry], bytes] = openmetrics.generate_latest  # untyped there

RENEW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STOP_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class SidecarMetrics:
    def __init__(self, group: str, backend: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"group": group, "backend": backend}
        self._is_leader = Gauge("singleton_is_leader", "1 while this replica leads (leader or draining).",
                                list(labels), registry=self.registry).labels(**labels)
        self._token = Gauge("singleton_term_token", "Fencing token of this replica's current term (0: none).",
                            list(labels), registry=self.registry).labels(**labels)
        self._transitions = Counter("singleton_transitions", "Changes of this replica's role.",
                                    list(labels), registry=self.registry).labels(**labels)
        self._terms = Counter("singleton_terms", "Terms this replica won (became leader): summed over a group, "
                              "the group's leader changes.", list(labels), registry=self.registry).labels(**labels)
        self._lock_held = Gauge("singleton_lock_held", "1 while this replica sees the group's lock held, by itself "
                                "or another holder (a standby: the holder it last observed).",
                                list(labels), registry=self.registry).labels(**labels)
        self._renew_latency = Histogram("singleton_renew_latency_seconds", "Duration of lock renewals.",
                                        list(labels), buckets=RENEW_BUCKETS, registry=self.registry).labels(**labels)
        self._renew_failures = Counter("singleton_renew_failures", "Renewals that failed or found the lock lost.",
                                       list(labels), registry=self.registry).labels(**labels)
        self._app_stop = Histogram("singleton_app_stop_seconds",
                                   "Time from the end of a term until the app was confirmed stopped (then released).",
                                   list(labels), buckets=STOP_BUCKETS, registry=self.registry).labels(**labels)
        self._app_stop_unconfirmed = Counter(
            "singleton_app_stop_unconfirmed", "Terms whose app was not confirmed stopped in time: left unreleased, "
            "the lock freed by expiry.", list(labels), registry=self.registry).labels(**labels)
        role = Gauge("singleton_role", "1 for this replica's current role.", [*labels, "role"],
                     registry=self.registry)
        self._roles = {r: role.labels(**labels, role=r.value) for r in Role}
        self._last_role: Role | None = None

    def on_status(self, status: ElectionStatus) -> None:
        leading = status.role in (Role.LEADER, Role.DRAINING)
        self._is_leader.set(1 if leading else 0)
        self._token.set(status.token or 0)
        if self._last_role is not None and status.role != self._last_role:
            self._transitions.inc()
        if status.role is Role.LEADER and self._last_role not in (Role.LEADER, Role.DRAINING):
            self._terms.inc()
        self._lock_held.set(1 if status.leader is not None else 0)
        self._last_role = status.role
        for role, gauge in self._roles.items():
            gauge.set(1 if role is status.role else 0)

    def on_renew(self, seconds: float, ok: bool) -> None:
        self._renew_latency.observe(seconds)
        if not ok:
            self._renew_failures.inc()

    def on_app_stopped(self, seconds: float, confirmed: bool) -> None:
        if confirmed:
            self._app_stop.observe(seconds)
        else:
            self._app_stop_unconfirmed.inc()

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition and its content type, for a request's ``Accept`` header: OpenMetrics
        1.0.0 when it lists ``application/openmetrics-text``, else the classic text format."""
        if wants_openmetrics(accept):
            return encode_openmetrics(self.registry), OPENMETRICS
        from prometheus_client.exposition import generate_latest  # the heavy module (see above)

        return generate_latest(self.registry), CLASSIC


def wants_openmetrics(accept: str) -> bool:
    """Whether an ``Accept`` header lists OpenMetrics, other than with ``q=0`` (not acceptable)."""
    for part in accept.split(","):
        media_type, *parameters = (item.strip().lower() for item in part.split(";"))
        if media_type == "application/openmetrics-text" and _weight(parameters) > 0:
            return True
    return False


def _weight(parameters: list[str]) -> float:
    """A media range's ``q`` (1 when absent or unreadable)."""
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        if name.strip() == "q":
            try:
                return float(value)
            except ValueError:
                return 1.0
    return 1.0
