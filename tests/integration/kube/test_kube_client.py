"""KubeClient and load_kube_config against the real API server of the test session."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from singleton_election.kube import (
    KubeClient,
    KubeConfig,
    KubeConfigError,
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeGone,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
    load_kube_config,
)
from singleton_election.kube_blocking import BlockingKubeClient, ClientClosed
from tests.conftest import Cluster
from tests.support.connectproxy import ConnectProxy

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(60)]

REVIEW = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}


async def whoami(client: KubeClient) -> str:
    review = await client.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", body=REVIEW,
                                  timeout=5)
    return str(review["status"]["userInfo"]["username"])


def admin_config(cluster: Cluster) -> KubeConfig:
    return load_kube_config(str(cluster.kubeconfig))


def ca_file_of(cluster: Cluster) -> str:
    doc = yaml.safe_load(cluster.kubeconfig.read_text())
    return str(doc["clusters"][0]["cluster"]["certificate-authority"])


def write_kubeconfig(path: Path, *, server: str, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "ctx",
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "team-a"}}],
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def service_account_token(cluster: Cluster, namespace: str, name: str) -> str:
    cluster.kubectl("create", "serviceaccount", name, "-n", namespace, check=False)
    return cluster.kubectl("create", "token", name, "-n", namespace).stdout.strip()


def write_service_account_dir(folder: Path, cluster: Cluster, namespace: str) -> None:
    """What the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount."""
    (folder / "token").write_text(service_account_token(cluster, namespace, "default"))
    (folder / "ca.crt").write_bytes(Path(ca_file_of(cluster)).read_bytes())
    (folder / "namespace").write_text(namespace)


def client_certificate_config(pki: Path, server: str, folder: Path) -> KubeConfig:
    """A kubeconfig with client-certificate-data for a system:masters user, signed by the test bed's CA."""
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr",
                    "-subj", "/O=system:masters/CN=cert-user"], cwd=folder, check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", "client.csr", "-CA", str(pki / "ca.crt"), "-CAkey",
                    str(pki / "ca.key"), "-CAcreateserial", "-CAserial", str(folder / "ca.srl"), "-out",
                    "client.crt", "-days", "1"], cwd=folder, check=True, capture_output=True)

    def b64(name: str | Path) -> str:
        return base64.b64encode((folder / name).read_bytes()).decode()

    path = write_kubeconfig(
        folder / "kubeconfig", server=server, cluster={"certificate-authority-data": b64(pki / "ca.crt")},
        user={"client-certificate-data": b64("client.crt"), "client-key-data": b64("client.key")})
    config = load_kube_config(str(path))
    assert config.token is None and config.client_cert_file and config.client_key_file
    for name in (config.client_cert_file, config.client_key_file):
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o600
    assert Path(config.client_key_file).read_bytes() == (folder / "client.key").read_bytes()
    return config


@pytest_asyncio.fixture(loop_scope="function")
async def admin(cluster: Cluster) -> AsyncIterator[KubeClient]:
    async with KubeClient(admin_config(cluster)) as client:
        yield client


# --- configuration -------------------------------------------------------------------------


def test_loads_the_testbed_kubeconfig(cluster: Cluster) -> None:
    config = admin_config(cluster)
    assert config.server.startswith("https://127.0.0.1:")
    assert config.token and config.token not in repr(config)
    assert config.ca_data is not None and b"BEGIN CERTIFICATE" in config.ca_data
    assert config.namespace == "default"
    assert not config.insecure


def test_exec_plugin_and_auth_provider_are_refused(tmp_path: Path) -> None:
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "aws"}}
    path = write_kubeconfig(tmp_path / "exec", server="https://x:6443", cluster={}, user=exec_user)
    with pytest.raises(KubeConfigError, match=r"user settings exec are not supported"):
        load_kube_config(str(path))
    path = write_kubeconfig(tmp_path / "ap", server="https://x:6443", cluster={}, user={"auth-provider": {}})
    with pytest.raises(KubeConfigError, match=r"auth-provider"):
        load_kube_config(str(path))
    path = write_kubeconfig(tmp_path / "proxy", server="https://x:6443", cluster={"proxy-url": "http://p"}, user={})
    with pytest.raises(KubeConfigError, match=r"cluster settings proxy-url"):
        load_kube_config(str(path))


