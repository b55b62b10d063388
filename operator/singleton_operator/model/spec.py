"""A SingletonService's spec, read once into a typed value with every default resolved.

The CRD's schema and CEL rules reject bad objects at admission. This module checks again,
with the same rules and messages naming the same fields, everything admission refuses
because the operator could not build it: an object the API server would refuse (a Service
name, a label, a resource quantity), a sidecar that would refuse its settings (timings, a
port), or a group that would not work (a drain hook on the sidecar's own port). So the
operator never builds from an object that an older CRD in the cluster let through, and the
two agree: what admission accepts, ``read_spec`` accepts (tests/unit/operator/test_operator_units.py
runs every variant the admission tests of tests/integration/kube/test_crd.py accept through it;
test_crd.py compares the API server's verdict with its own on durations near every rule's
boundary).

Admission also refuses a few things the operator could build but that would surprise the
user; ``read_spec`` leaves those alone, so a group admitted by an older CRD keeps being
reconciled: a name starting with a digit when the group has no leader Service (a Service
added later could not be named after it), and ``spec.template.spec.terminationGracePeriodSeconds``
(replaced by ``spec.terminationGracePeriodSeconds``).

Durations are read as the API server's CEL ``duration()`` reads them (Go's
``time.ParseDuration``): whole nanoseconds, with the same truncation of longer fractions, so
a rule compared here and in CEL gives the same answer at every boundary.
"""

from __future__ import annotations

import decimal
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from singleton_election.core.timings import BACKEND_DEFAULTS, TimingError, Timings

Backend = Literal["postgres", "lease", "both"]
PostgresMode = Literal["session", "pooled"]
ConnectionCheck = Literal["block", "warn", "skip"]
CONNECTION_CHECKS = ("block", "warn", "skip")
GatingMode = Literal["cooperative", "file"]
StartOrder = Literal["AfterSidecars", "First", "Last"]
START_ORDERS = ("AfterSidecars", "First", "Last")
"""``spec.sidecar.startOrder``: where the sidecar goes among the pod's init containers
(``resources.place_sidecar``)."""

# Names the operator puts into every pod; the CRD reserves them too.
SIDECAR_CONTAINER = "singleton-sidecar"
GATE_VOLUME = "singleton-gate"
GATE_DIR = "/var/run/singleton"
SIDECAR_PORT_NAME = "singleton"
DEFAULT_SIDECAR_PORT = 7450
"""The CRD's default spec.sidecar.port (its control port is 7451): no well-known default of common
software, unlike 9090/9091 (Prometheus, Pushgateway); docs/operator.md (Ports) says why."""

NANOSECONDS = 1_000_000_000
DURATION_MAX_LENGTH = 32
"""The CRD's maxLength of every duration field."""
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h))+", re.ASCII)
"""The CRD's pattern for durations (fully matched, as its ^...$ anchors say)."""
_DURATION_TERM = re.compile(r"([0-9]+)(?:\.([0-9]+))?(ms|s|m|h)", re.ASCII)
_UNIT_NS = {"ms": 1_000_000, "s": NANOSECONDS, "m": 60 * NANOSECONDS, "h": 3600 * NANOSECONDS}
_GO_INT64_LIMIT = 1 << 63

CRD_TIMING_NAMES = {"lease_duration": "spec.timings.leaseDuration", "renew_deadline": "spec.timings.renewDeadline",
                    "retry_period": "spec.timings.retryPeriod"}
DRAIN_MARGIN_NS = 2 * NANOSECONDS
MAX_SIDECAR_PORT = 65534
"""The sidecar's control port is its port + 1, and ports end at 65535."""

_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", re.ASCII)
_QUALIFIED_NAME = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?",
    re.ASCII)
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", re.ASCII)
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", re.ASCII)
# Go's regexp \s is [\t\n\f\r ]: spelt out, since Python's \s also matches \v and Unicode spaces.
_HOOK_URL = re.compile(r"http://(127\.0\.0\.1|localhost|\[::1\])(:([0-9]{1,5}))?(/[^\t\n\f\r ]*)?", re.ASCII)
# What Go's strings.TrimSpace and CEL's trim() strip: unicode.IsSpace.
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
            "\u2028\u2029\u202f\u205f\u3000"
