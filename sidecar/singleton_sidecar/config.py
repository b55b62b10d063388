"""Sidecar settings: defaults < environment < flags, validated once at start.

Called by ``cli``; every error names the setting (flag and variable) it is about. Each setting is
declared once, in ``SETTINGS`` (flag, variable, parser, default, help): ``add_run_arguments``
and ``read_settings`` are driven by it, and ``load_config`` adds only the checks that involve
several settings.
"""

from __future__ import annotations

import argparse
import functools
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar, cast

from singleton_election import contract
from singleton_election.core.identity import validate_identity
from singleton_election.core.lock import Identity
from singleton_election.core.timings import BACKEND_DEFAULTS, FIELDS, TimingError, Timings, default_timings
from singleton_election.settings import (
    ConfigError,
    Listen,
    parse_bool,
    parse_choice,
    parse_listen,
    parse_positive_seconds,
)

BackendName = Literal["postgres", "lease", "both"]
BACKENDS: tuple[BackendName, ...] = ("postgres", "lease", "both")
PostgresMode = Literal["session", "pooled"]
POSTGRES_MODES: tuple[PostgresMode, ...] = ("session", "pooled")
LogFormat = Literal["json", "text"]
LOG_FORMATS: tuple[LogFormat, ...] = ("json", "text")
LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[LogLevel, ...] = ("debug", "info", "warning", "error")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

Value = TypeVar("Value")


@dataclass(frozen=True)
class Setting(Generic[Value]):
    """One setting of ``singleton-sidecar run``: read from its flag, else its variable, else its default."""

    name: str
    """The argparse destination (and, upper-cased, the flag's metavar); the SidecarConfig field's
    name where the setting has one of its own."""
    flag: str
    env: str
    parse: Callable[[str, str], Value]
    """``(label, raw)`` to the typed value; raises ConfigError starting with the label."""
    default: Value
    """The value when neither the flag nor the variable is given (not parsed)."""
    help: str
    required: bool = False
    """A missing required setting is parsed as the empty text: its parser's message for an empty
    value says that it is required."""

    @property
    def label(self) -> str:
        """How every error names the setting."""
        return f"{self.env} ({self.flag})"


def _text(_label: str, raw: str) -> str:
    return raw


def _text_or_none(_label: str, raw: str) -> str | None:
    """Empty counts as not given (a variable the manifest declares empty)."""
    return raw or None


def _group(label: str, raw: str) -> str:
    if not raw:
        raise ConfigError(f"{label}: required: the name of the singleton group")
    if len(raw) > 63 or not _DNS1123.match(raw):
        raise ConfigError(f"{label}: must be a DNS-1123 label (a-z, 0-9, '-', at most 63), got {raw!r}")
    return raw


def _identity(label: str, raw: str) -> Identity:
    try:
        return validate_identity(raw)
    except ValueError as exc:
        raise ConfigError(f"{label}: {exc}") from None


def _backend(label: str, raw: str) -> BackendName:
    for backend in BACKENDS:
        if raw == backend:
            return backend
    # Worded before parse_choice existed; kept as users and scripts know it.
    raise ConfigError(f"{label}: must be one of postgres, lease, both; got {raw!r}")


def _drain_url(label: str, raw: str) -> str | None:
    if not raw:
        return None
    if not raw.startswith(("http://", "https://")):
        raise ConfigError(f"{label}: must be an http:// or https:// URL, got {raw!r}")
    # Checked now: the HTTP client raises ValueError for a port above 65535 only when the
    # drain POSTs, and port 0 cannot be connected to.
    try:
        port = urllib.parse.urlsplit(raw).port
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"{label}: the port must be from 1 to 65535, got {raw!r}")
    if not urllib.parse.urlsplit(raw).hostname:
        raise ConfigError(f"{label}: the URL has no host, got {raw!r}")
    if any(c.isspace() or not c.isascii() for c in raw):
        raise ConfigError(f"{label}: spaces and non-ASCII characters must be percent-encoded, got {raw!r}")
    return raw


