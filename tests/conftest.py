"""Session fixtures: the real PostgreSQL server, the real Kubernetes control plane, and the
session's real node with the project's images.

PostgreSQL: ``SINGLETON_TEST_DSN`` (and ``SINGLETON_TEST_ADMIN_DSN``) point the tests at a
server of your own; otherwise one is started from local binaries for the session.
Kubernetes: ``USE_EXISTING_CLUSTER=true`` with ``KUBECONFIG`` runs against that cluster;
otherwise etcd and kube-apiserver are started from the test bed's cached binaries.
Real node: when this machine can run one (root, containerd: ``node.unavailable_reason``), the
control plane advertises the node IP and the first test that asks for ``real_node`` starts the
node; it then serves the whole session (one per machine). See docs/testbed.md.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from singleton_testbed.binaries import add_to_path, find_all
from singleton_testbed.controlplane import ControlPlane, wait_established
from singleton_testbed.harness.sidecars import SidecarProcess
from singleton_testbed.postgres import PostgresInfo, PostgresServer
from tests.support import acting
from tests.support.connectproxy import ConnectProxy
from tests.support.paths import REPO_ROOT

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keeps each phase's report on the test (``item.stash[PHASE_REPORTS]``), so that fixtures
    can tell that their test failed (and save what there is to read)."""
    report: pytest.TestReport = yield
    item.stash.setdefault(PHASE_REPORTS, {})[report.when] = report
    return report


PHASE_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


# A test's tier follows from what it uses: the fixtures that start a server or build something
# mark every test whose fixture closure holds them, so `make unit` (none of these markers) starts
# nothing and builds nothing. Tests that start servers of their own carry the marker themselves.
FIXTURE_MARKERS = {
    "postgres_server": "postgres",
    "cluster": "k8s",
    "controllers": "controlplane",
    "real_node": "node",
    "project_image": "image",
    "dist_dir": "build",
}


MACHINE_GROUP = "machine"
"""The share of ``make test`` that needs this machine to itself: ``tests/node/`` (the real node,
one per machine: its lock; the image's build, one cache; the demo and the doc tests'
``singleton-testbed up``, which start nodes of their own) and the test bed's own tests (they
take the node's lock)."""
MACHINE_MODULES = frozenset({"tests/integration/kube/test_testbed.py"})
RELEASE_GROUP = "release"
"""``tests/release/``: one worker, so that the ``make dist`` they share (``dist_dir``, a session
fixture: one per worker) is built once."""


