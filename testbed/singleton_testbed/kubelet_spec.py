"""What a pod spec asks of the stand-in kubelet before a container starts: its environment
(``env``, ``envFrom``, ``$(VAR)`` expansion, downward API) and its volumes' files.

Called by ``kubelet_pods``. Objects the spec refers to (Secrets, ConfigMaps, tokens) come
through the ``ObjectReader`` protocol, so this module does no I/O beyond writing volume files.
A missing, non-optional reference raises ``ConfigError``: the kubelet's
``CreateContainerConfigError`` (for env) or a pod stuck in ``ContainerCreating`` (for volumes).
"""

from __future__ import annotations

import base64
import logging
import math
import re
import shutil
import sys
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Protocol

from singleton_testbed.kubelet_runtime import Mount

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
ROOT_CA_CONFIG_MAP = "kube-root-ca.crt"
DEFAULT_FILE_MODE = 0o644

Obj = dict[str, Any]


class ConfigError(Exception):
    """A container's configuration cannot be resolved yet (a missing Secret, key or field)."""


class ObjectReader(Protocol):
    """The API reads a pod's configuration needs; each returns None when the object is missing."""

    async def secret(self, namespace: str, name: str) -> dict[str, bytes] | None: ...

    async def config_map(self, namespace: str, name: str) -> dict[str, bytes] | None: ...

    async def service_account(self, namespace: str, name: str) -> Obj | None: ...

    async def token(self, pod: Obj, *, audience: str | None, expiration_seconds: int) -> str: ...


# --- $(VAR) expansion, as the kubelet's third_party/forked/golang/expansion --------------------

_REFERENCE = re.compile(r"\$\$|\$\(([^)]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` becomes VAR's value when defined (else stays as is); ``$$`` becomes ``$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


# --- downward API -----------------------------------------------------------------------------

_INDEXED = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")


def field_value(pod: Obj, path: str) -> str:
    """The value of a ``fieldRef.fieldPath`` of the pod (env and downwardAPI volumes)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    if indexed := _INDEXED.fullmatch(path):
        return str((meta.get(indexed.group(1)) or {}).get(indexed.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "".join(f'{key}="{value}"\n' for key, value in sorted(items.items()))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs") or []),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs") or []),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldPath {path!r}")
    return str(simple[path] or "")


_SUFFIXES = {
    "": Decimal(1), "m": Decimal("0.001"), "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9),
    "T": Decimal(10**12), "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
}


def quantity(text: str) -> Decimal:
    """A resource quantity (``500m``, ``2Gi``, ``1e3``) as a number."""
    match = re.fullmatch(r"([0-9.eE+-]+?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(text).strip())
    try:
        if match is None:
            raise InvalidOperation
        return Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except InvalidOperation as exc:
        raise ConfigError(f"not a resource quantity: {text!r}") from exc


def resource_value(pod: Obj, container_name: str, ref: Obj, allocatable: Mapping[str, str]) -> str:
    """``resourceFieldRef``: the container's limit or request (limits default to the node's
    allocatable), divided by ``divisor`` and rounded up, as the kubelet does."""
    name = ref.get("containerName") or container_name
    containers = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
    container = next((c for c in containers if c["name"] == name), None)
    if container is None:
        raise ConfigError(f"resourceFieldRef: no container named {name!r}")
    kind, _, resource = str(ref["resource"]).partition(".")
    values = (container.get("resources") or {}).get(kind) or {}
    raw = values.get(resource) or (allocatable.get(resource) if kind == "limits" else None) or "0"
    divisor = quantity(str(ref.get("divisor") or "1"))
    return str(math.ceil(quantity(raw) / divisor))


# --- environment ------------------------------------------------------------------------------


def base_env(pod: Obj, *, path: str, api_host: str, api_port: int) -> dict[str, str]:
    """What every container's environment starts with: images are ignored, so PATH and HOME
    come from here, and the in-cluster variables point at the API server."""
    port = str(api_port)
    return {"PATH": path, "HOME": "/root", "HOSTNAME": pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port, "KUBERNETES_PORT": f"tcp://{api_host}:{port}"}


def hosts_file(pod: Obj, *, pod_ip: str, api_host: str) -> str:
    """The pod's ``/etc/hosts``: the kubelet's, plus the API server's service names (no DNS here)."""
    aliases = [f"{a['ip']}\t{' '.join(a.get('hostnames') or [])}\n" for a in pod["spec"].get("hostAliases") or []]
    service = "kubernetes kubernetes.default kubernetes.default.svc kubernetes.default.svc.cluster.local"
    return ("# Kubernetes-managed hosts file (singleton stand-in kubelet).\n127.0.0.1\tlocalhost\n"
            f"::1\tlocalhost ip6-localhost ip6-loopback\n{pod_ip}\t{pod['metadata']['name']}\n"
            f"{api_host}\t{service}\n" + "".join(aliases))


