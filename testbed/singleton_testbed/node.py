"""A real Kubernetes node for the test bed: containerd + runc + CNI bridge, kubelet and
kube-proxy (iptables mode), joined to a started ``ControlPlane``.

Pods run as real containers, so images, securityContext, probes, native sidecars,
``kubectl logs``/``exec`` and Services behave as in production. It needs root, the machine's
containerd 1.6, runc and CNI plugins, and the test bed's own kubelet, kube-proxy and pause
binaries (``testbed/build.sh``). Nothing is pulled from a registry: the sandbox image and
test images are built locally (``oci``) and imported with ``import_image``.

Layouts (``NodeLayout``):

- ``FIRST_NODE``: node ``singleton-node`` on the host's network, InternalIP 10.216.0.1 and pod
  gateway 10.216.1.1/24 both on bridge ``sgl-cni0``, pods in 10.216.1.0/24, cgroups under
  ``/singleton-node``. The control plane must advertise its node IP
  (``ControlPlane(advertise_address=...)``), since the ``kubernetes`` Service's endpoint is
  what pods reach through kube-proxy.
- ``SECOND_NODE``: node ``singleton-node-2`` in network namespace ``sgl-node-2`` (its own
  links, routes and iptables, kube-proxy's chains included), InternalIP 10.216.2.1 on a veth
  pair to the host, pods in 10.216.3.0/24 on its own bridge, cgroups under
  ``/singleton-node-2``. Its kubelet reaches the API server at the first node's IP; the host
  routes between the two nodes' pods (``net.ipv4.ip_forward`` on while it runs).

Every file, socket, mount and pod network namespace of a node lives under its work folder.
A node on the host's network may run once per machine (kube-proxy's iptables chains are the
host's); each layout has its own lock, ``/run/singleton-node/lock`` for the first node and
``lock-<name>`` for others (held for the node's life, released by the kernel if the process
dies). ``start`` records what it creates in ``state.json`` (``state-<name>.json``) first, so
a later ``start`` or ``cleanup_stale`` removes what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from singleton_testbed import node_host as host
from singleton_testbed.controlplane import ControlPlane, issue_cert
from singleton_testbed.node_config import (
    FIRST_NODE,
    PAUSE_IMAGE,
    NodeLayout,
    NodePaths,
    api_server_url,
    write_cert_kubeconfig,
    write_cni_config,
    write_containerd_config,
    write_kube_proxy_config,
    write_kubelet_config,
)
from singleton_testbed.oci import ImageFile, ImageSpec, write_archive
from singleton_testbed.procs import Process, free_port, wait_until

log = logging.getLogger(__name__)

RUN_DIR = Path("/run/singleton-node")
"""The lock and the state file: tmpfs, so a reboot (which removes everything else) forgets them."""
HOST_FOLDERS = (Path("/var/lib/kubelet"), Path("/run/containerd"), Path("/etc/cni"), Path("/var/lib/cni"),
                Path("/var/log/containers"))
"""Fixed paths used whatever the configuration: kubelet's device-plugin socket, the shims'
sockets (``/run/containerd/s``), go-cni's lock in ``/etc/cni/net.d``, libcni's result cache,
kubelet's ``/var/log/containers`` links."""
CONTAINERD = Path("/usr/bin/containerd")
CTR = Path("/usr/bin/ctr")
RUNC = Path("/usr/sbin/runc")
CNI_BIN = Path("/usr/lib/cni")


class NodeError(Exception):
    """The node cannot start here, or did not become Ready."""


class NodeBusyError(NodeError):
    """Another real node runs on this machine."""


