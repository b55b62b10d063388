"""Session fixtures: the real PostgreSQL server and the real Kubernetes control plane.

PostgreSQL: ``SINGLETON_TEST_DSN`` (and ``SINGLETON_TEST_ADMIN_DSN``) point the tests at a
server of your own; otherwise one is started from local binaries for the session.
Kubernetes: ``USE_EXISTING_CLUSTER=true`` with ``KUBECONFIG`` runs against that cluster;
otherwise etcd and kube-apiserver are started from the test bed's cached binaries.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane, wait_established
from singleton_testbed.postgres import PostgresInfo, PostgresServer

if TYPE_CHECKING:
    from singleton_testbed.node import Node


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer | None]:
    """The PostgreSQL server this session started (None when SINGLETON_TEST_DSN is given)."""
    if os.environ.get("SINGLETON_TEST_DSN"):
        yield None
        return
    server = PostgresServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def pg_dsn(postgres_server: PostgresServer | None) -> str:
    """DSN of a non-superuser role that owns the test database."""
    if postgres_server is None:
        return os.environ["SINGLETON_TEST_DSN"]
    return postgres_server.info.dsn


@pytest.fixture(scope="session")
def pg_admin_dsn(postgres_server: PostgresServer | None) -> str:
    """DSN of a superuser, for fault injection (pg_terminate_backend of anyone)."""
    if postgres_server is None:
        return os.environ.get("SINGLETON_TEST_ADMIN_DSN", os.environ["SINGLETON_TEST_DSN"])
    return postgres_server.info.admin_dsn


@pytest.fixture(scope="session")
def pg_info(postgres_server: PostgresServer | None) -> PostgresInfo | None:
    return None if postgres_server is None else postgres_server.info


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Every asyncio task a test starts must be finished when it ends."""
    before = asyncio.all_tasks()
    yield
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    for task in leaked:
        task.cancel()
    assert not leaked, f"tasks leaked by the test: {leaked}"


# --- Kubernetes ----------------------------------------------------------------------------


class Cluster:
    """The cluster under test: either the test bed's control plane or an existing cluster."""

    def __init__(self, kubeconfig: Path, control_plane: ControlPlane | None) -> None:
        self.kubeconfig = kubeconfig
        self.control_plane = control_plane

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(
        self, *args: str, input_text: str | None = None, check: bool = True, kubeconfig: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**self.env, "KUBECONFIG": str(kubeconfig or self.kubeconfig)}
        result = subprocess.run(
            ["kubectl", *args], input=input_text, capture_output=True, text=True, env=env, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def apply(self, manifest: str, *, namespace: str | None = None) -> None:
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        self.kubectl(*args, input_text=manifest)

    def start_controllers(self) -> None:
        if self.control_plane is not None:
            self.control_plane.start_controllers()


def use_existing_cluster() -> bool:
    return os.environ.get("USE_EXISTING_CLUSTER", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def testbed_binaries() -> dict[str, Path]:
    binaries = find_all()
    add_to_path(binaries)
    return binaries


@pytest.fixture(scope="session")
def cluster(testbed_binaries: dict[str, Path]) -> Iterator[Cluster]:
    if use_existing_cluster():
        kubeconfig = Path(os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config")))
        yield Cluster(kubeconfig, None)
        return
    control_plane = ControlPlane(testbed_binaries)
    try:
        info = control_plane.start()
        yield Cluster(info.kubeconfig, control_plane)
    finally:
        control_plane.stop()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test (with a ``default`` service account), deleted after it."""
    name = "t-" + re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + secrets.token_hex(3)
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("create", "serviceaccount", "default", "-n", name, check=False)
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def controllers(cluster: Cluster) -> Cluster:
    """The cluster with kube-controller-manager and kube-scheduler running."""
    cluster.start_controllers()
    return cluster


CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / "singleton.dev_singletonservices.yaml"


@pytest.fixture(scope="session")
def singleton_crd(cluster: Cluster) -> Path:
    """The SingletonService CRD, applied (server-side) to the cluster and Established."""
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=singleton-tests", "-f", str(CRD_PATH)
    )
    wait_established(cluster.kubectl, "crd/singletonservices.singleton.dev")
    return CRD_PATH


# --- the real node -------------------------------------------------------------------------


@dataclass
class RealNode:
    """A real node (containerd + kubelet + kube-proxy) and the control plane it joined."""

    cluster: Cluster
    node: Node
    image: str
    """A busybox image imported into the node (``imagePullPolicy: Never``)."""
    archive: Path
    """That image's archive, to import again after the node restarts."""


@pytest.fixture(scope="session")
def real_node(testbed_binaries: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """A real node on a control plane of its own: the node's pods reach the API server through
    the ``kubernetes`` Service, so the control plane must advertise the node IP; and pods the
    other tests schedule must not land on it. Skipped when this machine cannot run one."""
    from singleton_testbed.node import Node, NodeBusyError, cleanup_stale, unavailable_reason
    from singleton_testbed.node_config import NodeLayout
    from singleton_testbed.oci import busybox_image, write_archive

    if use_existing_cluster():
        pytest.skip("the real node joins the test bed's own control plane, not USE_EXISTING_CLUSTER's")
    if reason := unavailable_reason(testbed_binaries):
        pytest.skip(reason)
    try:
        image = busybox_image()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    archive = write_archive(image, tmp_path_factory.mktemp("images") / "busybox.tar")
    layout = NodeLayout()
    control_plane = ControlPlane(testbed_binaries, advertise_address=layout.node_ip)
    node: Node | None = None
    try:
        info = control_plane.start()
        control_plane.start_controllers()
        node = Node(control_plane, testbed_binaries, layout=layout)
        try:
            node.start()
        except NodeBusyError as error:
            pytest.skip(str(error))
        node.import_image(archive)
        yield RealNode(Cluster(info.kubeconfig, control_plane), node, image.name, archive)
    finally:
        if node is not None:
            node.stop()
            cleanup_stale()  # what a failed test's killed node left, if any (no-op when none)
        control_plane.stop()