async def _key_ref(reader: ObjectReader, namespace: str, ref: Obj, kind: str) -> str | None:
    name, key, optional = ref.get("name", ""), ref["key"], bool(ref.get("optional"))
    data = await (reader.secret(namespace, name) if kind == "secret" else reader.config_map(namespace, name))
    if data is None or key not in data:
        if optional:
            return None
        what = f"{kind} {name!r} not found" if data is None else f"key {key!r} not found in {kind} {name!r}"
        raise ConfigError(what)
    return data[key].decode("utf-8", "replace")


async def _value_from(pod: Obj, container: Obj, source: Obj, reader: ObjectReader,
                      allocatable: Mapping[str, str]) -> str | None:
    namespace = pod["metadata"]["namespace"]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in source:
        return resource_value(pod, container["name"], source["resourceFieldRef"], allocatable)
    if "secretKeyRef" in source:
        return await _key_ref(reader, namespace, source["secretKeyRef"], "secret")
    if "configMapKeyRef" in source:
        return await _key_ref(reader, namespace, source["configMapKeyRef"], "configmap")
    raise ConfigError(f"unsupported valueFrom {sorted(source)}")


async def _env_from(pod: Obj, source: Obj, reader: ObjectReader) -> dict[str, str]:
    namespace, prefix = pod["metadata"]["namespace"], source.get("prefix", "")
    kind, ref = ("secret", source["secretRef"]) if "secretRef" in source else ("configmap", source["configMapRef"])
    data = await (reader.secret(namespace, ref["name"]) if kind == "secret" else
                  reader.config_map(namespace, ref["name"]))
    if data is None:
        if ref.get("optional"):
            return {}
        raise ConfigError(f"{kind} {ref['name']!r} not found")
    return {prefix + key: value.decode("utf-8", "replace") for key, value in data.items() if "=" not in key}


async def container_env(pod: Obj, container: Obj, reader: ObjectReader, *, base: Mapping[str, str],
                        allocatable: Mapping[str, str]) -> dict[str, str]:
    """The container's environment: ``base`` (PATH, service variables…), then ``envFrom``, then
    ``env`` in order, each value expanded against what came before."""
    env = dict(base)
    for source in container.get("envFrom") or []:
        env.update(await _env_from(pod, source, reader))
    for var in container.get("env") or []:
        if "valueFrom" in var:
            value = await _value_from(pod, container, var["valueFrom"], reader, allocatable)
            if value is not None:
                env[var["name"]] = value
        else:
            env[var["name"]] = expand(var.get("value", ""), env)
    return env