def test_missing_and_malformed_kubeconfigs(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="cannot read kubeconfig"):
        load_kube_config(str(tmp_path / "absent"))
    (tmp_path / "list").write_text("- a\n- b\n")
    with pytest.raises(KubeConfigError, match="not a mapping"):
        load_kube_config(str(tmp_path / "list"))
    (tmp_path / "nocontext").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    with pytest.raises(KubeConfigError, match="no current-context"):
        load_kube_config(str(tmp_path / "nocontext"))


def test_relative_paths_and_merged_kubeconfig_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ca.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "tok").write_text("secret-1\n")
    users = {"apiVersion": "v1", "kind": "Config", "users": [{"name": "u", "user": {"tokenFile": "tok"}}]}
    (tmp_path / "users.yaml").write_text(yaml.safe_dump(users))
    main = write_kubeconfig(tmp_path / "main.yaml", server="https://h:1/", cluster={"certificate-authority": "ca.pem"},
                            user={"token": "shadowed"})
    doc = yaml.safe_load(main.read_text())
    doc["users"] = []
    main.write_text(yaml.safe_dump(doc))
    files = [str(main), str(tmp_path / "missing"), str(tmp_path / "users.yaml")]
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join(files))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # KUBECONFIG wins over in-cluster
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    config = load_kube_config(None)
    assert config.server == "https://h:1"
    assert config.ca_data == b"-----BEGIN CERTIFICATE-----\n"
    assert config.token_file == str(tmp_path / "tok")
    assert config.bearer_token() == "secret-1"
    (tmp_path / "tok").write_text("secret-2\n")
    assert config.bearer_token() == "secret-2"  # re-read: projected tokens rotate
    assert config.namespace == "team-a"


async def test_in_cluster_configuration(
    cluster: Cluster, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = admin_config(cluster).server
    host, port = server.removeprefix("https://").rsplit(":", 1)
    write_service_account_dir(tmp_path, cluster, namespace)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    config = load_kube_config(None, service_account_dir=tmp_path)
    assert config.server == server
    assert config.namespace == namespace
    assert config.token is None and config.token_file == str(tmp_path / "token")
    async with KubeClient(config) as client:
        assert await whoami(client) == f"system:serviceaccount:{namespace}:default"
        (tmp_path / "token").write_text(service_account_token(cluster, namespace, "rotated"))
        assert await whoami(client) == f"system:serviceaccount:{namespace}:rotated"
    (tmp_path / "token").unlink()
    with pytest.raises(KubeConfigError, match="service account token"):
        load_kube_config(None, service_account_dir=tmp_path)


async def test_client_certificate_data(cluster: Cluster, tmp_path: Path) -> None:
    if cluster.control_plane is None:
        pytest.skip("needs the test bed's CA key to sign a client certificate")
    config = client_certificate_config(cluster.control_plane.pki, admin_config(cluster).server, tmp_path)
    async with KubeClient(config) as client:
        assert await whoami(client) == "cert-user"
        listing = await client.request("GET", "/api/v1/namespaces", timeout=5)
        assert any(ns["metadata"]["name"] == "default" for ns in listing["items"])


# --- requests and errors ---------------------------------------------------------------------


async def test_lists_namespaces(admin: KubeClient, namespace: str) -> None:
    listing = await admin.request("GET", "/api/v1/namespaces", timeout=5)
    assert listing["kind"] == "NamespaceList"
    assert namespace in {ns["metadata"]["name"] for ns in listing["items"]}
    one = await admin.request("GET", "/api/v1/namespaces", params={"fieldSelector": f"metadata.name={namespace}"},
                              timeout=5)
    assert [ns["metadata"]["name"] for ns in one["items"]] == [namespace]


async def test_reaches_the_api_server_through_a_connect_proxy(cluster: Cluster, proxy: ConnectProxy) -> None:
    """The operator outside a pod behind HTTPS_PROXY (singleton_operator.kubelogin): TLS to the
    API server inside the proxy's tunnel, and the tunnel kept for the next request."""
    config = dataclasses.replace(admin_config(cluster), proxy=proxy.url)
    async with KubeClient(config) as client:
        assert await whoami(client) == await whoami(client)
    assert proxy.targets == [config.server.removeprefix("https://")]  # one tunnel for both requests


def test_only_http_proxies_are_accepted(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match=r"only http:// proxies are supported, got 'https://p:3128'"):
        KubeClient(dataclasses.replace(admin_config(cluster), proxy="https://p:3128"))


async def test_errors_map_to_exceptions(admin: KubeClient, namespace: str) -> None:
    configmaps = f"/api/v1/namespaces/{namespace}/configmaps"
    with pytest.raises(KubeNotFound) as not_found:
        await admin.request("GET", f"{configmaps}/absent", timeout=5)
    assert not_found.value.status == 404 and not_found.value.reason == "NotFound"
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "1"}}
    created = await admin.request("POST", configmaps, body=body, timeout=5)
    with pytest.raises(KubeConflict, match="already exists") as exists:
        await admin.request("POST", configmaps, body=body, timeout=5)
    assert exists.value.reason == "AlreadyExists"
    stale = {**created, "data": {"a": "2"}}
    await admin.request("PUT", f"{configmaps}/cm", body=stale, timeout=5)
    with pytest.raises(KubeConflict) as conflict:
        await admin.request("PUT", f"{configmaps}/cm", body={**stale, "data": {"a": "3"}}, timeout=5)
    assert conflict.value.reason == "Conflict"
    with pytest.raises(KubeInvalid):
        await admin.request("POST", configmaps, body={**body, "metadata": {"name": "Not_Valid"}}, timeout=5)
    patched = await admin.request("PATCH", f"{configmaps}/cm", body={"data": {"b": "4"}},
                                  content_type="application/merge-patch+json", timeout=5)
    assert patched["data"] == {"a": "2", "b": "4"}


