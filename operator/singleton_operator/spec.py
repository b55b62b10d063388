"""A SingletonService's spec, read once into a typed value with every default resolved.

The CRD's schema and CEL rules reject bad objects at admission; this module does not
repeat them, but it refuses (with the field's name) anything the operator cannot build,
in case the CRD in a cluster is older than the operator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from singleton_sidecar.core.timings import BACKEND_DEFAULTS, TimingError, Timings

Backend = Literal["postgres", "lease", "both"]
GatingMode = Literal["cooperative", "file"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class SpecError(ValueError):
    """A spec the operator cannot build; the message starts with the field's path."""


def parse_duration(path: str, text: str) -> float:
    """Seconds in a Go-style duration such as ``1m30s`` or ``1500ms``."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise SpecError(f"{path}: {text!r} is not a duration like 6s, 1500ms or 1m30s")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


@dataclass(frozen=True)
class ServicePort:
    port: int
    name: str | None = None
    target_port: int | str | None = None
    protocol: str = "TCP"


@dataclass(frozen=True)
class GroupSpec:
    """Everything the operator builds from, resolved."""

    name: str
    namespace: str
    uid: str
    generation: int
    replicas: int
    backend: Backend
    timings: Timings
    drain_timeout: float
    termination_grace: int
    gating: GatingMode
    main_container: str
    template: dict[str, Any]
    sidecar_image: str
    sidecar_port: int
    sidecar_log_level: str
    sidecar_resources: dict[str, Any] | None = None
    drain_hook_url: str | None = None
    postgres_secret: str | None = None
    postgres_secret_key: str = "dsn"
    service_type: str = "ClusterIP"
    service_ports: tuple[ServicePort, ...] = ()
    service_annotations: dict[str, str] = field(default_factory=dict)
    pdb_enabled: bool = True

    @property
    def uses_postgres(self) -> bool:
        return self.backend in ("postgres", "both")


def _timings(backend: Backend, raw: dict[str, Any] | None) -> Timings:
    if not raw:
        return BACKEND_DEFAULTS[backend]
    try:
        return Timings(
            lease_duration=parse_duration("spec.timings.leaseDuration", str(raw["leaseDuration"])),
            renew_deadline=parse_duration("spec.timings.renewDeadline", str(raw["renewDeadline"])),
            retry_period=parse_duration("spec.timings.retryPeriod", str(raw["retryPeriod"])),
        )
    except KeyError as exc:
        raise SpecError(f"spec.timings.{exc.args[0]}: required when spec.timings is set") from None
    except TimingError as exc:
        raise SpecError(f"spec.timings: {exc}") from None


def read_spec(body: dict[str, Any], *, default_sidecar_image: str) -> GroupSpec:
    """The resolved spec of a SingletonService object (as the API server returns it)."""
    metadata, spec = body["metadata"], body.get("spec") or {}
    backend: Backend = spec.get("backend", "lease")
    if backend not in ("postgres", "lease", "both"):
        raise SpecError(f"spec.backend: must be postgres, lease or both, got {backend!r}")
    template = spec.get("template") or {}
    containers = (template.get("spec") or {}).get("containers") or []
    if not containers:
        raise SpecError("spec.template.spec.containers: at least one container is required")
    main = spec.get("mainContainer") or containers[0]["name"]
    if main not in {c.get("name") for c in containers}:
        raise SpecError(f"spec.mainContainer: no container named {main!r} in spec.template.spec.containers")
    postgres = spec.get("postgres") or {}
    secret_ref = postgres.get("secretRef") or {}
    if backend != "lease" and not secret_ref.get("name"):
        raise SpecError(f"spec.postgres.secretRef.name: required with backend {backend}")
    drain = spec.get("drain") or {}
    sidecar = spec.get("sidecar") or {}
    service = spec.get("service") or {}
    return GroupSpec(
        name=metadata["name"],
        namespace=metadata["namespace"],
        uid=metadata["uid"],
        generation=int(metadata.get("generation", 0)),
        replicas=int(spec.get("replicas", 2)),
        backend=backend,
        timings=_timings(backend, spec.get("timings")),
        drain_timeout=parse_duration("spec.drain.timeout", str(drain.get("timeout", "20s"))),
        drain_hook_url=drain.get("hookURL") or None,
        termination_grace=int(spec.get("terminationGracePeriodSeconds", 30)),
        gating=(spec.get("gating") or {}).get("mode", "cooperative"),
        main_container=main,
        template=template,
        sidecar_image=sidecar.get("image") or default_sidecar_image,
        sidecar_port=int(sidecar.get("port", 9090)),
        sidecar_log_level=sidecar.get("logLevel", "info"),
        sidecar_resources=sidecar.get("resources") or None,
        postgres_secret=secret_ref.get("name"),
        postgres_secret_key=secret_ref.get("key", "dsn"),
        service_type=service.get("type", "ClusterIP"),
        service_ports=tuple(ServicePort(port=int(p["port"]), name=p.get("name"), target_port=p.get("targetPort"),
                                        protocol=p.get("protocol", "TCP")) for p in service.get("ports") or ()),
        service_annotations=dict(service.get("annotations") or {}),
        pdb_enabled=bool((spec.get("podDisruptionBudget") or {}).get("enabled", True)),
    )
