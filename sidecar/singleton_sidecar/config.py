"""Sidecar settings: defaults < environment < flags, validated once at start.

Called by ``cli``; every error names the setting (flag and variable) it is about.
"""

from __future__ import annotations

import argparse
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from singleton_election import contract
from singleton_election.core.identity import validate_identity
from singleton_election.core.lock import Identity
from singleton_election.core.timings import BACKEND_DEFAULTS, FIELDS, TimingError, Timings, default_timings
from singleton_election.settings import ConfigError, Listen, parse_listen

BackendName = Literal["postgres", "lease", "both"]
BACKENDS: tuple[BackendName, ...] = ("postgres", "lease", "both")
PostgresMode = Literal["session", "pooled"]
POSTGRES_MODES: tuple[PostgresMode, ...] = ("session", "pooled")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class SidecarConfig:
    group: str
    """Name of the singleton group (the Lease's name; the Postgres lock row's key)."""
    backend: BackendName
    """Where the lock lives: ``postgres``, ``lease`` or ``both`` (lead only while holding both)."""
    timings: Timings
    """Lease duration, renew deadline and retry period."""
    identity: Identity | None = None
    """Explicit candidate identity; default: pod name + pod UID + start nonce."""
    postgres_dsn: str | None = field(default=None, repr=False)
    """PostgreSQL connection string (secret: never logged)."""
    postgres_mode: PostgresMode = "session"
    """``session``: an advisory lock on a dedicated connection per sidecar (crash failover in
    milliseconds; no transaction pooler). ``pooled``: expiring rows written in short
    transactions, through PgBouncer or RDS Proxy in transaction mode (``backends.postgres_pooled``)."""
    namespace: str | None = None
    """Namespace of the pod and the Lease; None outside Kubernetes."""
    lock_key: str = ""
    """The group's key in PostgreSQL (lock and fence rows), the same on every replica wherever
    it runs: ``SINGLETON_LOCK_KEY``, else ``<namespace>/<group>``; required with PostgreSQL."""
    pod_name: str | None = None
    """This pod's name (downward API); enables pod annotations, labels and events."""
    pod_uid: str | None = None
    """This pod's UID (downward API), part of the identity."""
    listen: Listen = Listen("0.0.0.0", 8080)
    """Probe and metrics endpoint: /readyz, /livez, /leader, /metrics."""
    control_listen: Listen = Listen("127.0.0.1", 8081)
    """Control endpoint (drain, release, step-down): loopback only."""
    drain_timeout: float = 30.0
    """Seconds the app may take to finish in-flight work before the lock is released anyway."""
    drain_url: str | None = None
    """Optional URL the sidecar POSTs to ask the app to drain; its 2xx answer means done."""
    gate_dir: Path | None = None
    """Folder shared with the main container for the file gate (``gate.sh`` and the leader flag)."""
    kill_grace: float = 1.0
    """Seconds between SIGTERM and SIGKILL for a gated process that lost leadership."""
    kubeconfig: str | None = None
    """Kubeconfig path for running outside a pod (default: in-cluster, then $KUBECONFIG)."""
    exec_command: tuple[str, ...] = ()
    """Command run as a child only while this replica leads (the exec gate)."""
    readiness_gate: bool = False
    """Also set the pod condition ``singleton.dev/leader`` (for pod readiness gates)."""
    drain_wait_container: str | None = None
    """On drain, also wait until this container of the pod has terminated (read from the pod)."""
    native_sidecar: bool = False
    """This sidecar is a native sidecar (an init container with ``restartPolicy: Always``): while
    the pod is being deleted, the kubelet sends it SIGTERM only once the main containers have
    exited, which ends the wait for ``drain_wait_container`` (the kubelet publishes the
    containers' states only after the whole pod has stopped)."""
    sole_candidate_in_pod: bool = False
    """This sidecar is its group's only candidate in its pod (the operator's and the webhook's
    pods): a term held by an earlier incarnation of it in this pod (the kubelet restarted the
    container) is taken over at once instead of waited out (``core.identity.is_predecessor``)."""
    log_format: Literal["json", "text"] = "json"
    """Structured JSON logs (default) or plain text."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe level logged."""

    @property
    def in_kubernetes(self) -> bool:
        return self.pod_name is not None and self.namespace is not None