def worker_share(nodeid: str) -> str:
    """Which tests one pytest-xdist worker runs together, in order: ``MACHINE_GROUP``,
    ``RELEASE_GROUP``, or the test's module (its module-scoped fixtures are set up once)."""
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/node/") or module in MACHINE_MODULES:
        return MACHINE_GROUP
    if module.startswith("tests/release/"):
        return RELEASE_GROUP
    return module


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``make test``'s ``--dist loadgroup``: the workers share the suite by ``worker_share``.
    xdist's own loadgroup reads ``xdist_group`` marks by renaming each test's node id, which
    pytest 9.2 no longer lets a plugin do (the marks are ignored and a group spreads over the
    workers), so the shares are decided here, from the tests' paths. Other modes are xdist's."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # The shares start in collection order (``pytest_collection_modifyitems``: the node's first),
    # not by their number of tests: the longest share is not the one with the most tests.
    config.option.loadscopereorder = False

    class Shares(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # the documented override of the scope schedulers
            return worker_share(nodeid)

    return Shares(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test by its fixtures (``FIXTURE_MARKERS``) and orders the suite: the tests on
    the session's real node last (the node lives until the session, or the worker, ends and
    holds the machine's node lock, which the demo's test and the doc tests' ``singleton-testbed
    up`` need for nodes of their own; ``test_e2e`` asks for the node at run time), and before
    the rest the other tests of the shares of ``worker_share``, so that under ``make test``
    the node's share starts first: it is the longest. A worker runs its share in this order.
    A test on the real node outside ``tests/node/`` is refused: it would run beside the node's
    share, and two nodes cannot run on one machine."""
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            if marker := FIXTURE_MARKERS.get(fixture):
                item.add_marker(marker)
        if worker_share(item.nodeid) != MACHINE_GROUP and any(item.get_closest_marker(m) for m in ("node", "image")):
            raise pytest.UsageError(f"{item.nodeid} runs on the real node or builds the image: "
                                    "it belongs in tests/node/")
    items.sort(key=lambda item: ("real_node" in getattr(item, "fixturenames", ()) or item.path.name == "test_e2e.py",
                                 worker_share(item.nodeid) == item.nodeid.split("::", 1)[0]))


def phase_failed(request: pytest.FixtureRequest) -> bool:
    """Whether the requesting test's setup or call failed (for a function-scoped fixture's teardown)."""
    reports = request.node.stash.get(PHASE_REPORTS, {})
    return any(r.failed for r in reports.values())


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
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `make dist` builds (the krew plugin for this machine only; the image and its SBOM
    are tests/node/test_image.py's), built once for tests/release/test_dist.py and
    tests/release/test_krew.py; no server."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "singleton_testbed.dist", "--krew-host", "--no-image", str(out)],
                            capture_output=True, text=True, check=False, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == str(out)
    return out


@pytest.fixture(scope="session")
def real_node_reason(testbed_binaries: dict[str, Path]) -> str | None:
    """Why this session has no real node, or None when it can start one."""
    from singleton_testbed.node import unavailable_reason

    if use_existing_cluster():
        return "the real node joins the test bed's own control plane, not USE_EXISTING_CLUSTER's"
    return unavailable_reason(testbed_binaries)


@pytest.fixture(scope="session")
def cluster(testbed_binaries: dict[str, Path], real_node_reason: str | None) -> Iterator[Cluster]:
    if use_existing_cluster():
        kubeconfig = Path(os.environ.get("KUBECONFIG", str(Path.home() / ".kube" / "config")))
        yield Cluster(kubeconfig, None)
        return
    # The real node's pods reach the API server through the `kubernetes` Service, whose endpoint
    # is the advertised address: the node IP when a node may join (started on first use), so
    # that the control plane need not restart for it.
    from singleton_testbed.node_config import NodeLayout

    advertise = NodeLayout().node_ip if real_node_reason is None else None
    control_plane = ControlPlane(testbed_binaries, advertise_address=advertise)
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


CRD_PATH = REPO_ROOT / "crds" / "singleton.dev_singletonservices.yaml"


@pytest.fixture(scope="session")
def singleton_crd(cluster: Cluster) -> Path:
    """The SingletonService CRD, applied (server-side) to the cluster and Established."""
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=singleton-tests", "-f", str(CRD_PATH)
    )
    wait_established(cluster.kubectl, "crd/singletonservices.singleton.dev")
    return CRD_PATH


# --- the real node -------------------------------------------------------------------------

REAL_NODE_TAINT = {"key": "singleton.dev/real-node", "value": "session", "effect": "NoSchedule"}
"""The session's real node carries it, so that the pods other tests leave to the scheduler (and
which expect no kubelet at all) never land on it."""
REAL_NODE_TOLERATION = {"key": REAL_NODE_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}
"""What a pod meant for the real node carries (with a nodeSelector on its hostname)."""
SECOND_NODE_TAINT = {"key": "singleton.dev/second-node", "value": "session", "effect": "NoSchedule"}
"""The second real node's own taint: only pods that ask for it (tests of two nodes) land there."""
SECOND_NODE_TOLERATION = {"key": SECOND_NODE_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}
NODE_BUSY_WAIT = float(os.environ.get("SINGLETON_NODE_WAIT", "300"))
"""How long the session waits for another process's real node to go (``NodeBusyError``)."""


@dataclass
class RealNode:
    """The session's real node (containerd + kubelet + kube-proxy) and the control plane it joined."""

    cluster: Cluster
    node: Node
    image: str
    """A busybox image imported into the node (``imagePullPolicy: Never``)."""
    archive: Path
    """That image's archive."""
    archives: list[Path] = field(default_factory=list)
    """Every archive imported so far, imported again by ``restart``."""
    toleration: dict[str, str] = field(default_factory=lambda: dict(REAL_NODE_TOLERATION))
    """What lets a pod onto this node past its taint."""

    @property
    def name(self) -> str:
        return self.node.layout.name

    def import_image(self, archive: Path) -> None:
        self.node.import_image(archive)
        if archive not in self.archives:
            self.archives.append(archive)

    def restart(self) -> None:
        """Start the node again after ``node.stop()`` (a test that stops it), with every image
        the session imported: a fresh containerd has none."""
        self.node.start()
        for archive in self.archives:
            self.node.import_image(archive)

    def pod_placement(self) -> dict[str, object]:
        """What a pod spec needs to run on this node: its hostname and the taint's toleration."""
        return {"nodeSelector": {"kubernetes.io/hostname": self.name}, "tolerations": [self.toleration]}


def _start_node(node: Node) -> None:
    from singleton_testbed.node import NodeBusyError

    deadline = time.monotonic() + NODE_BUSY_WAIT
    waited = False
    while True:
        try:
            node.start()
            return
        except NodeBusyError as error:
            if time.monotonic() > deadline:
                pytest.skip(f"{error} (waited {NODE_BUSY_WAIT:.0f} s; SINGLETON_NODE_WAIT)")
            if not waited:
                print(f"[real node] waiting up to {NODE_BUSY_WAIT:.0f} s: {error}", file=sys.stderr)
                waited = True
            time.sleep(5)


