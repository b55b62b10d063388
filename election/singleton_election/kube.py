"""A small typed asyncio client for the Kubernetes API, on ``singleton_election.httpclient`` (h11).

The project's one request client: the lease backend, the sidecar's own-pod updater, the
operator's own calls (its election, status, reconciles, webhook certificate) and
``kubectl singleton`` (driven synchronously by ``singleton_election.kube_blocking``). Ours rather than
kubernetes_asyncio because the sidecar must start campaigning within 0.5 s and stay within
30 MB: that library imports about a thousand model modules (and aiohttp). Objects are plain JSON
dicts.

- ``load_kube_config`` reads the in-cluster service account (when ``KUBERNETES_SERVICE_HOST``
  and ``KUBERNETES_SERVICE_PORT`` are set and neither a path nor ``KUBECONFIG`` is given) or
  a kubeconfig file (its current context). Bearer tokens, token files (re-read on every
  request: projected tokens rotate), client certificates and CA bundles are supported;
  anything else (exec plugins, auth providers, impersonation, proxies) is refused with
  ``KubeConfigError`` rather than half-honoured.
- ``KubeClient`` reuses its connections. Every call takes a timeout. HTTP errors become
  ``KubeError`` subclasses by status; transport errors, timeouts, 429 and 5xx become
  ``KubeUnavailable``, chained to the original error.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import binascii
import datetime as dt
import json
import os
import ssl
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlencode

from singleton_election.httpclient import HttpClient

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WATCH_GRACE = 5.0
"""Seconds the client waits beyond a watch's server-side ``timeoutSeconds`` before giving up."""
MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Largest single watch event accepted (the API server's own request limit is 3 MiB)."""

_USER_KEYS = {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key",
              "client-key-data", "extensions"}
_CLUSTER_KEYS = {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify",
                 "extensions", "disable-compression"}


class KubeConfigError(Exception):
    """The kubeconfig or in-cluster configuration is missing, malformed or unsupported."""


class KubeError(Exception):
    """The API server refused a request (``status`` is the HTTP status, 0 for transport errors)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class KubeForbidden(KubeError):
    """403: the credentials may not do this (RBAC)."""


class KubeNotFound(KubeError):
    """404: no such object (or namespace)."""


class KubeConflict(KubeError):
    """409: a stale ``resourceVersion`` or an object that already exists; somebody else won."""


class KubeGone(KubeError):
    """410: the requested ``resourceVersion`` is too old; list again, then watch."""


class KubeInvalid(KubeError):
    """422: the object failed validation."""


class KubeUnavailable(KubeError):
    """The API server could not be reached, timed out, throttled us (429) or failed (5xx)."""


_BY_STATUS: dict[int, type[KubeError]] = {
    403: KubeForbidden, 404: KubeNotFound, 409: KubeConflict, 410: KubeGone, 422: KubeInvalid, 429: KubeUnavailable,
}
_TRANSPORT_ERRORS = (TimeoutError, OSError)  # HttpTransportError is an OSError


@dataclass(frozen=True)
class KubeConfig:
    """Where the API server is and how to authenticate to it."""

    server: str
    """Base URL without a trailing slash, e.g. ``https://10.0.0.1:443``."""
    token: str | None = field(default=None, repr=False)
    """A static bearer token (takes precedence over ``token_file``)."""
    token_file: str | None = None
    """A file holding the bearer token, re-read on every request (projected tokens rotate)."""
    ca_data: bytes | None = field(default=None, repr=False)
    """PEM (or DER) CA bundle to verify the server; None: the system's trust store."""
    client_cert_file: str | None = None
    """PEM client certificate file for mutual TLS."""
    client_key_file: str | None = None
    """PEM private key file of ``client_cert_file``."""
    insecure: bool = False
    """Skip verification of the server's certificate (``insecure-skip-tls-verify``)."""
    namespace: str = "default"
    """The context's (or the service account's) namespace."""
    token_provider: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)
    """Called for the bearer token on every request (the operator outside a pod: credentials
    the official client's kubeconfig loader resolved and renews, singleton_operator.kubelogin)."""
    proxy: str | None = None
    """An HTTP(S) proxy URL for the API server (set by that same loader; never from a pod's config)."""

    def bearer_token(self) -> str | None:
        if self.token_provider is not None:
            return self.token_provider()
        if self.token:
            return self.token
        if self.token_file:
            return Path(self.token_file).read_text().strip() or None
        return None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings: a context for https, None for plain http."""
        if not self.server.startswith("https://"):
            return None
        if self.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif self.ca_data is not None:
            pem = b"-----BEGIN" in self.ca_data
            context = ssl.create_default_context(cadata=self.ca_data.decode("ascii") if pem else self.ca_data)
        else:
            context = ssl.create_default_context()
        if self.client_cert_file:
            context.load_cert_chain(self.client_cert_file, self.client_key_file)
        return context


def load_kube_config(kubeconfig_path: str | None = None, *,
                     service_account_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """In-cluster configuration, or the current context of a kubeconfig file; see the module docstring."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    env_paths = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if kubeconfig_path is None and not env_paths and host and port:
        return _in_cluster(host, port, service_account_dir)
    paths = [kubeconfig_path] if kubeconfig_path else env_paths or [str(Path.home() / ".kube" / "config")]
    return _from_kubeconfig([Path(p).expanduser() for p in paths])


