"""``singleton-testbed``: start and stop the test bed for humans.

``up`` starts PostgreSQL and the control plane (with controller-manager and scheduler)
in a background process and prints the variables to export; when run as root on a machine
with containerd, runc and the CNI plugins it also starts two real nodes (``singleton_testbed.node``:
containerd + kubelet + kube-proxy each, Nodes ``singleton-node`` and ``singleton-node-2``, the
second in a network namespace of its own, with the node lifecycle controller; ``--nodes 1``
or ``SINGLETON_TESTBED_NODES=1`` starts the first alone, ``--no-node`` none), imports the
project's image into them (built with buildah when not cached; ``--no-image`` skips it), prints
how to import more images, and exports ``SINGLETON_E2E_POD_DSN``, the PostgreSQL DSN their pods
use (``make e2e-existing``). ``down`` stops it and removes its folders, and removes what a
killed real node left behind; ``status`` tells whether it runs. ``image`` builds the project's image with
buildah (no Docker engine, no registry) and prints the OCI archive's path, its reference and
its size (``singleton_testbed.images``; ``make image``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from singleton_testbed import node as node_mod
from singleton_testbed.binaries import find_all
from singleton_testbed.controlplane import ControlPlane
from singleton_testbed.node_config import FIRST_NODE, SECOND_NODE
from singleton_testbed.postgres import PostgresServer

STATE_DIR = Path(os.environ.get("SINGLETON_TESTBED_STATE", str(Path.home() / ".cache" / "singleton" / "run")))
STATE_FILE = STATE_DIR / "testbed.json"


NODES_VARIABLE = "SINGLETON_TESTBED_NODES"


def default_nodes() -> int:
    """``SINGLETON_TESTBED_NODES`` (0, 1 or 2), else 2."""
    value = os.environ.get(NODES_VARIABLE, "2")
    if value not in ("0", "1", "2"):
        raise SystemExit(f"singleton-testbed: {NODES_VARIABLE} must be 0, 1 or 2, not {value!r}")
    return int(value)


def _import_project_image(nodes: list[node_mod.Node]) -> dict[str, str]:
    """Build (or find in the cache) the project's image and import it into the nodes, so pods
    can use ``ghcr.io/singleton-dev/singleton:<version>`` at once; why not, when it cannot."""
    from singleton_testbed import images

    if missing := images.missing_tools():
        return {"IMAGE_SKIPPED": f"building the image needs {' and '.join(missing)}"}
    try:
        archive, reference = images.build_project_image()
        for node in nodes:
            node.import_image(archive)
    except (images.ImageBuildError, node_mod.NodeError) as error:
        return {"IMAGE_SKIPPED": str(error)}
    return {"IMAGE": reference}


def _serve(nodes: int, with_image: bool = True) -> int:
    """Run in the background: start everything, write the state file, wait for SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    binaries = find_all()
    # Another node holding the machine's lock (a test session's, the demo's) is no error here:
    # the test bed comes up without one and says why, as when this machine cannot run one.
    no_node = "--no-node given" if not nodes else \
        node_mod.unavailable_reason(binaries) or node_mod.busy_reason()
    no_second = "--nodes 1 given" if nodes < 2 else no_node or node_mod.busy_reason(SECOND_NODE.name)
    layout = FIRST_NODE
    postgres = PostgresServer()
    # A real node's pods reach the API server through the `kubernetes` Service, whose endpoint
    # is the advertised address: the node IP then, 127.0.0.1 (as before) without a node.
    control_plane = ControlPlane(binaries, advertise_address=None if no_node else layout.node_ip)
    started: list[node_mod.Node] = []
    try:
        pg = postgres.start()
        k8s = control_plane.start()
        control_plane.start_controllers()
        state = {
            "pid": os.getpid(),
            "KUBECONFIG": str(k8s.kubeconfig),
            "SINGLETON_TEST_DSN": pg.dsn,
            "SINGLETON_TEST_ADMIN_DSN": pg.admin_dsn,
            "PATH_PREFIX": str(binaries["kubectl"].parent),
        }
        if no_node is None:
            for node_layout in (FIRST_NODE, SECOND_NODE) if no_second is None else (FIRST_NODE,):
                node = node_mod.Node(control_plane, binaries, layout=node_layout)
                started.append(node)
                node.start()
            if len(started) > 1:
                control_plane.start_node_lifecycle()
            first = started[0]
            state |= {"NODE": layout.name, "NODE_IP": layout.node_ip, "NODE_WORK": str(first.paths.work),
                      "CONTAINERD_ADDRESS": str(first.paths.socket),
                      "NODES": " ".join(node.layout.name for node in started),
                      "CONTAINERD_ADDRESSES": " ".join(str(node.paths.socket) for node in started),
                      # The same database as seen from the nodes' pods (and from this machine).
                      "SINGLETON_E2E_POD_DSN": dataclasses.replace(pg, host=layout.node_ip).dsn}
            if no_second is not None:
                state["SECOND_NODE_SKIPPED"] = no_second
            state |= _import_project_image(started) if with_image else {"IMAGE_SKIPPED": "--no-image given"}
        else:
            state["NODE_SKIPPED"] = no_node
        tmp = STATE_FILE.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(STATE_FILE)
        stop.wait()
    finally:
        for node in reversed(started):
            node.stop()
        control_plane.stop()
        postgres.cleanup()
        STATE_FILE.unlink(missing_ok=True)
    return 0