def _gate_dir(_label: str, raw: str) -> Path | None:
    return Path(raw) if raw else None


def _container_name(label: str, raw: str) -> str | None:
    if not raw:
        return None
    if len(raw) > 63 or not _DNS1123.match(raw):
        raise ConfigError(f"{label}: must be a container name (DNS-1123 label), got {raw!r}")
    return raw


GROUP: Setting[str] = Setting(
    "group", "--group", contract.ENV_GROUP, _group, default="", required=True,
    help="singleton group name (DNS-1123 label); required")
IDENTITY: Setting[Identity | None] = Setting(
    "identity", "--identity", contract.ENV_IDENTITY, _identity, default=None,
    help="candidate identity (default: pod name/pod UID/start nonce, or host/pid/nonce)")
BACKEND: Setting[BackendName] = Setting(
    "backend", "--backend", contract.ENV_BACKEND, _backend, default="postgres",
    help="lock store: postgres, lease or both (default postgres)")
POSTGRES_DSN: Setting[str | None] = Setting(
    "postgres_dsn", "--postgres-dsn", contract.ENV_POSTGRES_DSN, _text, default=None,
    help="PostgreSQL DSN (postgres and both backends)")
POSTGRES_DSN_FILE: Setting[str | None] = Setting(
    "postgres_dsn_file", "--postgres-dsn-file", contract.ENV_POSTGRES_DSN_FILE, _text, default=None,
    help="file holding the PostgreSQL DSN (for a mounted Secret)")
POSTGRES_MODE: Setting[PostgresMode] = Setting(
    "postgres_mode", "--postgres-mode", contract.ENV_POSTGRES_MODE,
    functools.partial(parse_choice, choices=POSTGRES_MODES), default="session",
    help=("session (default: an advisory lock on a connection per sidecar) or pooled (expiring rows "
          "in short transactions, for PgBouncer/RDS Proxy in transaction mode)"))
NAMESPACE: Setting[str | None] = Setting(
    "namespace", "--namespace", contract.ENV_NAMESPACE, _text_or_none, default=None,
    help="namespace of this pod and of the Lease")
LOCK_KEY: Setting[str | None] = Setting(
    # Default (None): <namespace>/<group>, made and checked in load_config.
    "lock_key", "--lock-key", contract.ENV_LOCK_KEY, _text_or_none, default=None,
    help=("key of the group's PostgreSQL lock and fence, the same on every replica wherever it runs "
          "(default <namespace>/<group>; required outside Kubernetes with postgres and both)"))
POD_NAME: Setting[str | None] = Setting(
    "pod_name", "--pod-name", contract.ENV_POD_NAME, _text_or_none, default=None,
    help="this pod's name (downward API: metadata.name)")
POD_UID: Setting[str | None] = Setting(
    "pod_uid", "--pod-uid", contract.ENV_POD_UID, _text_or_none, default=None,
    help="this pod's UID (downward API: metadata.uid)")
LISTEN: Setting[Listen] = Setting(
    "listen", "--listen", contract.ENV_LISTEN, parse_listen, default=Listen("0.0.0.0", 8080),
    help="host:port for /readyz /livez /leader /metrics (default 0.0.0.0:8080)")
CONTROL_LISTEN: Setting[Listen] = Setting(
    "control_listen", "--control-listen", contract.ENV_CONTROL_LISTEN,
    functools.partial(parse_listen, loopback_only=True), default=Listen("127.0.0.1", 8081),
    help="loopback host:port for control actions (default 127.0.0.1:8081)")
# The three timings' defaults (None) are the backend's, from default_timings in load_config.
LEASE_DURATION: Setting[float | None] = Setting(
    "lease_duration", "--lease-duration", contract.ENV_LEASE_DURATION, parse_positive_seconds, default=None,
    help="seconds a lock stays valid without renewal (default 6 with postgres, 9 with lease/both)")