# resource.Quantity's grammar: sign, number, then a binary or decimal SI suffix or an exponent.
_QUANTITY = re.compile(r"([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?",
                       re.ASCII)
_BINARY_SUFFIX = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_SUFFIX = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
SIDECAR_RESOURCES = ("cpu", "memory", "ephemeral-storage")


class SpecError(ValueError):
    """A spec the operator cannot build; the message starts with the field's path."""


class WorkloadSpecError(SpecError):
    """An adopted workload's pod template breaks one of the group's rules: its owner may fix
    it without touching the group, so the operator tries again."""


def parse_duration(path: str, text: str) -> int:
    """Nanoseconds in a duration such as ``1m30s``, ``1500ms`` or ``0.0005s``: the strings the
    CRD's pattern admits (units h, m, s, ms; decimal fractions; at most 32 characters), read to
    the nanosecond exactly as Go's ``time.ParseDuration`` (the API server's CEL ``duration()``)
    reads them, longer fractions truncated the same way."""
    if len(text) > DURATION_MAX_LENGTH or not _DURATION.fullmatch(text):
        raise SpecError(f"{path}: {text!r} is not a duration like 6s, 1500ms, 0.25s or 1m30s "
                        f"(units h, m, s, ms; at most {DURATION_MAX_LENGTH} characters)")
    total = 0
    for whole, fraction, unit in _DURATION_TERM.findall(text):
        total += _go_duration_term(path, text, int(whole), fraction, _UNIT_NS[unit])
        if total > _GO_INT64_LIMIT:
            raise SpecError(f"{path}: {text!r} is longer than any duration can be (about 2562047h)")
    if total > _GO_INT64_LIMIT - 1:
        raise SpecError(f"{path}: {text!r} is longer than any duration can be (about 2562047h)")
    return total


def _go_duration_term(path: str, text: str, whole: int, fraction: str, unit: int) -> int:
    """One number-and-unit of Go's time.ParseDuration, step for step: the fraction's digits are
    kept while they fit in an int64 and then dropped, and the fraction is scaled by a float64
    and truncated (Python's float is the same IEEE double, so the result is the same)."""
    too_long = SpecError(f"{path}: {text!r} is longer than any duration can be (about 2562047h)")
    if whole > _GO_INT64_LIMIT or whole > _GO_INT64_LIMIT // unit:
        raise too_long
    value = whole * unit
    digits, scale, overflow = 0, 1.0, False
    for char in fraction:
        if overflow:
            continue
        if digits > (_GO_INT64_LIMIT - 1) // 10:
            overflow = True
            continue
        extended = digits * 10 + int(char)
        if extended > _GO_INT64_LIMIT:
            overflow = True
            continue
        digits, scale = extended, scale * 10
    if digits > 0:
        value += int(float(digits) * (float(unit) / scale))
        if value > _GO_INT64_LIMIT:
            raise too_long
    return value


def format_seconds(nanoseconds: int) -> str:
    """Exact decimal seconds (``7``, ``2.4``, ``0.000000001``), for the sidecar's settings: a
    rounded figure could break the timing rules the sidecar checks again."""
    whole, rest = divmod(nanoseconds, NANOSECONDS)
    return str(whole) if not rest else f"{whole}.{rest:09d}".rstrip("0")


def seconds_to_ns(seconds: float) -> int:
    """Whole nanoseconds of a float number of seconds read from a duration: exact for any
    duration below 10^6 s, since the float is then within 0.1 ns of it."""
    return round(seconds * NANOSECONDS)


WORKLOAD_KINDS = ("Deployment", "StatefulSet")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", re.ASCII)


@dataclass(frozen=True)
class WorkloadRef:
    """An existing apps/v1 workload the group adopts (``spec.workloadRef``)."""

    kind: str
    name: str

    def describe(self, namespace: str) -> str:
        return f"{self.kind} {namespace}/{self.name}"