def _in_cluster(host: str, port: str, folder: Path) -> KubeConfig:
    token_file, ca_file, ns_file = folder / "token", folder / "ca.crt", folder / "namespace"
    if not token_file.is_file():
        raise KubeConfigError(f"in-cluster configuration: service account token {token_file} not found")
    try:
        ca_data = ca_file.read_bytes()
    except OSError as exc:
        raise KubeConfigError(f"in-cluster configuration: cannot read CA bundle {ca_file}: {exc}") from exc
    namespace = ns_file.read_text().strip() if ns_file.is_file() else "default"
    host = f"[{host}]" if ":" in host else host
    return KubeConfig(server=f"https://{host}:{port}", token_file=str(token_file), ca_data=ca_data,
                      namespace=namespace or "default")


def _merge(paths: list[Path]) -> tuple[dict[str, dict[str, dict[str, Any]]], str | None]:
    """Clusters, users and contexts by name (the first definition wins, as in kubectl), and the current context."""
    named: dict[str, dict[str, dict[str, Any]]] = {"clusters": {}, "users": {}, "contexts": {}}
    current: str | None = None
    import yaml  # here: in a pod (in-cluster configuration) no YAML is read, and PyYAML is not loaded

    for path in paths:
        if not path.is_file() and len(paths) > 1:
            continue
        try:
            doc = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise KubeConfigError(f"cannot read kubeconfig {path}: {exc}") from exc
        if not isinstance(doc, dict):
            raise KubeConfigError(f"kubeconfig {path} is not a mapping")
        current = current or doc.get("current-context")
        for section, entries in named.items():
            for entry in doc.get(section) or []:
                if isinstance(entry, dict) and "name" in entry:
                    body = dict(entry.get(section[:-1]) or {})
                    body["_dir"] = path.parent  # relative file names are relative to their kubeconfig
                    entries.setdefault(str(entry["name"]), body)
    return named, current


def _from_kubeconfig(paths: list[Path]) -> KubeConfig:
    named, current = _merge(paths)
    where = os.pathsep.join(map(str, paths))
    if not current:
        raise KubeConfigError(f"kubeconfig {where} has no current-context")
    context = _lookup(named, "contexts", current, where)
    cluster = _lookup(named, "clusters", str(context.get("cluster", "")), where)
    user = _lookup(named, "users", str(context["user"]), where) if context.get("user") else {}
    for section, entry, allowed in (("cluster", cluster, _CLUSTER_KEYS), ("user", user, _USER_KEYS)):
        unsupported = sorted(set(entry) - allowed - {"_dir"})
        if unsupported:
            raise KubeConfigError(
                f"kubeconfig {where}, context {current!r}: {section} settings {', '.join(unsupported)} "
                "are not supported (use a token, a token file or a client certificate)")
    if not cluster.get("server"):
        raise KubeConfigError(f"kubeconfig {where}, context {current!r}: cluster has no server")
    ca_file = _path(cluster, "certificate-authority")
    ca_data = _decode(cluster, "certificate-authority-data")
    if ca_data is None and ca_file is not None:
        try:
            ca_data = Path(ca_file).read_bytes()
        except OSError as exc:
            raise KubeConfigError(f"cannot read certificate-authority {ca_file}: {exc}") from exc
    return KubeConfig(
        server=str(cluster["server"]).rstrip("/"),
        token=str(user["token"]) if user.get("token") else None,
        token_file=_path(user, "tokenFile"),
        ca_data=ca_data,
        client_cert_file=_private_file(user, "client-certificate-data") or _path(user, "client-certificate"),
        client_key_file=_private_file(user, "client-key-data") or _path(user, "client-key"),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        namespace=str(context.get("namespace") or "default"),
    )