RENEW_DEADLINE: Setting[float | None] = Setting(
    "renew_deadline", "--renew-deadline", contract.ENV_RENEW_DEADLINE, parse_positive_seconds, default=None,
    help=("seconds the leader keeps trying to renew before stepping down "
          "(default 4 with postgres, 7.5 with lease/both)"))
RETRY_PERIOD: Setting[float | None] = Setting(
    "retry_period", "--retry-period", contract.ENV_RETRY_PERIOD, parse_positive_seconds, default=None,
    help="seconds between renewals and between retries (default 2 with postgres, 6 with lease/both)")
DRAIN_TIMEOUT: Setting[float] = Setting(
    "drain_timeout", "--drain-timeout", contract.ENV_DRAIN_TIMEOUT, parse_positive_seconds, default=30.0,
    help="seconds the app may take to drain before the lock is released (default 30)")
DRAIN_URL: Setting[str | None] = Setting(
    "drain_url", "--drain-url", contract.ENV_DRAIN_URL, _drain_url, default=None,
    help="URL to POST to ask the app to drain; a 2xx answer means drained")
GATE_DIR: Setting[Path | None] = Setting(
    "gate_dir", "--gate-dir", contract.ENV_GATE_DIR, _gate_dir, default=None,
    help="folder shared with the main container for the file gate")
KILL_GRACE: Setting[float | None] = Setting(
    # Default (None): min(1 s, half the timings' stop margin), made in load_config.
    "kill_grace", "--kill-grace", "SINGLETON_KILL_GRACE", parse_positive_seconds, default=None,
    help="seconds from SIGTERM to SIGKILL for a gated process that lost leadership (default 1)")
KUBECONFIG: Setting[str | None] = Setting(
    "kubeconfig", "--kubeconfig", contract.ENV_KUBECONFIG, _text_or_none, default=None,
    help="kubeconfig file when not running in a pod")
READINESS_GATE: Setting[bool] = Setting(
    "readiness_gate", "--readiness-gate", contract.ENV_READINESS_GATE, parse_bool, default=False,
    help="also set the pod condition singleton.dev/leader (true/false)")
DRAIN_WAIT_CONTAINER: Setting[str | None] = Setting(
    "drain_wait_container", "--drain-wait-container", contract.ENV_DRAIN_WAIT_CONTAINER, _container_name,
    default=None,
    help=("in a pod: on drain, also wait until this container of the pod has stopped "
          "(the main container, for apps that stop on SIGTERM)"))
NATIVE_SIDECAR: Setting[bool] = Setting(
    "native_sidecar", "--native-sidecar", contract.ENV_NATIVE_SIDECAR, parse_bool, default=False,
    help=("true when this container is a native sidecar (Kubernetes 1.29+): a SIGTERM during "
          "the pod's deletion then means the main containers have exited (true/false)"))
SOLE_CANDIDATE_IN_POD: Setting[bool] = Setting(
    "sole_candidate_in_pod", "--sole-candidate-in-pod", contract.ENV_SOLE_CANDIDATE_IN_POD, parse_bool,
    default=False,
    help=("true when this is the group's only sidecar in its pod: a term left by this "
          "container's earlier incarnation (the kubelet restarted it) is taken over at once "
          "(needs the pod name and UID and no --identity)"))
LOG_FORMAT: Setting[LogFormat] = Setting(
    "log_format", "--log-format", contract.ENV_LOG_FORMAT,
    functools.partial(parse_choice, choices=LOG_FORMATS), default="json",
    help="json (default) or text")
LOG_LEVEL: Setting[LogLevel] = Setting(
    "log_level", "--log-level", contract.ENV_LOG_LEVEL,
    functools.partial(parse_choice, choices=LOG_LEVELS), default="info",
    help="debug, info (default), warning or error")