async def test_forbidden_for_a_service_account_without_rbac(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    token = service_account_token(cluster, namespace, "nobody")
    path = write_kubeconfig(tmp_path / "kubeconfig", server=admin_config(cluster).server,
                            cluster={"certificate-authority": ca_file_of(cluster)}, user={"token": token})
    async with KubeClient(load_kube_config(str(path))) as client:
        assert await whoami(client) == f"system:serviceaccount:{namespace}:nobody"
        with pytest.raises(KubeForbidden) as forbidden:
            await client.request("GET", "/api/v1/namespaces", timeout=5)
    assert forbidden.value.status == 403 and "cannot list resource" in forbidden.value.message


async def test_watch_sees_a_configmap_change(admin: KubeClient, namespace: str) -> None:
    configmaps = f"/api/v1/namespaces/{namespace}/configmaps"
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "watched"}, "data": {"v": "1"}}
    created = await admin.request("POST", configmaps, body=body, timeout=5)
    params = {"fieldSelector": "metadata.name=watched", "resourceVersion": created["metadata"]["resourceVersion"]}
    seen: list[tuple[str, dict[str, Any]]] = []

    async def follow() -> None:
        async with aclosing(admin.watch(configmaps, params=params, timeout=30)) as events:
            async for event in events:
                seen.append(event)
                if event[0] == "DELETED":
                    return

    async with asyncio.timeout(10):
        watcher = asyncio.create_task(follow())
        await admin.request("PATCH", f"{configmaps}/watched", body={"data": {"v": "2"}},
                            content_type="application/merge-patch+json", timeout=5)
        await admin.request("DELETE", f"{configmaps}/watched", timeout=5)
        await watcher
    assert [kind for kind, _ in seen] == ["MODIFIED", "DELETED"]
    assert seen[0][1]["data"] == {"v": "2"}


async def test_watch_ends_after_its_timeout(admin: KubeClient, namespace: str) -> None:
    started = time.monotonic()
    # Nothing matches the selector (controller-manager may add kube-root-ca.crt meanwhile).
    events = [e async for e in admin.watch(f"/api/v1/namespaces/{namespace}/configmaps",
                                           params={"labelSelector": "singleton.dev/none=x"}, timeout=1)]
    assert events == []
    assert 0.8 < time.monotonic() - started < 4


# --- an unreachable or failing server ------------------------------------------------------


async def test_refused_connection_is_unavailable() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    async with KubeClient(KubeConfig(server=f"https://127.0.0.1:{port}", token="t")) as client:
        with pytest.raises(KubeUnavailable) as refused:
            await client.request("GET", "/version", timeout=2)
        assert refused.value.status == 0 and isinstance(refused.value.__cause__, OSError)
        with pytest.raises(KubeUnavailable):
            async for _ in client.watch("/api/v1/pods", timeout=2):
                pass