@pytest.fixture(scope="session")
def real_node(controllers: Cluster, testbed_binaries: dict[str, Path], real_node_reason: str | None,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    """The session's one real node, joined to the session's control plane (which advertises the
    node IP), tainted with ``REAL_NODE_TAINT``. Started on first use, stopped at the end of the
    session. Skipped when this machine cannot run one, or another process's node holds the
    machine's node lock for longer than ``SINGLETON_NODE_WAIT`` seconds."""
    from singleton_testbed.node import Node, cleanup_stale
    from singleton_testbed.oci import busybox_image, write_archive

    if real_node_reason is not None:
        pytest.skip(real_node_reason)
    assert controllers.control_plane is not None
    try:
        image = busybox_image()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    archive = write_archive(image, tmp_path_factory.mktemp("images") / "busybox.tar")
    node = Node(controllers.control_plane, testbed_binaries, taints=[REAL_NODE_TAINT])
    _start_node(node)
    try:
        real = RealNode(controllers, node, image.name, archive)
        real.import_image(archive)
        yield real
    finally:
        node.stop()
        cleanup_stale()  # what a failed test's killed node left, if any (no-op when none)


@pytest.fixture(scope="session")
def second_node(real_node: RealNode, controllers: Cluster, testbed_binaries: dict[str, Path], project_image: str,
                test_apps_image: str) -> Iterator[RealNode]:
    """A second real node (``SECOND_NODE``: a network namespace of its own, pods routed to and
    from the first node's), joined to the session's control plane, tainted with
    ``SECOND_NODE_TAINT``, with every image the first node has. Started on first use, stopped
    before the first node at the end of the session. Tests of a node's failure also want the
    node lifecycle controller (``ControlPlane.start_node_lifecycle``), for their module only."""
    from singleton_testbed.node import Node
    from singleton_testbed.node_config import SECOND_NODE

    assert controllers.control_plane is not None
    node = Node(controllers.control_plane, testbed_binaries, layout=SECOND_NODE, taints=[SECOND_NODE_TAINT])
    _start_node(node)
    try:
        second = RealNode(controllers, node, real_node.image, real_node.archive,
                          toleration=dict(SECOND_NODE_TOLERATION))
        for archive in real_node.archives:
            second.import_image(archive)
        yield second
    finally:
        node.stop()


@pytest.fixture(scope="session")
def project_image(real_node: RealNode) -> str:
    """The project's image (the Dockerfile, built with buildah, cached by content), imported
    into the session's node; its reference, for ``imagePullPolicy: Never`` or ``IfNotPresent``."""
    from singleton_testbed import images

    if missing := images.missing_tools():
        pytest.skip(f"building the image needs {' and '.join(missing)}")
    archive, reference = images.build_project_image()
    real_node.import_image(archive)
    return reference


@pytest.fixture(scope="session")
def test_apps_image(real_node: RealNode, project_image: str) -> str:
    """The test-only image (``singleton_testbed.apps_image``): the project's image plus
    ``tests/data`` and the test bed's package at /opt/singleton-tests (on PYTHONPATH); imported
    into the session's node."""
    from singleton_testbed.apps_image import build_test_apps_image

    archive, reference = build_test_apps_image()
    real_node.import_image(archive)
    return reference


@pytest.fixture
def proxy() -> Iterator[ConnectProxy]:
    """An HTTP CONNECT proxy on loopback (tests of clients behind HTTPS_PROXY)."""
    server = ConnectProxy()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# --- gated apps that record their acts (tests/support/acting.py) ---------------------------------------


@pytest.fixture
def acting_log(tmp_path: Path) -> Path:
    return tmp_path / "acts.log"


@pytest.fixture
def gated(pg_dsn: str, tmp_path: Path, acting_log: Path) -> Iterator[acting.Factory]:
    group = "s-" + uuid.uuid4().hex[:10]
    started: list[SidecarProcess] = []

    def make(count: int = 2, *, app_env: dict[str, str] | None = None, env: dict[str, str] | None = None,
             file_gate: bool = False, nice: int = 0) -> list[SidecarProcess]:
        for _ in range(count):
            index = len(started)
            sidecar_env = {"SINGLETON_GROUP": group, "SINGLETON_BACKEND": "postgres",
                           "SINGLETON_POSTGRES_DSN": pg_dsn, "SINGLETON_IDENTITY": f"m{index}-{uuid.uuid4().hex[:6]}",
                           "ACT_LOG": str(acting_log), "ACT_FINISH": str(acting.FINISH), **acting.TIMINGS,
                           **(app_env or {}), **(env or {})}
            command: list[str] = [sys.executable, acting.APP]
            if file_gate:
                sidecar_env["SINGLETON_GATE_DIR"] = str(tmp_path / f"gate{index}")
                command = []
            sidecar = SidecarProcess(f"m{index}", sidecar_env, tmp_path / f"m{index}.log", command=command,
                                     nice=nice)
            started.append(sidecar.start())
        return started[-count:]

    yield make
    for sidecar in started:
        sidecar.stop()