def workload_ref(body: Mapping[str, Any]) -> WorkloadRef | None:
    """The workload a SingletonService adopts, or None when it carries a template."""
    raw = (body.get("spec") or {}).get("workloadRef")
    if raw is None:
        return None
    kind, name = raw.get("kind"), raw.get("name")
    if kind not in WORKLOAD_KINDS:
        raise SpecError(f"spec.workloadRef.kind: must be Deployment or StatefulSet, got {kind!r}")
    if not isinstance(name, str) or len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise SpecError(f"spec.workloadRef.name: must be the name of a {kind} (a DNS-1123 subdomain), got {name!r}")
    return WorkloadRef(kind=kind, name=name)


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
    sidecar_start_order: StartOrder = "AfterSidecars"
    """``spec.sidecar.startOrder``: after the native sidecars ahead of the first ordinary init
    container (a mesh proxy), first of all, or after every init container."""
    drain_hook_url: str | None = None
    postgres_secret: str | None = None
    postgres_secret_key: str = "dsn"
    postgres_mode: PostgresMode = "session"
    """``spec.postgres.mode``: ``session`` (advisory lock) or ``pooled`` (through a transaction pooler)."""
    postgres_connection_check: ConnectionCheck = "block"
    """``spec.postgres.connectionCheck`` (unset: the operator's --postgres-connection-check):
    whether the operator's own connection to the database, before it applies anything, blocks
    the group when it fails (``block``), only warns (``warn``: where only the app's pods can
    reach the database), or is not tried (``skip``)."""
    service_type: str = "ClusterIP"
    service_ports: tuple[ServicePort, ...] = ()
    service_annotations: dict[str, str] = field(default_factory=dict)
    pdb_enabled: bool = True
    workload_ref: WorkloadRef | None = None
    """Set when the group adopts an existing workload; ``template`` is then that workload's."""
    labels: dict[str, str] = field(default_factory=dict)
    """The SingletonService's own metadata.labels (passed on to the objects it owns)."""
    annotations: dict[str, str] = field(default_factory=dict)
    """The SingletonService's own metadata.annotations (those it names are passed on)."""
    sidecar_pull_policy: str | None = None
    """The operator's --sidecar-image-pull-policy (None: Kubernetes' default for the image)."""
    image_pull_secrets: tuple[str, ...] = ()
    """The operator's --sidecar-image-pull-secret names, added to every group's pods."""

    @property
    def uses_postgres(self) -> bool:
        return self.backend in ("postgres", "both")


def _timings(backend: Backend, raw: dict[str, Any] | None) -> Timings:
    if not raw:
        return BACKEND_DEFAULTS[backend]
    try:
        lease = parse_duration("spec.timings.leaseDuration", str(raw["leaseDuration"]))
        renew = parse_duration("spec.timings.renewDeadline", str(raw["renewDeadline"]))
        retry = parse_duration("spec.timings.retryPeriod", str(raw["retryPeriod"]))
    except KeyError as exc:
        raise SpecError(f"spec.timings.{exc.args[0]}: required when spec.timings is set") from None
    # The one rule set (core.timings), on durations exact to the nanosecond, said in the CRD's names.
    try:
        return Timings(lease_duration=lease / NANOSECONDS, renew_deadline=renew / NANOSECONDS,
                       retry_period=retry / NANOSECONDS)
    except TimingError as exc:
        raise SpecError(exc.render(CRD_TIMING_NAMES)) from None


def _drain_timeout(drain: Mapping[str, Any], grace: int) -> float:
    timeout = parse_duration("spec.drain.timeout", str(drain.get("timeout", "20s")))
    if timeout <= 0:
        raise SpecError("spec.drain.timeout: must be longer than 0s")
    if timeout + DRAIN_MARGIN_NS > grace * NANOSECONDS:
        raise SpecError("spec.drain.timeout: must be at least 2s shorter than spec.terminationGracePeriodSeconds, "
                        "so the lock is released before the pod is killed")
    return timeout / NANOSECONDS