SETTINGS: tuple[Setting[Any], ...] = (
    # In the order of `singleton-sidecar run --help`, and of the reading (the first bad one is reported).
    GROUP, IDENTITY, BACKEND, POSTGRES_DSN, POSTGRES_DSN_FILE, POSTGRES_MODE, NAMESPACE, LOCK_KEY, POD_NAME,
    POD_UID, LISTEN, CONTROL_LISTEN, LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD, DRAIN_TIMEOUT, DRAIN_URL,
    GATE_DIR, KILL_GRACE, KUBECONFIG, READINESS_GATE, DRAIN_WAIT_CONTAINER, NATIVE_SIDECAR,
    SOLE_CANDIDATE_IN_POD, LOG_FORMAT, LOG_LEVEL,
)
_TIMING_SETTINGS: dict[str, Setting[float | None]] = {
    setting.name: setting for setting in (LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD)}


@dataclass(frozen=True)
class SidecarConfig:
    group: str
    """Name of the singleton group (the Lease's name; the Postgres lock row's key)."""
    backend: BackendName
    """Where the lock lives: ``postgres``, ``lease`` or ``both`` (lead only while holding both)."""
    timings: Timings
    """Lease duration, renew deadline and retry period."""
    identity: Identity | None = IDENTITY.default
    """Explicit candidate identity; default: pod name + pod UID + start nonce."""
    postgres_dsn: str | None = field(default=POSTGRES_DSN.default, repr=False)
    """PostgreSQL connection string (secret: never logged)."""
    postgres_mode: PostgresMode = POSTGRES_MODE.default
    """``session``: an advisory lock on a dedicated connection per sidecar (crash failover in
    milliseconds; no transaction pooler). ``pooled``: expiring rows written in short
    transactions, through PgBouncer or RDS Proxy in transaction mode (``backends.postgres.pooled_mode``)."""
    namespace: str | None = NAMESPACE.default
    """Namespace of the pod and the Lease; None outside Kubernetes."""
    lock_key: str = ""
    """The group's key in PostgreSQL (lock and fence rows), the same on every replica wherever
    it runs: ``SINGLETON_LOCK_KEY``, else ``<namespace>/<group>``; required with PostgreSQL."""
    pod_name: str | None = POD_NAME.default
    """This pod's name (downward API); enables pod annotations, labels and events."""
    pod_uid: str | None = POD_UID.default
    """This pod's UID (downward API), part of the identity."""
    listen: Listen = LISTEN.default
    """Probe and metrics endpoint: /readyz, /livez, /leader, /metrics."""
    control_listen: Listen = CONTROL_LISTEN.default
    """Control endpoint (drain, release, step-down): loopback only."""
    drain_timeout: float = DRAIN_TIMEOUT.default
    """Seconds the app may take to finish in-flight work before the lock is released anyway."""
    drain_url: str | None = DRAIN_URL.default
    """Optional URL the sidecar POSTs to ask the app to drain; its 2xx answer means done."""
    gate_dir: Path | None = GATE_DIR.default
    """Folder shared with the main container for the file gate (``gate.sh`` and the leader flag)."""
    kill_grace: float = 1.0
    """Seconds between SIGTERM and SIGKILL for a gated process that lost leadership."""
    kubeconfig: str | None = KUBECONFIG.default
    """Kubeconfig path for running outside a pod (default: in-cluster, then $KUBECONFIG)."""
    exec_command: tuple[str, ...] = ()
    """Command run as a child only while this replica leads (the exec gate)."""
    readiness_gate: bool = READINESS_GATE.default
    """Also set the pod condition ``singleton.dev/leader`` (for pod readiness gates)."""
    drain_wait_container: str | None = DRAIN_WAIT_CONTAINER.default
    """On drain, also wait until this container of the pod has terminated (read from the pod)."""
    native_sidecar: bool = NATIVE_SIDECAR.default
    """This sidecar is a native sidecar (an init container with ``restartPolicy: Always``): while
    the pod is being deleted, the kubelet sends it SIGTERM only once the main containers have
    exited, which ends the wait for ``drain_wait_container`` (the kubelet publishes the
    containers' states only after the whole pod has stopped)."""
    sole_candidate_in_pod: bool = SOLE_CANDIDATE_IN_POD.default
    """This sidecar is its group's only candidate in its pod (the operator's and the webhook's
    pods): a term held by an earlier incarnation of it in this pod (the kubelet restarted the
    container) is taken over at once instead of waited out (``core.identity.is_predecessor``)."""
    log_format: LogFormat = LOG_FORMAT.default
    """Structured JSON logs (default) or plain text."""
    log_level: LogLevel = LOG_LEVEL.default
    """Least severe level logged."""

    @property
    def in_kubernetes(self) -> bool:
        return self.pod_name is not None and self.namespace is not None