def _read_state() -> dict[str, str] | None:
    try:
        state: dict[str, str] = json.loads(STATE_FILE.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    try:
        os.kill(int(state["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError):
        STATE_FILE.unlink(missing_ok=True)
        return None
    return state


def _print_exports(state: dict[str, str]) -> None:
    print(f"export KUBECONFIG={state['KUBECONFIG']}")
    print(f"export SINGLETON_TEST_DSN={state['SINGLETON_TEST_DSN']}")
    print(f"export SINGLETON_TEST_ADMIN_DSN={state['SINGLETON_TEST_ADMIN_DSN']}")
    print(f"export PATH={state['PATH_PREFIX']}:$PATH")
    if "SINGLETON_E2E_POD_DSN" in state:
        print(f"export SINGLETON_E2E_POD_DSN={state['SINGLETON_E2E_POD_DSN']}")
    if "IMAGE" in state:
        print(f"# image {state['IMAGE']} imported into the real node" + ("s" if " " in state.get("NODES", "") else ""))
    elif "IMAGE_SKIPPED" in state:
        print(f"# the project's image is not imported: {state['IMAGE_SKIPPED']}")
    if "NODE" in state:
        print(f"# real nodes {state.get('NODES', state['NODE'])} (the first's InternalIP {state['NODE_IP']}, "
              f"files in {state['NODE_WORK']}); import an image archive into each with:")
        for address in state.get("CONTAINERD_ADDRESSES", state["CONTAINERD_ADDRESS"]).split():
            print(f"#   ctr --address {address} --namespace k8s.io images import ARCHIVE.tar")
        if "SECOND_NODE_SKIPPED" in state:
            print(f"# no second node: {state['SECOND_NODE_SKIPPED']}")
    elif "NODE_SKIPPED" in state:
        print(f"# no real node: {state['NODE_SKIPPED']}")


def _up(nodes: int, with_image: bool = True) -> int:
    if state := _read_state():
        print("# the test bed is already running", file=sys.stderr)
        _print_exports(state)
        return 0
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log_path = STATE_DIR / "testbed.log"
    find_all()  # build in the foreground so its progress is visible
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "singleton_testbed.cli", "serve", f"--nodes={nodes}",
             *([] if with_image else ["--no-image"])],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    # A real node adds up to two minutes, a cold build of the image it imports about two more.
    wait = 600 if nodes else 240
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            print(f"the test bed failed to start; see {log_path}", file=sys.stderr)
            return 1
        if state := _read_state():
            print(f"# test bed running (pid {state['pid']}); stop it with `make testbed-down`", file=sys.stderr)
            _print_exports(state)
            return 0
        time.sleep(0.2)
    proc.terminate()
    print(f"the test bed did not become ready in {wait} s; see {log_path}", file=sys.stderr)
    return 1


def _cleanup_stale_node() -> None:
    """Remove what a killed real node left (its state file says what); a no-op when a live
    node holds its lock, or when not root (no node could have run)."""
    if os.geteuid() == 0 and node_mod.cleanup_stale():
        print("removed what a killed real node left behind", file=sys.stderr)


def _down() -> int:
    state = _read_state()
    if state is None:
        _cleanup_stale_node()
        print("the test bed is not running", file=sys.stderr)
        return 0
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _cleanup_stale_node()
            print("the test bed is stopped", file=sys.stderr)
            return 0
        time.sleep(0.2)
    print(f"the test bed (pid {pid}) did not stop in 60 s", file=sys.stderr)
    return 1


def _status() -> int:
    state = _read_state()
    if state is None:
        print("the test bed is not running")
        return 1
    _print_exports(state)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["image"]:
        from singleton_testbed import images  # only this command needs it

        return images.main(argv[1:])
    parser = argparse.ArgumentParser(prog="singleton-testbed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status", "serve"],
                        help="up: start in the background; down: stop; status: print exports; "
                             "serve: run in the foreground")
    parser.add_argument("--nodes", type=int, choices=(0, 1, 2), default=None,
                        help="up/serve: how many real nodes to start when this machine can run them (default 2, "
                             "or SINGLETON_TESTBED_NODES)")
    parser.add_argument("--no-node", action="store_true", help="up/serve: start no real node (--nodes 0)")
    parser.add_argument("--no-image", action="store_true",
                        help="up/serve: do not build and import the project's image into the real node")
    args = parser.parse_args(argv)
    nodes = 0 if args.no_node else args.nodes if args.nodes is not None else default_nodes()
    if args.command == "up":
        return _up(nodes, not args.no_image)
    if args.command == "serve":
        return _serve(nodes, not args.no_image)
    commands = {"down": _down, "status": _status}
    return commands[args.command]()


if __name__ == "__main__":
    sys.exit(main())