def unavailable_reason(binaries: dict[str, Path]) -> str | None:
    """Why a real node cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the real node needs root (containerd, network and cgroups)"
    for path in (CONTAINERD, CTR, RUNC, CNI_BIN / "bridge", CNI_BIN / "host-local", CNI_BIN / "loopback"):
        if not path.exists():
            return f"{path} is missing (apt-get install containerd runc containernetworking-plugins)"
    for tool in ("iptables", "ip6tables", "ip", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    for name in ("kubelet", "kube-proxy", "pause"):
        if name not in binaries or not binaries[name].exists():
            return f"the test bed's {name} binary is missing (run testbed/build.sh)"
    if not host.CGROUP_FS.exists():
        return "no cgroup file system at /sys/fs/cgroup"
    return None


class Node:
    def __init__(self, control_plane: ControlPlane, binaries: dict[str, Path], *,
                 layout: NodeLayout | None = None, workdir: Path | None = None,
                 taints: Sequence[Mapping[str, str]] = ()) -> None:
        """``taints``: what the kubelet registers the Node with (``registerWithTaints``), e.g. to
        keep pods that do not tolerate them off a node shared with other tests."""
        self.control_plane = control_plane
        self.taints = [dict(taint) for taint in taints]
        self.binaries = binaries
        self.layout = layout or FIRST_NODE
        self.paths = NodePaths(workdir or Path(tempfile.mkdtemp(prefix="singleton-node-")))
        self.containerd: Process | None = None
        self.kubelet: Process | None = None
        self.kube_proxy: Process | None = None
        self.kubelet_port = 0
        self._lock: IO[str] | None = None

    # --- start -------------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> None:
        try:
            if reason := unavailable_reason(self.binaries):
                raise NodeError(reason)
            if self.layout.netns is None and self.control_plane.advertise_address != self.layout.node_ip:
                raise NodeError(f"the control plane must advertise the node IP {self.layout.node_ip} "
                                f"(ControlPlane(advertise_address=...)), not {self.control_plane.advertise_address}")
            if self.layout.netns is not None and self.control_plane.advertise_address is None:
                raise NodeError(f"node {self.layout.name} has a network namespace of its own and reaches the API "
                                "server at its advertised address: start the first node's control plane with "
                                "ControlPlane(advertise_address=...)")
            self._take_lock()
        except NodeError:
            with contextlib.suppress(OSError):
                self.paths.work.rmdir()  # the empty folder __init__ made; nothing else is ours yet
            raise
        try:
            _cleanup_recorded(self.layout.name)
            cleanup_stale()  # other layouts' leftovers (their locks free): else taken for live nodes
            self.paths.work.mkdir(parents=True, exist_ok=True)  # again after a stop()
            self._write_state()
            self._make_network()
            host.make_bridge(self.layout.bridge, self.layout.bridge_addresses, self.layout.netns)
            host.make_cgroup_root(self.layout.cgroup_root)
            self._start_containerd()
            self.import_image(self._pause_archive())
            write_cni_config(self.paths, self.layout)
            self._authorize()
            # A Node object left by an earlier node of this name (a killed run, or a node started
            # with other taints) would be adopted by the kubelet as it is: registerWithTaints
            # applies only when the kubelet creates the object. Start from a fresh registration.
            self.control_plane.kubectl("delete", "node", self.layout.name, "--ignore-not-found", check=False)
            self._start_kubelet()
            self._start_kube_proxy()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _take_lock(self) -> None:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path(self.layout.name), "a+")  # noqa: SIM115 - held open for the node's life
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise NodeBusyError(_busy_message(self.layout.name)) from None
        self._lock = lock

    def _write_state(self) -> None:
        others = [name for name in recorded_nodes() if name != self.layout.name]  # live: stale ones were removed
        # The kubelet's sysctls and fixed folders are the machine's: the first node to start
        # keeps their values, and each node that stops before another hands them to it, so the
        # last to stop puts them back. A node in a namespace of its own turns forwarding on.
        sysctls = {} if others else host.read_sysctls()
        if self.layout.netns is not None:
            sysctls |= host.read_sysctls((IP_FORWARD,))
        state = {
            "pid": os.getpid(), "work": str(self.paths.work), "name": self.layout.name,
            "bridge": self.layout.bridge, "cgroup_root": self.layout.cgroup_root,
            "cni_network": self.layout.cni_network,
            "netns": self.layout.netns, "host_link": self.layout.host_link,
            "sysctls": sysctls,
            "kube_proxy": str(self.binaries["kube-proxy"]),
            "socket": str(self.paths.socket),
            # Host folders kubelet, containerd and libcni make at fixed places: removed on clean-up
            # only if they did not exist before this node started.
            "created": [] if others else [str(p) for p in HOST_FOLDERS if not p.exists()],
        }
        path = state_path(self.layout.name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)

    def _make_network(self) -> None:
        """A node in a namespace of its own: the namespace, its veth pair, the routes both ways,
        and the host's forwarding between the nodes' pods."""
        layout = self.layout
        if layout.netns is None:
            return
        assert layout.host_link is not None and layout.host_ip is not None
        host.make_netns(layout.netns, host_link=layout.host_link, host_ip=layout.host_ip,
                        node_link=layout.node_link, node_ip=layout.node_ip)
        self._route()
        Path("/proc/sys", IP_FORWARD).write_text("1\n")

    def _route(self) -> None:
        layout = self.layout
        assert layout.netns is not None and layout.host_link is not None and layout.host_ip is not None
        host.route_netns(layout.netns, host_link=layout.host_link, host_ip=layout.host_ip,
                         node_ip=layout.node_ip, pod_cidr=layout.pod_cidr)

    def _in_netns(self, argv: list[str]) -> list[str]:
        return [*host.in_netns(self.layout.netns), *argv]

    def _pause_archive(self) -> Path:
        spec = ImageSpec(name=PAUSE_IMAGE, files={"pause": ImageFile(source=self.binaries["pause"])},
                         entrypoint=("/pause",), user="65535:65535")
        return write_archive(spec, self.paths.images / "pause.tar")

    def _start_containerd(self) -> None:
        config = write_containerd_config(self.paths, self.layout)
        self.containerd = Process("containerd", self._in_netns([str(CONTAINERD), "--config", str(config)]),
                                  log_path=self.paths.work / "containerd.log")
        self.containerd.start()
        wait_until(lambda: self._ctr("version", check=False).returncode == 0, timeout=30,
                   what="containerd", proc=self.containerd)

    def _ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return host.run(str(CTR), "--address", str(self.paths.socket), "--namespace", "k8s.io", *args,
                        check=check, timeout=timeout)

    def import_image(self, archive: Path) -> None:
        """Import an OCI/Docker image archive into the node's containerd (the CRI's namespace);
        pods then use it by its full name with ``imagePullPolicy: Never`` or ``IfNotPresent``."""
        result = host.run("nice", "-n", "19", "ionice", "-c3", str(CTR), "--address", str(self.paths.socket),
                          "--namespace", "k8s.io", "images", "import", "--no-unpack", str(archive),
                          check=False, timeout=300)
        if result.returncode != 0:
            raise NodeError(f"ctr images import {archive} failed: {result.stderr.strip()}")

    def tag_image(self, source: str, target: str) -> None:
        """Another name for an imported image (a new release tag of the same content, as a
        registry would serve it); replaces ``target`` if it exists."""
        result = self._ctr("images", "tag", "--force", source, target, check=False)
        if result.returncode != 0:
            raise NodeError(f"ctr images tag {source} {target} failed: {result.stderr.strip()}")

    def _authorize(self) -> None:
        """Client certificates for kubelet and kube-proxy, and the RBAC a kubelet needs.

        The test bed's API server authorizes with RBAC only (no Node authorizer), so the node's
        user ``system:node:<name>`` gets the built-in ``system:node`` role by a binding; kube-proxy
        uses the user ``system:kube-proxy``, which the built-in ``system:node-proxier`` binding
        already covers."""
        pki, ca_dir = self.paths.pki, self.control_plane.pki
        name, ip = self.layout.name, self.layout.node_ip
        node_cert = issue_cert(pki, ca_dir, "kubelet-client", f"/O=system:nodes/CN=system:node:{name}")
        self.serving = issue_cert(pki, ca_dir, "kubelet-serving", f"/CN={name}", f"IP:{ip},DNS:{name}")
        proxy_cert = issue_cert(pki, ca_dir, "kube-proxy", "/CN=system:kube-proxy")
        server = api_server_url(self.layout, loopback_url=self.control_plane.info.server,
                                advertised=self.control_plane.advertise_address)
        ca_file = self.control_plane.info.ca_file
        write_cert_kubeconfig(self.paths.work / "kubelet.kubeconfig", server=server, ca_file=ca_file,
                              cert=node_cert[0], key=node_cert[1], user=f"system:node:{name}")
        write_cert_kubeconfig(self.paths.work / "kube-proxy.kubeconfig", server=server, ca_file=ca_file,
                              cert=proxy_cert[0], key=proxy_cert[1], user="system:kube-proxy")
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"singleton-testbed:node:{name}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": f"system:node:{name}"}],
        }
        self.control_plane.kubectl("apply", "-f", "-", input_text=json.dumps(binding))

    def _start_kubelet(self) -> None:
        self.kubelet_port = free_port()
        config = write_kubelet_config(self.paths, self.layout, ca_file=self.control_plane.info.ca_file,
                                      port=self.kubelet_port, serving=self.serving, taints=self.taints)
        self.kubelet = Process(
            "kubelet",
            self._in_netns([
                str(self.binaries["kubelet"]), f"--config={config}",
                f"--kubeconfig={self.paths.work / 'kubelet.kubeconfig'}",
                f"--root-dir={self.paths.kubelet_root}", f"--cert-dir={self.paths.pki}",
                f"--hostname-override={self.layout.name}", f"--node-ip={self.layout.node_ip}",
                # No --pod-infra-container-image (gone in 1.35): it only kept the sandbox image from
                # the image GC, which the config turns off (imageGCHighThresholdPercent 100).
                "--v=1",
            ]),
            log_path=self.paths.work / "kubelet.log",
        )
        self.kubelet.start()

    def _start_kube_proxy(self) -> None:
        config = write_kube_proxy_config(self.paths, self.layout, kubeconfig=self.paths.work / "kube-proxy.kubeconfig",
                                         healthz_port=free_port(), metrics_port=free_port())
        self.kube_proxy = Process("kube-proxy",
                                  self._in_netns([str(self.binaries["kube-proxy"]), f"--config={config}", "--v=1"]),
                                  log_path=self.paths.work / "kube-proxy.log")
        self.kube_proxy.start()

    # --- node-level faults ---------------------------------------------------------------------

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM) and start it again with the same configuration, as a node
        agent upgrade or crash would: running containers are the runtime's, and run on. Returns
        once the new kubelet has reported the Node Ready (a heartbeat after the restart began:
        the old Ready condition outlives the stopped kubelet for the node's grace period)."""
        assert self.kubelet is not None, "the node is not running"
        began = int(time.time())  # heartbeats have whole seconds
        self.kubelet.stop()
        self.kubelet.start()
        wait_until(lambda: self._ready_since(began), timeout=60, what="the restarted kubelet's Ready heartbeat",
                   proc=self.kubelet)

    def _ready_since(self, moment: int) -> bool:
        """The Node's Ready condition is True with a heartbeat after the second ``moment``."""
        for condition in ((self.node_object() or {}).get("status") or {}).get("conditions") or []:
            if condition.get("type") == "Ready":
                heartbeat = datetime.datetime.fromisoformat(str(condition.get("lastHeartbeatTime")))
                return condition.get("status") == "True" and heartbeat.timestamp() > moment
        return False

    def restart_containerd(self) -> None:
        """Stop containerd (SIGTERM) and start it again: the containers' shims are not its
        children (they re-parent at start), so the containers run on, as with a runtime upgrade.
        Returns once its CRI plugin (what the kubelet talks to) is loaded again."""
        assert self.containerd is not None, "the node is not running"
        self.containerd.stop()
        self.containerd.start()
        wait_until(self._cri_ready, timeout=30, what="containerd's CRI plugin", proc=self.containerd)

    def _cri_ready(self) -> bool:
        listed = self._ctr("plugins", "ls", check=False, timeout=10)
        return listed.returncode == 0 and any(
            line.split()[:2] == ["io.containerd.grpc.v1", "cri"] and line.split()[-1] == "ok"
            for line in listed.stdout.splitlines())

    # Whole-node faults need a node in a namespace of its own: the host's network is also the
    # control plane's and PostgreSQL's.

    def _own_link(self) -> str:
        if self.layout.host_link is None:
            raise NodeError(f"node {self.layout.name} is on the host's network: it cannot be cut off alone")
        return self.layout.host_link

    def cut_off(self) -> None:
        """The node loses the network (its link to the host goes down): kubelet, kube-proxy and
        every pod run on, and reach neither the API server nor PostgreSQL, nor anyone them."""
        host.set_link(self._own_link(), up=False)

    def reconnect(self) -> None:
        """The link comes back up, with its routes (the kernel dropped them with the link)."""
        host.set_link(self._own_link(), up=True)
        self._route()

    def power_off(self) -> None:
        """The node loses power: its link goes down and every process of it, kubelet, kube-proxy,
        containerd, the shims and every pod's, stops at one instant (frozen: pods by one
        freezer cgroup above them all, the node's own by SIGSTOP) and is then killed. Nothing
        of it runs on, as after a real power loss; ``power_on`` boots it again."""
        host.set_link(self._own_link(), up=False)
        agents = host.pids_mentioning(str(self.paths.work))
        try:
            for pid in agents:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            host.set_freezer(self.layout.cgroup_root, "FROZEN")
        finally:
            # Dead whatever happened (a freezer that did not settle): a frozen process dies of
            # SIGKILL only once thawed, so kill, then thaw.
            host.kill_and_wait([*agents, *host.cgroup_pids(self.layout.cgroup_root)], timeout=0)
            host.set_freezer(self.layout.cgroup_root, "THAWED")
            host.kill_and_wait(host.cgroup_pids(self.layout.cgroup_root))
        for proc in (self.kubelet, self.kube_proxy, self.containerd):
            if proc is not None and proc.popen is not None:
                proc.popen.wait(10)

    def power_on(self, timeout: float = 120) -> None:
        """The node boots: its link comes back, then containerd (which finds its containers
        dead), kubelet (which starts the pods' containers again) and kube-proxy. Returns once
        the Node reports Ready again."""
        assert self.containerd is not None and self.kubelet is not None and self.kube_proxy is not None
        self.reconnect()
        began = int(time.time())
        self.containerd.start()
        wait_until(self._cri_ready, timeout=30, what="containerd's CRI plugin", proc=self.containerd)
        self.kubelet.start()
        self.kube_proxy.start()
        wait_until(lambda: self._ready_since(began), timeout=timeout, what="the booted node's Ready heartbeat",
                   proc=self.kubelet)

    def stop_kubelet(self) -> None:
        """Stop the kubelet alone (SIGTERM): containers run on, the Node's heartbeats stop."""
        assert self.kubelet is not None, "the node is not running"
        self.kubelet.stop()

    def start_kubelet(self) -> None:
        """Start the stopped kubelet again; returns once it has reported the Node Ready."""
        assert self.kubelet is not None, "the node is not running"
        began = int(time.time())
        self.kubelet.start()
        wait_until(lambda: self._ready_since(began), timeout=60, what="the kubelet's Ready heartbeat",
                   proc=self.kubelet)

    def node_object(self) -> dict[str, Any] | None:
        result = self.control_plane.kubectl("get", "node", self.layout.name, "-o", "json", check=False)
        if result.returncode != 0:
            return None
        node: dict[str, Any] = json.loads(result.stdout)
        return node

    def ready(self) -> bool:
        node = self.node_object()
        conditions = (node or {}).get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in (self.kubelet, self.kube_proxy):
            assert proc is not None
        netns = self.layout.netns
        checks: list[tuple[str, Callable[[], bool], Process | None]] = [
            ("the Node to be Ready", self.ready, self.kubelet),
            ("kube-proxy's iptables rules", lambda: "KUBE-SERVICES" in host.kube_chains(netns).get("iptables/nat", []),
             self.kube_proxy),
        ]
        for what, check, proc in checks:
            wait_until(check, timeout=max(1.0, deadline - time.monotonic()), what=what, proc=proc)
        # The test bed runs no node lifecycle controller, which is what lifts the taint a new
        # kubelet registers with once it reports Ready; lift it here so pods get scheduled.
        node = self.node_object() or {}
        if any(t.get("key") == "node.kubernetes.io/not-ready" for t in node.get("spec", {}).get("taints", [])):
            self.control_plane.kubectl("taint", "node", self.layout.name, "node.kubernetes.io/not-ready-",
                                       check=False)

    # --- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything and leave nothing behind (processes, mounts, links, iptables chains,
        cgroups, sysctls, files); the Node object and its RBAC binding are deleted too."""
        if self.control_plane.apiserver is not None and self.control_plane.apiserver.running():
            binding = f"singleton-testbed:node:{self.layout.name}"
            for args in (("node", self.layout.name), ("clusterrolebinding", binding)):
                with contextlib.suppress(subprocess.SubprocessError):
                    self.control_plane.kubectl("delete", *args, "--ignore-not-found", "--wait=false", check=False)
        for proc in (self.kubelet, self.kube_proxy):
            if proc is not None:
                proc.stop()
        self.kubelet = self.kube_proxy = None
        if self._lock is None:
            return  # never got the lock: nothing of ours exists
        # Containers die first (by cgroup), then containerd and its shims, so nothing restarts them.
        host.remove_cgroups(self.layout.cgroup_root)
        if self.containerd is not None:
            self.containerd.stop()
            self.containerd = None
        _cleanup_recorded(self.layout.name)
        self._lock.close()
        self._lock = None


IP_FORWARD = "net/ipv4/ip_forward"


def lock_path(name: str) -> Path:
    return RUN_DIR / ("lock" if name == FIRST_NODE.name else f"lock-{name}")


def state_path(name: str) -> Path:
    return RUN_DIR / ("state.json" if name == FIRST_NODE.name else f"state-{name}.json")


def _lock_held(name: str) -> bool:
    """Whether a live node holds ``name``'s lock (this process's own included: flock locks are
    per open file)."""
    if not lock_path(name).exists():
        return False
    with open(lock_path(name), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
    return False


def _hand_over_machine_records(state: dict[str, Any], name: str) -> dict[str, str]:
    """Give the kubelet's sysctls and the fixed folders ``state`` recorded to another live node
    (it puts them back when it stops); returns the sysctls left for this node to put back (its
    own forwarding switch), or all of them when no other node lives."""
    machine = {key: value for key, value in (state.get("sysctls") or {}).items() if key != IP_FORWARD}
    own = {key: value for key, value in (state.get("sysctls") or {}).items() if key == IP_FORWARD}
    heir = next((other for other in recorded_nodes() if other != name and _lock_held(other)), None)
    if heir is None:
        return {**machine, **own}
    path = state_path(heir)
    heirs = _read_state(path)
    heirs["sysctls"] = {**machine, **(heirs.get("sysctls") or {})}
    heirs["created"] = sorted({*(heirs.get("created") or []), *(state.get("created") or [])})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(heirs, indent=2))
    tmp.replace(path)
    state["created"] = []
    return own


def recorded_nodes() -> list[str]:
    """The nodes whose state file exists (running, or left by a killed run)."""
    names = []
    for path in sorted(RUN_DIR.glob("state*.json")):
        if name := _read_state(path).get("name"):
            names.append(str(name))
    return names


def _busy_message(name: str) -> str:
    owner = _read_state(state_path(name)).get("pid", "?")
    return (f"another real node runs on this machine ({name}, pid {owner}, lock {lock_path(name)}): a node's "
            "names, addresses and (on the host's network) kube-proxy's iptables rules are the machine's, so only "
            "one of each layout may run; stop it first")


def busy_reason(name: str = FIRST_NODE.name) -> str | None:
    """Why the node ``name`` cannot start now because another process holds its lock (a test
    session's, the demo's), or None. A hint only: ``Node.start`` takes the lock for real."""
    return _busy_message(name) if _lock_held(name) else None


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return state


def cleanup_stale() -> bool:
    """Remove what every node whose lock is free recorded in its state file (a killed run's
    leftovers); a live node's lock makes it leave that node alone. The second node goes
    first, as it stops first. Returns True when there was something to do."""
    if not RUN_DIR.exists():
        return False
    cleaned = False
    for name in sorted(recorded_nodes(), key=lambda name: name == FIRST_NODE.name):
        lock = open(lock_path(name), "a+")  # noqa: SIM115 - closed below
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            cleaned = _cleanup_recorded(name) or cleaned
        except BlockingIOError:
            continue  # a live node's
        finally:
            lock.close()
    return cleaned


def _cleanup_recorded(name: str) -> bool:
    """Remove what node ``name`` recorded (its lock held by the caller)."""
    path = state_path(name)
    state = _read_state(path)
    if not state:
        return False
    work = Path(state["work"])
    log.info("cleaning up the real node recorded in %s (work folder %s)", path, work)
    # kubelet, kube-proxy, containerd (they die with their parent, but a parent may linger),
    # then every shim and container: shims name our socket, containers live in our cgroups.
    host.kill_and_wait(host.pids_mentioning(str(work)))
    host.remove_cgroups(state["cgroup_root"])
    host.kill_and_wait(host.pids_mentioning(str(work)))
    host.unmount_under([work])
    if netns := state.get("netns"):
        # Its links, bridge, routes and iptables (kube-proxy's chains) go with the namespace.
        host.delete_netns(netns, state.get("host_link"))
    else:
        host.delete_bridge(state["bridge"])
        kube_proxy = Path(state.get("kube_proxy", ""))
        if kube_proxy.is_file():
            host.run(str(kube_proxy), "--cleanup", check=False)
        host.remove_kube_chains()
    host.restore_sysctls(_hand_over_machine_records(state, name))
    _remove_host_files(work, state)
    shutil.rmtree(work, ignore_errors=True)
    path.unlink(missing_ok=True)
    return True


def _remove_host_files(work: Path, state: dict[str, Any]) -> None:
    """Files kubelet, the shims and the CNI library write outside our folder: found by our
    container IDs and names, or whole folders that did not exist before the node started."""
    ids = [p.name for p in (NodePaths(work).containerd_state / "io.containerd.runtime.v2.task" / "k8s.io").glob("*")]
    for container in ids:
        # containerd 1.6 names a shim's socket by the hash of <address>/<namespace>/<id>.
        digest = hashlib.sha256(f"{state['socket']}/k8s.io/{container}".encode()).hexdigest()
        Path("/run/containerd/s", digest).unlink(missing_ok=True)
        Path("/var/lib/cni/results", f"cni-loopback-{container}-lo").unlink(missing_ok=True)
    for entry in Path("/var/lib/cni/results").glob(f"{state['cni_network']}-*"):
        entry.unlink(missing_ok=True)
    links = Path("/var/log/containers")
    if links.is_dir():
        for link in links.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and os.readlink(link).startswith(str(work) + "/"):
                    link.unlink()
    for folder in state.get("created", []):
        shutil.rmtree(folder, ignore_errors=True)