def _lookup(named: dict[str, dict[str, dict[str, Any]]], section: str, name: str, where: str) -> dict[str, Any]:
    if name not in named[section]:
        raise KubeConfigError(f"kubeconfig {where}: no {section[:-1]} named {name!r}")
    return named[section][name]


def _path(entry: dict[str, Any], key: str) -> str | None:
    """A file setting, relative to the kubeconfig file that defined it."""
    value = entry.get(key)
    return str(Path(entry["_dir"]) / str(value)) if value else None


def _decode(entry: dict[str, Any], key: str) -> bytes | None:
    value = entry.get(key)
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KubeConfigError(f"kubeconfig {key} is not valid base64") from exc


def _private_file(entry: dict[str, Any], key: str) -> str | None:
    """Write ``*-data`` to a file only we can read (ssl loads certificates from files only)."""
    data = _decode(entry, key)
    if data is None:
        return None
    import tempfile  # here: a pod's in-cluster configuration has files already

    fd, path = tempfile.mkstemp(prefix="singleton-kube-", suffix=".pem")  # mode 0600
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    atexit.register(_unlink, path)
    return path


def _unlink(path: str) -> None:
    with suppress(OSError):
        os.unlink(path)


class KubeClient:
    """An API client over reused connections; use ``async with`` or call ``close()``."""

    def __init__(self, config: KubeConfig, *, user_agent: str = "singleton-sidecar") -> None:
        self.config = config
        self.user_agent = user_agent
        self._ssl = config.ssl_context()
        self._client: HttpClient | None = self._new_client()  # now: a bad server or proxy URL fails here

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, str] | None = None,
                      content_type: str = "application/json", timeout: float) -> dict[str, Any]:
        """One API call; returns the decoded JSON object (the server's ``Status`` for some deletes)."""
        status, payload = await self._call(method, path, body=body, params=params, content_type=content_type,
                                           timeout=timeout)
        return _json_object(payload, status)

    async def write(self, method: str, path: str, *, body: Any, params: Mapping[str, str] | None = None,
                    content_type: str = "application/json", timeout: float) -> None:
        """One API call whose answer is not needed: its errors raise as ``request``'s do, its
        body is not decoded (an apply answers with the whole object and its managedFields:
        decoding those was about a seventh of the operator's CPU in a burst of new groups)."""
        await self._call(method, path, body=body, params=params, content_type=content_type, timeout=timeout)

    async def _call(self, method: str, path: str, *, body: Any, params: Mapping[str, str] | None,
                    content_type: str, timeout: float) -> tuple[int, bytes]:
        """Send one call; returns its status and raw body, or raises ``KubeError`` for 4xx and 5xx."""
        data = None if body is None else json.dumps(body).encode()
        try:
            async with asyncio.timeout(timeout):
                headers = self._headers(content_type if data is not None else None)
                resp, payload = await self._http().request(method, _target(path, params), headers=headers, body=data)
        except _TRANSPORT_ERRORS as exc:
            raise _transport_error(method, path, timeout, exc) from exc
        if resp.status >= 400:
            raise _status_error(resp.status, resp.reason, payload)
        return resp.status, payload

    async def watch(self, path: str, *, params: Mapping[str, str] | None = None,
                    timeout: float) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
        """Yield ``(type, object)`` from a watch; it ends after about ``timeout`` seconds (sent
        as the server's ``timeoutSeconds``, which ``params`` may not hold: ValueError).

        Close it with ``contextlib.aclosing`` when leaving early. An ERROR event raises
        (``KubeGone`` for 410: list again); transport trouble raises ``KubeUnavailable``.
        """
        if params and "timeoutSeconds" in params:
            raise ValueError("a watch's timeoutSeconds is its timeout argument, not a parameter")
        query = {**(params or {}), "watch": "1", "timeoutSeconds": str(max(1, round(timeout)))}
        # A deadline, not asyncio.timeout: a timeout's scope must not span this generator's yields.
        deadline = asyncio.get_running_loop().time() + max(1, round(timeout)) + WATCH_GRACE
        try:
            async with self._http().open("GET", _target(path, query), headers=self._headers(None),
                                         deadline=deadline) as resp:
                if resp.status >= 400:
                    raise _status_error(resp.status, resp.reason, await resp.read())
                buffer = bytearray()
                async for chunk in resp.chunks():
                    buffer += chunk
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[:end + 1]
                        if line.strip():
                            yield _event(line)
                    if len(buffer) > MAX_EVENT_BYTES:
                        raise KubeError(0, "EventTooLarge", f"watch {path}: event over {MAX_EVENT_BYTES} bytes")
        except _TRANSPORT_ERRORS as exc:
            raise _transport_error("WATCH", path, timeout, exc) from exc

    def _http(self) -> HttpClient:
        if self._client is None:
            self._client = self._new_client()
        return self._client

    def _new_client(self) -> HttpClient:
        return HttpClient(self.config.server, ssl_context=self._ssl, proxy=self.config.proxy,
                          user_agent=self.user_agent)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}  # User-Agent: the HttpClient's
        if content_type is not None:
            headers["Content-Type"] = content_type
        token = self.config.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers


