"""The demo's test bed on a real node: ``python -m demo.bed serve STATE_DIR`` (background,
started by ``demo.cluster.start_bed``) and ``python -m demo.bed image`` (the image build).

``serve`` starts, in this order and in this one process: PostgreSQL (admitting the node's pod
network, since pods connect to it at the node IP), etcd and kube-apiserver advertising the
node IP (the ``kubernetes`` Service's endpoint, which pods reach through kube-proxy),
controller-manager and scheduler, and a real node (``singleton_testbed.node.Node``:
containerd, kubelet, kube-proxy). It then waits for ``image.json`` (the runner builds the
image meanwhile, so a cold build overlaps the start), imports that archive into the node
and says ``ready``. On SIGTERM it stops everything in reverse order; ``Node.stop`` leaves
nothing behind.

Why one process of our own, not ``singleton-testbed up``: the node's lock
(``/run/singleton-node/lock``) is held by the process that started the node, the node must
import the image, and PostgreSQL must admit the node's pod network.

Progress goes to ``bed.json`` in the state folder (written atomically): ``phase`` (a line for
the user), ``ready``, ``error`` (with ``busy`` when another real node holds the lock), and the
paths and addresses the demo needs. Every folder is recorded as soon as it exists, so
``demo down`` removes them even if this process was killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

from singleton_testbed.binaries import find_all
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.node import Node, NodeBusyError
from singleton_testbed.node_config import NodeLayout
from singleton_testbed.postgres import PostgresInfo, PostgresServer

BED_FILE = "bed.json"
IMAGE_FILE = "image.json"


class Bed:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.data: dict[str, Any] = {"pid": os.getpid(), "phase": "starting", "ready": False, "error": None}
        self.stop = threading.Event()
        self.ready = False
        self.node: Node | None = None

    def write(self, **values: Any) -> None:
        self.data.update(values)
        tmp = self.folder / (BED_FILE + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.folder / BED_FILE)

    def phase(self, text: str) -> None:
        print(f"[demo-bed] {text}", file=sys.stderr, flush=True)
        self.write(phase=text)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.ready:
            self.stop.set()
            return
        # Still starting: unwind at once, so the `finally` below stops what already runs
        # (Node.start stops its own pieces on any exception).
        raise SystemExit(128 + signum)

    def wait_for_image(self) -> tuple[Path, str]:
        path = self.folder / IMAGE_FILE
        while not path.exists():
            time.sleep(0.2)
        doc = json.loads(path.read_text())
        return Path(doc["archive"]), str(doc["reference"])

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        layout = NodeLayout()
        binaries = find_all()
        # serve_pods: listen beyond loopback; the default networks admitted include the node's
        # pod network (the pods) and the node IP (the host-run operator checks the pods' DSN).
        postgres = PostgresServer(serve_pods=True)
        control_plane = ControlPlane(binaries, advertise_address=layout.node_ip)
        self.write(workdirs=[str(postgres.workdir), str(control_plane.workdir)])
        try:
            self._start(layout, binaries, postgres, control_plane)
            self.stop.wait()
            self.phase("stopping")
            return 0
        except BaseException as exc:
            if not isinstance(exc, SystemExit):
                traceback.print_exc()
                self.write(error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, Exception):
                return 1
            raise
        finally:
            # A second SIGTERM (or ^C) must not cut the clean-up short; `demo down` waits for it.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if self.node is not None:
                self.node.stop()
            control_plane.stop()
            postgres.cleanup()
            self.write(phase="stopped")

    def _start(self, layout: NodeLayout, binaries: dict[str, Path], postgres: PostgresServer,
               control_plane: ControlPlane) -> None:
        self.phase("starting PostgreSQL")
        host = postgres.start()
        self.phase("starting etcd and kube-apiserver (advertising the node IP)")
        cluster = control_plane.start()
        self.phase("starting kube-controller-manager and kube-scheduler")
        control_plane.start_controllers()
        pod_db = PostgresInfo(host=layout.node_ip, port=host.port, superuser=host.superuser)
        self.write(kubeconfig=str(cluster.kubeconfig), dsn=host.dsn, admin_dsn=host.admin_dsn,
                   pod_dsn=pod_db.dsn, path_prefix=str(binaries["kubectl"].parent))
        node = self.node = Node(control_plane, binaries, layout=layout)
        self.write(node={"name": layout.name, "ip": layout.node_ip, "pod_cidr": layout.pod_cidr,
                         "work": str(node.paths.work), "socket": str(node.paths.socket)})
        self.phase(f"starting the real node {layout.name}: containerd, kubelet, kube-proxy")
        try:
            node.start()
        except NodeBusyError:
            self.write(busy=True)
            raise
        self.phase("node Ready; waiting for the image")
        archive, reference = self.wait_for_image()
        self.phase(f"importing {reference} into the node's containerd")
        started = time.monotonic()
        node.import_image(archive)
        self.ready = True
        self.write(image={"archive": str(archive), "reference": reference,
                          "import_seconds": round(time.monotonic() - started, 1)})
        self.phase("ready")
        self.write(ready=True)


def build_image() -> int:
    """Build (or find in the cache) the project's image; print its archive and reference as
    JSON on stdout. Run as a subprocess so the build tools' output can be relayed or hidden."""
    from singleton_testbed.images import ImageBuildError, build_project_image

    try:
        archive, reference = build_project_image()
    except ImageBuildError as exc:
        print(f"[image] {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"archive": str(archive), "reference": reference}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo.bed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the test bed and the real node until SIGTERM")
    serve.add_argument("folder", type=Path)
    commands.add_parser("image", help="build the project's image (cached); print its archive and reference")
    args = parser.parse_args(argv)
    if args.command == "image":
        return build_image()
    return Bed(args.folder).serve()


if __name__ == "__main__":
    sys.exit(main())