def _hook_url(url: str | None, sidecar_port: int) -> str | None:
    if not url:
        return None
    match = _HOOK_URL.fullmatch(url)
    if match is None:
        raise SpecError(f"spec.drain.hookURL: {url!r} is not an http:// URL on 127.0.0.1, localhost or [::1]")
    port = int(match.group(3)) if match.group(3) is not None else 80
    if not 1 <= port <= 65535:
        raise SpecError("spec.drain.hookURL: must have a port from 1 to 65535 (or none, for 80)")
    if port in (sidecar_port, sidecar_port + 1):
        raise SpecError("spec.drain.hookURL: must not use the sidecar's own ports (spec.sidecar.port and the "
                        "control port spec.sidecar.port + 1; no port means 80): the sidecar would ask itself "
                        "to drain instead of the app")
    return url


def has_go_space_around(text: str) -> bool:
    """Leading or trailing whitespace, as the API server's pod validation (and CEL's trim())
    sees it."""
    return text != text.strip(_GO_SPACE)


def is_qualified_name(key: str) -> bool:
    """A label or annotation key: an optional DNS subdomain prefix (at most 253 characters)
    and '/', then a name of at most 63 characters."""
    return _QUALIFIED_NAME.fullmatch(key) is not None and key.find("/") <= 253


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and _LABEL_VALUE.fullmatch(value) is not None


def is_port_name(name: str) -> bool:
    """An IANA service name, as containerPort names and named targetPorts must be."""
    return (len(name) <= 15 and _PORT_NAME.fullmatch(name) is not None
            and re.search("[a-z]", name) is not None and "--" not in name)


def parse_quantity(text: str) -> decimal.Decimal | None:
    """The value of a resource.Quantity string (``10m``, ``64Mi``, ``1e3``), None if it is
    not one. Exact: a Decimal with enough precision for any quantity of at most 64
    characters."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return None
    sign, number, suffix = match.group(1), match.group(2), match.group(3) or ""
    with decimal.localcontext() as context:
        context.prec, context.Emax, context.Emin = 200, decimal.MAX_EMAX, decimal.MIN_EMIN
        value = decimal.Decimal(number)
        if suffix in _BINARY_SUFFIX:
            value *= 2 ** _BINARY_SUFFIX[suffix]
        elif suffix in _DECIMAL_SUFFIX:
            value = value.scaleb(_DECIMAL_SUFFIX[suffix])
        else:
            exponent = int(suffix[1:])
            if not -(2**31) <= exponent < 2**31:  # Go parses the exponent as an int32
                return None
            value = value.scaleb(exponent)
        return -value if sign == "-" else value


def _names(items: Iterable[Mapping[str, Any]]) -> list[str]:
    return [str(item.get("name")) for item in items]


def _check_containers(pod: Mapping[str, Any], gating: GatingMode, main: str) -> None:
    containers: list[dict[str, Any]] = pod.get("containers") or []
    inits: list[dict[str, Any]] = pod.get("initContainers") or []
    for kind, items in (("containers", containers), ("initContainers", inits)):
        names = _names(items)
        if len(set(names)) != len(names):
            raise SpecError(f"spec.template.spec.{kind}: container names in spec.template.spec.{kind} must be unique")
        if SIDECAR_CONTAINER in names:
            raise SpecError(f"spec.template.spec.{kind}: the container name {SIDECAR_CONTAINER} is reserved for "
                            "the sidecar")
        for index, container in enumerate(items):
            image = container.get("image")
            if not isinstance(image, str) or not image:
                raise SpecError(f"spec.template.spec.{kind}[{index}].image: required")
            if has_go_space_around(image):
                raise SpecError(f"spec.template.spec.{kind}[{index}].image: must not have leading or trailing "
                                "whitespace (the API server refuses such pods)")
            for port_index, port in enumerate(container.get("ports") or []):
                name = port.get("name")
                if name and not is_port_name(str(name)):
                    raise SpecError(f"spec.template.spec.{kind}[{index}].ports[{port_index}].name: a containerPort "
                                    "name must be an IANA service name: at most 15 lower case letters, digits and "
                                    "'-', with a letter, not starting or ending with '-', without '--'")
    if set(_names(containers)) & set(_names(inits)):
        raise SpecError("spec.template.spec.containers: names in spec.template.spec.containers and "
                        "spec.template.spec.initContainers must be unique")
    if gating == "file":
        _check_file_gating(pod, containers, main)


def _check_file_gating(pod: Mapping[str, Any], containers: list[dict[str, Any]], main: str) -> None:
    if GATE_VOLUME in _names(pod.get("volumes") or []):
        raise SpecError(f"spec.template.spec.volumes: the volume name {GATE_VOLUME} is reserved for the "
                        "operator's file-gate volume")
    container = next(c for c in containers if c.get("name") == main)
    if not container.get("command"):
        raise SpecError("spec.gating.mode: file needs the main container (spec.mainContainer, or the first of "
                        "spec.template.spec.containers) to set command: the operator wraps it with the gate "
                        "script and cannot read an image's entrypoint")
    if any(m.get("mountPath") in (GATE_DIR, GATE_DIR + "/") for m in container.get("volumeMounts") or []):
        raise SpecError(f"spec.gating.mode: file mounts the gate folder at {GATE_DIR} in the main container, "
                        "so its volumeMounts must not use that mountPath")


def _container_ports(pod: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(name, number) of every containerPort of the template's containers and init containers."""
    return [(str(p.get("name") or ""), int(p["containerPort"]))
            for c in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]
            for p in c.get("ports") or [] if "containerPort" in p]