_SETTINGS: dict[str, tuple[str, str]] = {
    # dest: (flag, environment variable)
    "group": ("--group", contract.ENV_GROUP),
    "identity": ("--identity", contract.ENV_IDENTITY),
    "backend": ("--backend", contract.ENV_BACKEND),
    "postgres_dsn": ("--postgres-dsn", contract.ENV_POSTGRES_DSN),
    "postgres_dsn_file": ("--postgres-dsn-file", contract.ENV_POSTGRES_DSN_FILE),
    "postgres_mode": ("--postgres-mode", contract.ENV_POSTGRES_MODE),
    "namespace": ("--namespace", contract.ENV_NAMESPACE),
    "lock_key": ("--lock-key", contract.ENV_LOCK_KEY),
    "pod_name": ("--pod-name", contract.ENV_POD_NAME),
    "pod_uid": ("--pod-uid", contract.ENV_POD_UID),
    "listen": ("--listen", contract.ENV_LISTEN),
    "control_listen": ("--control-listen", contract.ENV_CONTROL_LISTEN),
    "lease_duration": ("--lease-duration", contract.ENV_LEASE_DURATION),
    "renew_deadline": ("--renew-deadline", contract.ENV_RENEW_DEADLINE),
    "retry_period": ("--retry-period", contract.ENV_RETRY_PERIOD),
    "drain_timeout": ("--drain-timeout", contract.ENV_DRAIN_TIMEOUT),
    "drain_url": ("--drain-url", contract.ENV_DRAIN_URL),
    "gate_dir": ("--gate-dir", contract.ENV_GATE_DIR),
    "kill_grace": ("--kill-grace", "SINGLETON_KILL_GRACE"),
    "kubeconfig": ("--kubeconfig", contract.ENV_KUBECONFIG),
    "readiness_gate": ("--readiness-gate", contract.ENV_READINESS_GATE),
    "drain_wait_container": ("--drain-wait-container", contract.ENV_DRAIN_WAIT_CONTAINER),
    "native_sidecar": ("--native-sidecar", contract.ENV_NATIVE_SIDECAR),
    "sole_candidate_in_pod": ("--sole-candidate-in-pod", contract.ENV_SOLE_CANDIDATE_IN_POD),
    "log_format": ("--log-format", contract.ENV_LOG_FORMAT),
    "log_level": ("--log-level", contract.ENV_LOG_LEVEL),
}

_HELP = {
    "group": "singleton group name (DNS-1123 label); required",
    "identity": "candidate identity (default: pod name/pod UID/start nonce, or host/pid/nonce)",
    "backend": "lock store: postgres, lease or both (default postgres)",
    "postgres_dsn": "PostgreSQL DSN (postgres and both backends)",
    "postgres_dsn_file": "file holding the PostgreSQL DSN (for a mounted Secret)",
    "postgres_mode": ("session (default: an advisory lock on a connection per sidecar) or pooled (expiring rows "
                      "in short transactions, for PgBouncer/RDS Proxy in transaction mode)"),
    "namespace": "namespace of this pod and of the Lease",
    "lock_key": ("key of the group's PostgreSQL lock and fence, the same on every replica wherever it runs "
                 "(default <namespace>/<group>; required outside Kubernetes with postgres and both)"),
    "pod_name": "this pod's name (downward API: metadata.name)",
    "pod_uid": "this pod's UID (downward API: metadata.uid)",
    "listen": "host:port for /readyz /livez /leader /metrics (default 0.0.0.0:8080)",
    "control_listen": "loopback host:port for control actions (default 127.0.0.1:8081)",
    "lease_duration": "seconds a lock stays valid without renewal (default 6 with postgres, 9 with lease/both)",
    "renew_deadline": ("seconds the leader keeps trying to renew before stepping down "
                       "(default 4 with postgres, 7.5 with lease/both)"),
    "retry_period": "seconds between renewals and between retries (default 2 with postgres, 6 with lease/both)",
    "drain_timeout": "seconds the app may take to drain before the lock is released (default 30)",
    "drain_url": "URL to POST to ask the app to drain; a 2xx answer means drained",
    "gate_dir": "folder shared with the main container for the file gate",
    "kill_grace": "seconds from SIGTERM to SIGKILL for a gated process that lost leadership (default 1)",
    "kubeconfig": "kubeconfig file when not running in a pod",
    "readiness_gate": "also set the pod condition singleton.dev/leader (true/false)",
    "drain_wait_container": ("in a pod: on drain, also wait until this container of the pod has stopped "
                             "(the main container, for apps that stop on SIGTERM)"),
    "sole_candidate_in_pod": ("true when this is the group's only sidecar in its pod: a term left by this "
                              "container's earlier incarnation (the kubelet restarted it) is taken over at once "
                              "(needs the pod name and UID and no --identity)"),
    "native_sidecar": ("true when this container is a native sidecar (Kubernetes 1.29+): a SIGTERM during "
                       "the pod's deletion then means the main containers have exited (true/false)"),
    "log_format": "json (default) or text",
    "log_level": "debug, info (default), warning or error",
}


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    for dest, (flag, env) in _SETTINGS.items():
        parser.add_argument(flag, dest=dest, default=None, metavar=dest.upper(), help=f"{_HELP[dest]} [{env}]")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: command to run only while this replica leads (the exec gate)")