class SettingValues:
    """The table's settings as read: each one's parsed value, or its default."""

    def __init__(self, values: Mapping[str, object]) -> None:
        self._values = dict(values)

    def __getitem__(self, setting: Setting[Value]) -> Value:
        # Stored by read_settings from this very setting's parser or default.
        return cast(Value, self._values[setting.name])


def add_run_arguments(parser: argparse.ArgumentParser, settings: Sequence[Setting[Any]] = SETTINGS) -> None:
    for setting in settings:
        # default None: a flag not given leaves the variable, then the table's default, in charge.
        parser.add_argument(setting.flag, dest=setting.name, default=None, metavar=setting.name.upper(),
                            help=f"{setting.help} [{setting.env}]")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: command to run only while this replica leads (the exec gate)")


def read_settings(args: argparse.Namespace, environ: Mapping[str, str],
                  settings: Sequence[Setting[Any]] = SETTINGS) -> SettingValues:
    """Each setting from its flag, else its variable, else its default; the first bad one raises."""
    values: dict[str, object] = {}
    for setting in settings:
        raw: str | None = getattr(args, setting.name, None)
        if raw is None:
            raw = environ.get(setting.env)
        if raw is None and setting.required:
            raw = ""
        values[setting.name] = setting.default if raw is None else setting.parse(setting.label, raw)
    return SettingValues(values)