def container_argv(container: Obj, env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args``, expanded; images are ignored, so a command is required."""
    argv = [expand(part, env) for part in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not container.get("command"):
        raise ConfigError("the stand-in kubelet ignores images: the container needs a `command`")
    return argv


# --- volumes ----------------------------------------------------------------------------------


def _write(folder: Path, files: Mapping[str, tuple[bytes, int]]) -> None:
    for rel, (data, mode) in files.items():
        path = folder / rel
        if not rel or ".." in Path(rel).parts or Path(rel).is_absolute():
            raise ConfigError(f"bad volume file path {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def _select(data: Mapping[str, bytes], source: Obj, default_mode: int, what: str) -> dict[str, tuple[bytes, int]]:
    """All keys, or the listed ``items`` (each key must exist unless the source is optional)."""
    items = source.get("items")
    if not items:
        return {key: (value, default_mode) for key, value in data.items()}
    files = {}
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise ConfigError(f"key {item['key']!r} not found in {what}")
        files[item["path"]] = (data[item["key"]], int(item.get("mode", default_mode)))
    return files


class VolumeBuilder:
    """Writes a pod's volumes under ``root/<volume name>`` and says where each one is on the host."""

    def __init__(self, pod: Obj, reader: ObjectReader, *, root: Path, ca_data: bytes,
                 allocatable: Mapping[str, str]) -> None:
        self.pod, self.reader, self.root = pod, reader, root
        self.ca_data, self.allocatable = ca_data, allocatable
        self.namespace = pod["metadata"]["namespace"]

    async def build(self) -> dict[str, Path]:
        shutil.rmtree(self.root, ignore_errors=True)  # leftovers of an earlier run of this pod
        self.root.mkdir(parents=True)
        paths = {}
        for volume in self.pod["spec"].get("volumes") or []:
            paths[volume["name"]] = await self._volume(volume)
        if await self._needs_token_volume():
            paths[IMPLICIT_TOKEN_VOLUME] = await self._projected(
                IMPLICIT_TOKEN_VOLUME, {"sources": IMPLICIT_TOKEN_SOURCES})
        return paths

    async def _volume(self, volume: Obj) -> Path:
        name = str(volume["name"])
        if "hostPath" in volume:
            return _host_path(volume["hostPath"])
        folder = self.root / name
        folder.mkdir()
        if "secret" in volume:
            source = volume["secret"]
            data = await self._data("secret", source.get("secretName", ""), bool(source.get("optional")))
            _write(folder, _select(data, source, int(source.get("defaultMode", DEFAULT_FILE_MODE)), "secret"))
        elif "configMap" in volume:
            source = volume["configMap"]
            data = await self._data("configmap", source.get("name", ""), bool(source.get("optional")))
            _write(folder, _select(data, source, int(source.get("defaultMode", DEFAULT_FILE_MODE)), "configmap"))
        elif "projected" in volume:
            return await self._projected(name, volume["projected"])
        elif "downwardAPI" in volume:
            _write(folder, self._downward(volume["downwardAPI"], int(volume["downwardAPI"].get(
                "defaultMode", DEFAULT_FILE_MODE))))
        elif "emptyDir" not in volume:
            log.warning("volume %s: type %s is not supported; an empty folder stands in",
                        name, sorted(set(volume) - {"name"}))
        return folder

    async def _data(self, kind: str, name: str, optional: bool) -> dict[str, bytes]:
        data = await (self.reader.secret(self.namespace, name) if kind == "secret" else
                      self.reader.config_map(self.namespace, name))
        if data is None and kind == "configmap" and name == ROOT_CA_CONFIG_MAP:
            # Published by kube-controller-manager, which tests may not run: our CA is the same.
            data = {"ca.crt": self.ca_data}
        if data is None:
            if optional:
                return {}
            raise ConfigError(f"{kind} {name!r} not found")
        return data

    async def _projected(self, name: str, projected: Obj) -> Path:
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        mode = int(projected.get("defaultMode", DEFAULT_FILE_MODE))
        for source in projected.get("sources") or []:
            if "serviceAccountToken" in source:
                spec = source["serviceAccountToken"]
                token = await self.reader.token(self.pod, audience=spec.get("audience") or None,
                                                expiration_seconds=int(spec.get("expirationSeconds", 3600)))
                _write(folder, {spec["path"]: (token.encode(), mode)})
            elif "secret" in source or "configMap" in source:
                kind, ref = ("secret", source["secret"]) if "secret" in source else ("configmap", source["configMap"])
                data = await self._data(kind, ref.get("name", ""), bool(ref.get("optional")))
                _write(folder, _select(data, ref, mode, kind))
            elif "downwardAPI" in source:
                _write(folder, self._downward(source["downwardAPI"], mode))
            else:
                log.warning("projected volume %s: source %s is not supported", name, sorted(source))
        return folder

    def _downward(self, spec: Obj, default_mode: int) -> dict[str, tuple[bytes, int]]:
        files = {}
        for item in spec.get("items") or []:
            if "fieldRef" in item:
                value = field_value(self.pod, item["fieldRef"]["fieldPath"])
            else:
                value = resource_value(self.pod, "", item["resourceFieldRef"], self.allocatable)
            files[item["path"]] = (value.encode(), int(item.get("mode", default_mode)))
        return files

    async def _needs_token_volume(self) -> bool:
        """The ServiceAccount admission plugin normally adds the token volume; without it
        (and unless the pod or its service account opts out) we provide one ourselves."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return False
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        if any(m["mountPath"].rstrip("/") == SERVICE_ACCOUNT_PATH for c in containers
               for m in c.get("volumeMounts") or []):
            return False
        account = await self.reader.service_account(self.namespace, spec.get("serviceAccountName") or "default")
        return account is not None and account.get("automountServiceAccountToken") is not False


IMPLICIT_TOKEN_VOLUME = "kube-api-access-standin"
IMPLICIT_TOKEN_SOURCES: list[Obj] = [
    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
    {"configMap": {"name": ROOT_CA_CONFIG_MAP, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
]


def _host_path(spec: Obj) -> Path:
    path = Path(spec["path"])
    kind = spec.get("type", "")
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif kind and kind not in ("", "DirectoryOrCreate", "FileOrCreate") and not path.exists():
        raise ConfigError(f"hostPath {path} does not exist")
    return path


def hides_host_paths(target: str, sources: Iterable[Path]) -> bool:
    """Whether a mount at ``target`` would cover the interpreter, the working folder or a
    volume's source folder (all on the host filesystem here)."""
    needed = [Path(sys.prefix), Path(sys.base_prefix), Path.cwd(), *sources]
    mount_point = Path(target)
    return any(path == mount_point or mount_point in path.parents for path in needed)


def container_mounts(container: Obj, volumes: Mapping[str, Path], env: Mapping[str, str]) -> list[Mount]:
    """The container's bind mounts, parents before children; the implicit token volume (if we
    made one) at the standard service-account path."""
    mounts = []
    for spec in container.get("volumeMounts") or []:
        if spec["name"] not in volumes:
            raise ConfigError(f"volumeMount {spec['mountPath']}: no volume named {spec['name']!r}")
        source = volumes[spec["name"]]
        sub = spec.get("subPath") or expand(spec.get("subPathExpr", ""), env)
        if sub:
            if ".." in Path(sub).parts or Path(sub).is_absolute():
                raise ConfigError(f"bad subPath {sub!r}")
            source = source / sub
            if not source.exists():
                source.mkdir(parents=True)
        if hides_host_paths(spec["mountPath"], volumes.values()):
            # Containers run the host's programs: a volume at, say, /tmp must not hide a
            # virtualenv or the pod's own volume folders that live below it.
            log.warning("volumeMount %s not mounted: it would hide host paths the container runs from",
                        spec["mountPath"])
            continue
        mounts.append(Mount(source=source, target=spec["mountPath"], read_only=bool(spec.get("readOnly"))))
    if IMPLICIT_TOKEN_VOLUME in volumes:
        mounts.append(Mount(source=volumes[IMPLICIT_TOKEN_VOLUME], target=SERVICE_ACCOUNT_PATH, read_only=True))
    return sorted(mounts, key=lambda m: len(Path(m.target).parts))


def decode_data(obj: Obj) -> dict[str, bytes]:
    """A Secret's ``data`` (base64) or a ConfigMap's ``data`` and ``binaryData``, as bytes."""
    if obj.get("kind") == "Secret":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data