def _target(path: str, params: Mapping[str, str] | None) -> str:
    return f"{path}?{urlencode(params)}" if params else path


def _transport_error(method: str, path: str, timeout: float, exc: BaseException) -> KubeUnavailable:
    if isinstance(exc, TimeoutError):
        return KubeUnavailable(0, "Timeout", f"{method} {path}: no answer within {timeout:g}s")
    return KubeUnavailable(0, "Unreachable", f"{method} {path}: {exc!r}")


def _status_error(status: int, reason: str, payload: bytes) -> KubeError:
    """The error for an HTTP status, with reason and message from the server's ``Status`` if any."""
    message = payload.decode("utf-8", "replace")[:1000]
    with suppress(ValueError):
        doc = json.loads(payload)
        if isinstance(doc, dict) and doc.get("kind") == "Status":
            reason = str(doc.get("reason") or reason)
            message = str(doc.get("message") or message)
    error = _BY_STATUS.get(status) or (KubeUnavailable if status >= 500 else KubeError)
    return error(status, reason, message)


def _json_object(payload: bytes, status: int) -> dict[str, Any]:
    try:
        doc = json.loads(payload)
    except ValueError as exc:
        raise KubeError(status, "BadResponse", f"not JSON: {payload[:200]!r}") from exc
    if not isinstance(doc, dict):
        raise KubeError(status, "BadResponse", f"not a JSON object: {payload[:200]!r}")
    return doc


def _event(line: bytes) -> tuple[str, dict[str, Any]]:
    event = _json_object(line, 200)
    kind, obj = str(event.get("type", "")), event.get("object")
    if not isinstance(obj, dict):
        raise KubeError(200, "BadResponse", f"watch event without an object: {line[:200]!r}")
    if kind == "ERROR":
        raise _status_error(int(obj.get("code") or 500), str(obj.get("reason") or "Error"), json.dumps(obj).encode())
    return kind, obj


def event_body(involved: dict[str, str], *, reason: str, message: str, warning: bool = False,
               component: str, instance: str) -> dict[str, Any]:
    """A core/v1 Event about ``involved`` (apiVersion, kind, namespace, name, optional uid),
    ready to POST to ``/api/v1/namespaces/<namespace>/events``."""
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{involved['name']}.", "namespace": involved["namespace"]},
        "involvedObject": involved,
        "reason": reason, "message": message[:1000], "type": "Warning" if warning else "Normal",
        "source": {"component": component.rpartition("/")[2]},
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        "reportingComponent": component, "reportingInstance": instance[:128],
    }