def _postgres_dsn(values: SettingValues, backend: BackendName) -> str | None:
    """The DSN, given or read from its file; required by the backends that use PostgreSQL."""
    dsn = values[POSTGRES_DSN]
    dsn_file = values[POSTGRES_DSN_FILE]
    if dsn_file is not None:
        if dsn is not None:
            raise ConfigError(f"{POSTGRES_DSN_FILE.label}: give the DSN or a file holding it, not both")
        try:
            dsn = Path(dsn_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{POSTGRES_DSN_FILE.label}: cannot read {dsn_file!r}: {exc.strerror}") from None
    if backend in ("postgres", "both"):
        if not dsn:
            raise ConfigError(f"{POSTGRES_DSN.label}: required with backend {backend}")
        if not dsn.startswith(("postgres://", "postgresql://")):
            raise ConfigError(f"{POSTGRES_DSN.label}: must be a postgres:// or postgresql:// URL")
    return dsn


def _timings(values: SettingValues, backend: BackendName) -> Timings:
    """The backend's default timings with the given ones in their place, checked together."""
    given = {name: value for name, setting in _TIMING_SETTINGS.items() if (value := values[setting]) is not None}
    try:
        return default_timings(backend, **given)
    except TimingError as exc:
        # Said in the settings' names, each with its value: given, or the backend's default.
        defaults = BACKEND_DEFAULTS[backend]
        raise ConfigError(exc.render({
            name: f"{_TIMING_SETTINGS[name].label} = {given.get(name, getattr(defaults, name)):g}s"
            + ("" if name in given else f" (the {backend} default)") for name in FIELDS})) from None


def load_config(args: argparse.Namespace, environ: Mapping[str, str]) -> SidecarConfig:
    """Read the settings (``read_settings``), then check what involves several of them."""
    values = read_settings(args, environ)
    group = values[GROUP]
    backend = values[BACKEND]
    identity = values[IDENTITY]

    dsn = _postgres_dsn(values, backend)

    namespace = values[NAMESPACE]
    pod_name = values[POD_NAME]
    if backend in ("lease", "both") and not namespace:
        raise ConfigError(f"{NAMESPACE.label}: required with backend {backend} (the Lease's namespace)")
    if pod_name and not namespace:
        raise ConfigError(f"{NAMESPACE.label}: required when the pod name is given")

    lock_key = values[LOCK_KEY] or (contract.lock_key(group, namespace) if namespace else "")
    if backend in ("postgres", "both") and not lock_key:
        raise ConfigError(
            f"{LOCK_KEY.label}: required with backend {backend} outside Kubernetes: the key of the group's lock "
            f"and fence, the same on every replica wherever it runs (in a cluster the operator sets "
            f"<namespace>/<group>, e.g. default/{group})")
    # Checked here, not by the parser: a key made from the namespace must pass it too.
    if len(lock_key) > 253 or not lock_key.isprintable() or lock_key != lock_key.strip():
        raise ConfigError(f"{LOCK_KEY.label}: must be 1 to 253 printable characters without surrounding "
                          f"spaces, got {lock_key!r}")

    timings = _timings(values, backend)

    kill_grace = values[KILL_GRACE]
    if kill_grace is None:
        kill_grace = min(1.0, timings.stop_margin / 2)
    if kill_grace >= timings.stop_margin:
        raise ConfigError(
            f"{KILL_GRACE.label}: must be shorter than lease_duration - renew_deadline "
            f"({timings.stop_margin:g}s) so a gated process is dead before anyone else can lead; got {kill_grace:g}s"
        )

    drain_wait_container = values[DRAIN_WAIT_CONTAINER]
    if drain_wait_container is not None and not pod_name:
        raise ConfigError(f"{DRAIN_WAIT_CONTAINER.label}: needs the pod name "
                          f"({contract.ENV_POD_NAME}): the container's state is read from the pod")
    native_sidecar = values[NATIVE_SIDECAR]
    if native_sidecar and drain_wait_container is None:
        raise ConfigError(f"{NATIVE_SIDECAR.label}: needs {DRAIN_WAIT_CONTAINER.label} "
                          "(the container whose exit a SIGTERM then stands for)")

    pod_uid = values[POD_UID]
    sole_candidate = values[SOLE_CANDIDATE_IN_POD]
    if sole_candidate and (not pod_name or not pod_uid or identity is not None):
        raise ConfigError(f"{SOLE_CANDIDATE_IN_POD.label}: needs the pod name and UID ({contract.ENV_POD_NAME}, "
                          f"{contract.ENV_POD_UID}) and no {IDENTITY.label}: it recognises its earlier "
                          "incarnations by the identity the sidecar makes from them")

    command = tuple(args.command[1:] if args.command and args.command[0] == "--" else args.command or ())
    return SidecarConfig(
        group=group,
        backend=backend,
        timings=timings,
        identity=identity,
        postgres_dsn=dsn,
        postgres_mode=values[POSTGRES_MODE],
        namespace=namespace,
        lock_key=lock_key,
        pod_name=pod_name,
        pod_uid=pod_uid,
        listen=values[LISTEN],
        control_listen=values[CONTROL_LISTEN],
        drain_timeout=values[DRAIN_TIMEOUT],
        drain_url=values[DRAIN_URL],
        gate_dir=values[GATE_DIR],
        kill_grace=kill_grace,
        kubeconfig=values[KUBECONFIG],
        exec_command=command,
        readiness_gate=values[READINESS_GATE],
        drain_wait_container=drain_wait_container,
        native_sidecar=native_sidecar,
        sole_candidate_in_pod=sole_candidate,
        log_format=values[LOG_FORMAT],
        log_level=values[LOG_LEVEL],
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