def _check_sidecar_port(port: int, pod: Mapping[str, Any]) -> None:
    if not 1 <= port <= MAX_SIDECAR_PORT:
        raise SpecError(f"spec.sidecar.port: must be from 1 to {MAX_SIDECAR_PORT}: the sidecar's loopback control "
                        "port is spec.sidecar.port + 1")
    if any(number in (port, port + 1) for _, number in _container_ports(pod)):
        raise SpecError("spec.sidecar.port: spec.sidecar.port and spec.sidecar.port + 1 (the sidecar's loopback "
                        "control port) must differ from every containerPort in spec.template.spec.containers and "
                        "spec.template.spec.initContainers (the sidecar shares the pod's network)")


def _check_keys(path: str, mapping: Mapping[str, Any], *, label_values: bool = False) -> None:
    for key, value in mapping.items():
        if not is_qualified_name(str(key)):
            raise SpecError(f"{path}: keys must be qualified names: an optional DNS subdomain prefix of at most "
                            f"253 characters and '/', then at most 63 letters, digits, '-', '_' or '.', starting and "
                            f"ending with a letter or digit; got {key!r}")
        if label_values and not is_label_value(str(value)):
            raise SpecError(f"{path}: values must be empty or at most 63 letters, digits, '-', '_' or '.', starting "
                            f"and ending with a letter or digit; got {value!r} for {key!r}")


def _service_ports(service: Mapping[str, Any], pod: Mapping[str, Any], sidecar_port: int) -> tuple[ServicePort, ...]:
    ports = tuple(ServicePort(port=int(p["port"]), name=p.get("name"), target_port=p.get("targetPort"),
                              protocol=p.get("protocol", "TCP")) for p in service.get("ports") or ())
    declared = {name for name, _ in _container_ports(pod) if name} | {SIDECAR_PORT_NAME}
    for index, port in enumerate(ports):
        target = port.target_port if port.target_port is not None else port.port
        if isinstance(target, int):
            if not 1 <= target <= 65535:
                raise SpecError(f"spec.service.ports[{index}].targetPort: must be a port number from 1 to 65535 or "
                                "a port name")
            if target == sidecar_port + 1:
                raise SpecError(f"spec.service.ports[{index}]: must not send traffic to spec.sidecar.port + 1, the "
                                "sidecar's control port, which listens on the pod's loopback only")
        elif not is_port_name(str(target)):
            raise SpecError(f"spec.service.ports[{index}].targetPort: must be a port number from 1 to 65535 or a "
                            "port name (an IANA service name: at most 15 lower case letters, digits and '-', with a "
                            "letter, not starting or ending with '-', without '--')")
        elif target not in declared:
            raise SpecError(f"spec.service.ports[{index}].targetPort: a named targetPort must be the name of a "
                            "containerPort in spec.template.spec.containers or initContainers (or singleton, the "
                            "sidecar's port)")
    return ports