async def test_a_watch_refuses_a_timeout_seconds_parameter_its_timeout_would_override() -> None:
    async with KubeClient(KubeConfig(server="https://127.0.0.1:1", token="t")) as client:
        with pytest.raises(ValueError, match="a watch's timeoutSeconds is its timeout argument"):
            async for _ in client.watch("/api/v1/pods", params={"timeoutSeconds": "60"}, timeout=2):
                pass


async def test_silent_server_times_out_within_the_timeout() -> None:
    writers: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda r, w: writers.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with KubeClient(KubeConfig(server=f"http://127.0.0.1:{port}")) as client:
            started = time.monotonic()
            with pytest.raises(KubeUnavailable, match=r"no answer within 0\.5s") as timed_out:
                await client.request("GET", "/version", timeout=0.5)
            assert 0.45 < time.monotonic() - started < 1.0
            assert isinstance(timed_out.value.__cause__, TimeoutError)
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def fake_server(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[KubeClient]:
    """A client of a local HTTP server answering every GET with ``handler``."""
    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with KubeClient(KubeConfig(server=f"http://127.0.0.1:{runner.addresses[0][1]}")) as client:
            yield client
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("status", "expected"), [
    (429, KubeUnavailable), (500, KubeUnavailable), (503, KubeUnavailable), (401, KubeError), (418, KubeError),
])
async def test_throttling_and_server_errors(status: int, expected: type[KubeError]) -> None:
    async def handler(request: web.Request) -> web.Response:
        doc = {"kind": "Status", "code": status, "reason": "Because", "message": "said so"}
        return web.Response(status=status, text=json.dumps(doc), content_type="application/json")

    async with fake_server(handler) as client:
        with pytest.raises(expected) as error:
            await client.request("GET", "/x", timeout=5)
    assert type(error.value) is expected
    assert (error.value.status, error.value.reason, error.value.message) == (status, "Because", "said so")


@pytest.mark.parametrize(("code", "expected"), [(410, KubeGone), (500, KubeUnavailable), (403, KubeForbidden)])
async def test_watch_error_events_raise(code: int, expected: type[KubeError]) -> None:
    """The API server reports a compacted resourceVersion as an ERROR event with a 410 Status."""
    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.query["watch"] == "1" and request.query["timeoutSeconds"] == "7"
        response = web.StreamResponse()
        await response.prepare(request)
        added = {"type": "ADDED", "object": {"kind": "ConfigMap", "metadata": {"name": "a" * 100_000}}}
        error = {"type": "ERROR", "object": {"kind": "Status", "code": code, "reason": "Expired",
                                             "message": "too old resource version: 1 (190)"}}
        data = (json.dumps(added) + "\n" + json.dumps(error) + "\n").encode()
        for start in range(0, len(data), 1000):  # events split across chunks
            await response.write(data[start:start + 1000])
        return response

    seen = []
    async with fake_server(handler) as client:
        with pytest.raises(expected) as error:
            async for kind, obj in client.watch("/api/v1/configmaps", params={"resourceVersion": "1"}, timeout=7):
                seen.append((kind, len(obj["metadata"]["name"])))
    assert seen == [("ADDED", 100_000)]
    assert error.value.status == code and "too old resource version" in error.value.message


def test_the_blocking_client_serves_several_threads_and_ends_its_loop(cluster: Cluster) -> None:
    """``BlockingKubeClient`` (kubectl singleton, the harness): calls from several threads at
    once on its one loop and connection pool; the client's errors as they are; ``close`` ends
    its thread and loop, and a call after it fails rather than hangs."""
    client = BlockingKubeClient(admin_config(cluster), user_agent="singleton-tests")
    names: list[str] = []

    def read_the_namespace() -> None:
        for _ in range(5):
            names.append(client.request("GET", "/api/v1/namespaces/default")["metadata"]["name"])

    threads = [threading.Thread(target=read_the_namespace) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert names == ["default"] * 40
    with pytest.raises(KubeNotFound):
        client.request("GET", "/api/v1/namespaces/no-such-namespace-here")
    loop_thread = client._thread
    client.close()
    assert not loop_thread.is_alive()
    client.close()  # idempotent
    with pytest.raises(ClientClosed):
        client.request("GET", "/api/v1/namespaces/default")