def _positive_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of seconds, got {raw!r}") from None
    if not (0 < value < float("inf")):
        raise ConfigError(f"{name}: must be a positive number of seconds, got {raw!r}")
    return value


def _bool(name: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name}: must be true or false, got {raw!r}")


def load_config(args: argparse.Namespace, environ: Mapping[str, str]) -> SidecarConfig:  # noqa: PLR0912, PLR0915
    """Merge flags over environment over defaults and validate everything once."""
    raw: dict[str, str] = {}
    for dest, (_flag, env) in _SETTINGS.items():
        value = getattr(args, dest, None)
        if value is None:
            value = environ.get(env)
        if value is not None:
            raw[dest] = value

    def label(dest: str) -> str:
        flag, env = _SETTINGS[dest]
        return f"{env} ({flag})"

    group = raw.get("group", "")
    if not group:
        raise ConfigError(f"{label('group')}: required: the name of the singleton group")
    if len(group) > 63 or not _DNS1123.match(group):
        raise ConfigError(f"{label('group')}: must be a DNS-1123 label (a-z, 0-9, '-', at most 63), got {group!r}")

    backend = raw.get("backend", "postgres")
    if backend not in BACKENDS:
        raise ConfigError(f"{label('backend')}: must be one of postgres, lease, both; got {backend!r}")

    identity = None
    if "identity" in raw:
        try:
            identity = validate_identity(raw["identity"])
        except ValueError as exc:
            raise ConfigError(f"{label('identity')}: {exc}") from None

    dsn = raw.get("postgres_dsn")
    if "postgres_dsn_file" in raw:
        if dsn is not None:
            raise ConfigError(f"{label('postgres_dsn_file')}: give the DSN or a file holding it, not both")
        try:
            dsn = Path(raw["postgres_dsn_file"]).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{label('postgres_dsn_file')}: cannot read {raw['postgres_dsn_file']!r}: "
                              f"{exc.strerror}") from None
    if backend in ("postgres", "both"):
        if not dsn:
            raise ConfigError(f"{label('postgres_dsn')}: required with backend {backend}")
        if not dsn.startswith(("postgres://", "postgresql://")):
            raise ConfigError(f"{label('postgres_dsn')}: must be a postgres:// or postgresql:// URL")

    postgres_mode = raw.get("postgres_mode", "session")
    if postgres_mode not in POSTGRES_MODES:
        raise ConfigError(f"{label('postgres_mode')}: must be session or pooled, got {postgres_mode!r}")

    namespace = raw.get("namespace") or None
    pod_name = raw.get("pod_name") or None
    if backend in ("lease", "both") and not namespace:
        raise ConfigError(f"{label('namespace')}: required with backend {backend} (the Lease's namespace)")
    if pod_name and not namespace:
        raise ConfigError(f"{label('namespace')}: required when the pod name is given")

    lock_key = raw.get("lock_key") or (contract.lock_key(group, namespace) if namespace else "")
    if backend in ("postgres", "both") and not lock_key:
        raise ConfigError(
            f"{label('lock_key')}: required with backend {backend} outside Kubernetes: the key of the group's lock "
            f"and fence, the same on every replica wherever it runs (in a cluster the operator sets "
            f"<namespace>/<group>, e.g. default/{group})")
    if len(lock_key) > 253 or not lock_key.isprintable() or lock_key != lock_key.strip():
        raise ConfigError(f"{label('lock_key')}: must be 1 to 253 printable characters without surrounding "
                          f"spaces, got {lock_key!r}")

    timings_kwargs = {}
    for dest in ("lease_duration", "renew_deadline", "retry_period"):
        if dest in raw:
            timings_kwargs[dest] = _positive_seconds(label(dest), raw[dest])
    try:
        timings = default_timings(backend, **timings_kwargs)
    except TimingError as exc:
        # Said in the settings' names, each with its value: given, or the backend's default.
        defaults = BACKEND_DEFAULTS[backend]
        raise ConfigError(exc.render({
            dest: f"{label(dest)} = {timings_kwargs.get(dest, getattr(defaults, dest)):g}s"
            + ("" if dest in timings_kwargs else f" (the {backend} default)") for dest in FIELDS})) from None

    kill_grace = _positive_seconds(label("kill_grace"), raw["kill_grace"]) if "kill_grace" in raw else min(
        1.0, timings.stop_margin / 2)
    if kill_grace >= timings.stop_margin:
        raise ConfigError(
            f"{label('kill_grace')}: must be shorter than lease_duration - renew_deadline "
            f"({timings.stop_margin:g}s) so a gated process is dead before anyone else can lead; got {kill_grace:g}s"
        )

    drain_url = raw.get("drain_url") or None
    if drain_url is not None and not drain_url.startswith(("http://", "https://")):
        raise ConfigError(f"{label('drain_url')}: must be an http:// or https:// URL, got {drain_url!r}")
    if drain_url is not None:
        # Checked now: the HTTP client raises ValueError for a port above 65535 only when the
        # drain POSTs, and port 0 cannot be connected to.
        try:
            drain_port = urllib.parse.urlsplit(drain_url).port
        except ValueError:
            drain_port = 0
        if drain_port == 0:
            raise ConfigError(f"{label('drain_url')}: the port must be from 1 to 65535, got {drain_url!r}")
        parts = urllib.parse.urlsplit(drain_url)
        if not parts.hostname:
            raise ConfigError(f"{label('drain_url')}: the URL has no host, got {drain_url!r}")
        if any(c.isspace() or not c.isascii() for c in drain_url):
            raise ConfigError(f"{label('drain_url')}: spaces and non-ASCII characters must be percent-encoded, "
                              f"got {drain_url!r}")

    command = tuple(args.command[1:] if args.command and args.command[0] == "--" else args.command or ())
    log_format = raw.get("log_format", "json")
    if log_format not in ("json", "text"):
        raise ConfigError(f"{label('log_format')}: must be json or text, got {log_format!r}")

    log_level = raw.get("log_level", "info")
    if log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{label('log_level')}: must be debug, info, warning or error, got {log_level!r}")
    drain_wait_container = raw.get("drain_wait_container") or None
    if drain_wait_container is not None:
        if not pod_name:
            raise ConfigError(f"{label('drain_wait_container')}: needs the pod name "
                              f"({contract.ENV_POD_NAME}): the container's state is read from the pod")
        if len(drain_wait_container) > 63 or not _DNS1123.match(drain_wait_container):
            raise ConfigError(f"{label('drain_wait_container')}: must be a container name (DNS-1123 label), "
                              f"got {drain_wait_container!r}")
    native_sidecar = _bool(label("native_sidecar"), raw["native_sidecar"]) if "native_sidecar" in raw else False
    if native_sidecar and drain_wait_container is None:
        raise ConfigError(f"{label('native_sidecar')}: needs {label('drain_wait_container')} "
                          "(the container whose exit a SIGTERM then stands for)")

    sole_candidate = (_bool(label("sole_candidate_in_pod"), raw["sole_candidate_in_pod"])
                      if "sole_candidate_in_pod" in raw else False)
    if sole_candidate and (not pod_name or not raw.get("pod_uid") or identity is not None):
        raise ConfigError(f"{label('sole_candidate_in_pod')}: needs the pod name and UID ({contract.ENV_POD_NAME}, "
                          f"{contract.ENV_POD_UID}) and no {label('identity')}: it recognises its earlier "
                          "incarnations by the identity the sidecar makes from them")

    return SidecarConfig(
        group=group,
        backend=backend,
        timings=timings,
        identity=identity,
        postgres_dsn=dsn,
        postgres_mode=postgres_mode,
        namespace=namespace,
        lock_key=lock_key,
        pod_name=pod_name,
        pod_uid=raw.get("pod_uid") or None,
        listen=parse_listen(label("listen"), raw["listen"]) if "listen" in raw else SidecarConfig.listen,
        control_listen=parse_listen(label("control_listen"), raw["control_listen"], loopback_only=True)
        if "control_listen" in raw else SidecarConfig.control_listen,
        drain_timeout=_positive_seconds(label("drain_timeout"), raw["drain_timeout"])
        if "drain_timeout" in raw else 30.0,
        drain_url=drain_url,
        gate_dir=Path(raw["gate_dir"]) if raw.get("gate_dir") else None,
        kill_grace=kill_grace,
        kubeconfig=raw.get("kubeconfig") or None,
        exec_command=command,
        readiness_gate=_bool(label("readiness_gate"), raw["readiness_gate"]) if "readiness_gate" in raw else False,
        drain_wait_container=drain_wait_container,
        native_sidecar=native_sidecar,
        sole_candidate_in_pod=sole_candidate,
        log_format=log_format,  # type: ignore[arg-type]
        log_level=log_level,  # type: ignore[arg-type]
    )


def describe(config: SidecarConfig) -> dict[str, object]:
    """The configuration as logged at start: no secrets."""
    return {
        "group": config.group, "backend": config.backend, "namespace": config.namespace,
        "lock_key": config.lock_key,
        "pod": config.pod_name, "listen": str(config.listen), "control_listen": str(config.control_listen),
        "lease_duration": config.timings.lease_duration, "renew_deadline": config.timings.renew_deadline,
        "retry_period": config.timings.retry_period, "drain_timeout": config.drain_timeout,
        "gate": "exec" if config.exec_command else ("file" if config.gate_dir else "none"),
        "postgres": f"configured ({config.postgres_mode} mode)" if config.postgres_dsn else "none",
    }