def _sidecar_resources(raw: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not raw:
        return None
    values: dict[str, dict[str, decimal.Decimal]] = {}
    for kind in ("requests", "limits"):
        values[kind] = {}
        for name, quantity in (raw.get(kind) or {}).items():
            if name not in SIDECAR_RESOURCES:
                raise SpecError(f"spec.sidecar.resources.{kind}: may only name cpu, memory and ephemeral-storage")
            value = parse_quantity(str(quantity))
            if value is None or value < 0:
                raise SpecError(f"spec.sidecar.resources.{kind}[{name}]: must be a quantity of at least 0, such "
                                f"as 10m, 0.5, 64Mi or 1G; got {quantity!r}")
            values[kind][name] = value
    for name, request in values["requests"].items():
        if name in values["limits"] and request > values["limits"][name]:
            raise SpecError("spec.sidecar.resources.requests: must not exceed spec.sidecar.resources.limits "
                            f"({name})")
    return dict(raw)


def read_spec(body: dict[str, Any], *, default_sidecar_image: str,
              workload: Mapping[str, Any] | None = None,
              default_connection_check: ConnectionCheck = "block") -> GroupSpec:
    """The resolved spec of a SingletonService object (as the API server returns it).
    ``default_connection_check``: the operator's --postgres-connection-check, for a group that
    does not set ``spec.postgres.connectionCheck``.

    A group that adopts a workload (``spec.workloadRef``) is read with that workload as the
    API server returns it (or the pod being admitted, in the pod's own shape): its pod
    template takes the place of ``spec.template``, checked by the same rules, and its
    ``spec.replicas`` is the group's."""
    spec = body.get("spec") or {}
    ref = workload_ref(body)
    if ref is None:
        if workload is not None:
            raise ValueError("a workload was given for a group that carries its own template")
        return _read_spec(body, spec.get("template") or {}, int(spec.get("replicas", 2)), default_sidecar_image,
                          None, default_connection_check=default_connection_check)
    if spec.get("template") is not None:
        raise SpecError("spec.template: must not be set together with spec.workloadRef (the group runs the adopted "
                        "workload's own pod template)")
    where = ref.describe(body["metadata"]["namespace"])
    if workload is None:
        raise ValueError(f"{where} must be read before the spec of the group that adopts it")
    workload_spec = workload.get("spec") or {}
    try:
        return _read_spec(body, workload_spec.get("template") or {}, int(workload_spec.get("replicas", 1)),
                          default_sidecar_image, ref, default_connection_check=default_connection_check)
    except SpecError as exc:
        if "spec.template" in str(exc):
            raise WorkloadSpecError(f"{exc} (in the adopted {where})") from None
        raise


def _read_spec(body: dict[str, Any], template: dict[str, Any], replicas: int, default_sidecar_image: str,
               ref: WorkloadRef | None, *, default_connection_check: ConnectionCheck) -> GroupSpec:
    metadata, spec = body["metadata"], body.get("spec") or {}
    name = metadata["name"]
    backend: Backend = spec.get("backend", "lease")
    if backend not in ("postgres", "lease", "both"):
        raise SpecError(f"spec.backend: must be postgres, lease or both, got {backend!r}")
    pod = template.get("spec") or {}
    containers = pod.get("containers") or []
    if not containers:
        raise SpecError("spec.template.spec.containers: at least one container is required")
    main = spec.get("mainContainer") or containers[0]["name"]
    if main not in {c.get("name") for c in containers}:
        raise SpecError(f"spec.mainContainer: no container named {main!r} in spec.template.spec.containers")
    gating: GatingMode = (spec.get("gating") or {}).get("mode", "cooperative")
    _check_containers(pod, gating, main)
    template_metadata = template.get("metadata") or {}
    _check_keys("spec.template.metadata.labels", template_metadata.get("labels") or {}, label_values=True)
    _check_keys("spec.template.metadata.annotations", template_metadata.get("annotations") or {})
    postgres = spec.get("postgres") or {}
    secret_ref = postgres.get("secretRef") or {}
    if backend != "lease" and not secret_ref.get("name"):
        raise SpecError(f"spec.postgres.secretRef.name: required with backend {backend}")
    secret_key = secret_ref.get("key", "dsn")
    if secret_key == "." or secret_key.startswith(".."):
        raise SpecError("spec.postgres.secretRef.key: must not be '.' or start with '..' (not a valid Secret key)")
    postgres_mode: PostgresMode = postgres.get("mode", "session")
    if postgres_mode not in ("session", "pooled"):
        raise SpecError(f"spec.postgres.mode: must be session or pooled, got {postgres_mode!r}")
    connection_check: ConnectionCheck = postgres.get("connectionCheck", default_connection_check)
    if connection_check not in CONNECTION_CHECKS:
        raise SpecError(f"spec.postgres.connectionCheck: must be block, warn or skip, got {connection_check!r}")
    sidecar = spec.get("sidecar") or {}
    sidecar_port = int(sidecar.get("port", DEFAULT_SIDECAR_PORT))
    _check_sidecar_port(sidecar_port, pod)
    sidecar_image = sidecar.get("image") or default_sidecar_image
    start_order: StartOrder = sidecar.get("startOrder", "AfterSidecars")
    if start_order not in START_ORDERS:
        raise SpecError(f"spec.sidecar.startOrder: must be AfterSidecars, First or Last, got {start_order!r}")
    if has_go_space_around(sidecar_image):
        raise SpecError("spec.sidecar.image: must not have leading or trailing whitespace (the API server refuses "
                        "such pods)")
    service = spec.get("service") or {}
    service_ports = _service_ports(service, pod, sidecar_port)
    if service_ports and not re.match("[a-z]", name):
        # <name>-leader must be a DNS-1035 label. Admission refuses such names for every new
        # group; one admitted before can run, only without a leader Service.
        raise SpecError("metadata.name: must start with a letter: the leader Service <name>-leader is named after "
                        "it, and Service names (DNS-1035 labels) cannot start with a digit")
    service_annotations = dict(service.get("annotations") or {})
    _check_keys("spec.service.annotations", service_annotations)
    drain = spec.get("drain") or {}
    termination_grace = int(spec.get("terminationGracePeriodSeconds", 30))
    return GroupSpec(
        name=name,
        namespace=metadata["namespace"],
        uid=metadata["uid"],
        generation=int(metadata.get("generation", 0)),
        replicas=replicas,
        backend=backend,
        timings=_timings(backend, spec.get("timings")),
        drain_timeout=_drain_timeout(drain, termination_grace),
        drain_hook_url=_hook_url(drain.get("hookURL"), sidecar_port),
        termination_grace=termination_grace,
        gating=gating,
        main_container=main,
        template=template,
        sidecar_image=sidecar_image,
        sidecar_port=sidecar_port,
        sidecar_log_level=sidecar.get("logLevel", "info"),
        sidecar_resources=_sidecar_resources(sidecar.get("resources")),
        sidecar_start_order=start_order,
        postgres_secret=secret_ref.get("name"),
        postgres_secret_key=secret_key,
        postgres_mode=postgres_mode,
        postgres_connection_check=connection_check,
        service_type=service.get("type", "ClusterIP"),
        service_ports=service_ports,
        service_annotations=service_annotations,
        pdb_enabled=bool((spec.get("podDisruptionBudget") or {}).get("enabled", True)),
        workload_ref=ref,
        labels=dict(metadata.get("labels") or {}),
        annotations=dict(metadata.get("annotations") or {}),
    )
