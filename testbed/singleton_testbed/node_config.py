"""Configuration files of the real node (``node``): containerd, CNI, kubelet, kube-proxy,
and the certificates and kubeconfigs they use, all under the node's work folder.

kubelet and kube-proxy configs are written as JSON, which their YAML loaders accept.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
"""The sandbox image's name: containerd's ``sandbox_image`` and kubelet's pinned image. It is
built locally (``oci``) from the test bed's own pause binary, never pulled."""


@dataclass(frozen=True)
class NodeLayout:
    """Names and addresses of the real node; each is the node's own, so clean-up can find it.

    The defaults avoid the Service range (10.0.0.0/24)."""

    name: str = "singleton-node"
    bridge: str = "sgl-cni0"
    node_ip: str = "10.216.0.1"
    """The InternalIP, on the bridge (a /32): not loopback, so the API server can reach the
    kubelet (logs, exec) and pods can reach the API server behind the ``kubernetes`` Service."""
    pod_cidr: str = "10.216.1.0/24"
    cgroup_root: str = "/singleton-node"
    cni_network: str = "singleton-node"
    netns: str | None = None
    """The node's own network namespace (``/run/netns/<netns>``), or None for the host's.

    In its own namespace the node has its own links, routes and iptables (kube-proxy's chains
    included), joined to the host by a veth pair: ``node_ip`` on the namespace's end,
    ``host_ip`` on the host's (link ``host_link``), a /30 between them. The host routes the
    node's pods through ``node_ip``; the namespace's default route is ``host_ip``."""
    host_ip: str | None = None
    host_link: str | None = None

    @property
    def pod_gateway(self) -> str:
        return str(next(ipaddress.IPv4Network(self.pod_cidr).hosts()))

    @property
    def bridge_addresses(self) -> tuple[str, ...]:
        """On the host the bridge also carries the node IP (a /32); in a namespace of its own
        the node IP is on the namespace's end of the veth pair instead."""
        prefix = ipaddress.IPv4Network(self.pod_cidr).prefixlen
        gateway = f"{self.pod_gateway}/{prefix}"
        return (gateway,) if self.netns else (f"{self.node_ip}/32", gateway)

    @property
    def node_link(self) -> str:
        """The namespace's end of the veth pair (a namespace has its own names)."""
        return "eth0"


FIRST_NODE = NodeLayout()
"""The first node: on the host's network, beside the control plane and PostgreSQL, whose
addresses pods reach through it (the ``kubernetes`` Service's endpoint is its node IP)."""
SECOND_NODE = NodeLayout(name="singleton-node-2", bridge="sgl-cni1", node_ip="10.216.2.1",
                         pod_cidr="10.216.3.0/24", cgroup_root="/singleton-node-2",
                         # Not "singleton-node-…": clean-up finds a network's cached results by its prefix.
                         cni_network="singleton-second-node", netns="sgl-node-2", host_ip="10.216.2.2",
                         host_link="sgl-node-2")
"""The second node: a network namespace of its own, its pods routed through the host."""


@dataclass(frozen=True)
class NodePaths:
    """Where everything of one node lives; only ``work`` is chosen, the rest derives from it."""

    work: Path

    @property
    def pki(self) -> Path:
        return self.work / "pki"

    @property
    def containerd(self) -> Path:
        return self.work / "containerd"

    @property
    def containerd_state(self) -> Path:
        return self.containerd / "state"

    @property
    def socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def cni_conf(self) -> Path:
        return self.work / "cni" / "net.d"

    @property
    def cni_ipam(self) -> Path:
        return self.work / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.work / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.work / "pod-logs"

    @property
    def images(self) -> Path:
        return self.work / "images"


def api_server_url(layout: NodeLayout, *, loopback_url: str, advertised: str | None) -> str:
    """The API server's address as the node's agents reach it: loopback from the host's
    network, the advertised address (on the first node's bridge) from a namespace of its own."""
    if layout.netns is None:
        return loopback_url
    assert advertised is not None, "a node in a namespace of its own needs an advertised API server address"
    port = loopback_url.rsplit(":", 1)[1]
    return f"https://{advertised}:{port}"


def write_cert_kubeconfig(path: Path, *, server: str, ca_file: Path, cert: Path, key: Path, user: str) -> None:
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": user}}],
        "current-context": "testbed",
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


def write_containerd_config(paths: NodePaths, layout: NodeLayout) -> Path:
    state = paths.containerd_state
    text = f"""\
version = 2
root = "{paths.containerd / 'root'}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{paths.socket}"

[ttrpc]
  address = "{paths.socket}.ttrpc"

[debug]
  address = ""

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.containerd / 'opt'}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Without CAP_SYS_RESOURCE runc cannot lower a container's oom_score_adj below ours, and
  # fails with "can't get final child's PID from pipe": clamp it instead.
  restrict_oom_score_adj = true
  # Pod network namespaces under our state folder, not /run/netns: found (and unmounted)
  # by path when a killed run is cleaned up, and never confused with another tool's.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  max_container_log_line_size = 16384

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        # runc's state in our folder, not /run/containerd/runc (shared with any other containerd).
        Root = "{paths.work / 'runc'}"
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{paths.cni_conf}"
    max_conf_num = 1
"""
    path = paths.containerd / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def write_cni_config(paths: NodePaths, layout: NodeLayout) -> Path:
    """A bridge network with host-local IPAM whose state stays in our folder. No ``ipMasq``
    (it would add iptables rules and pods need nothing beyond this host) and no
    ``isGateway`` (see ``node_host.make_bridge``): the route is given by IPAM instead."""
    config = {
        "cniVersion": "0.4.0",
        "name": layout.cni_network,
        "plugins": [
            {
                "type": "bridge", "bridge": layout.bridge, "isGateway": False, "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local", "dataDir": str(paths.cni_ipam),
                    "ranges": [[{"subnet": layout.pod_cidr, "gateway": layout.pod_gateway}]],
                    "routes": [{"dst": "0.0.0.0/0", "gw": layout.pod_gateway}],
                },
            },
        ],
    }
    paths.cni_conf.mkdir(parents=True, exist_ok=True)
    paths.cni_ipam.mkdir(parents=True, exist_ok=True)
    path = paths.cni_conf / "10-singleton-node.conflist"
    path.write_text(json.dumps(config, indent=2))
    return path


def write_kubelet_config(paths: NodePaths, layout: NodeLayout, *, ca_file: Path, port: int,
                         serving: tuple[Path, Path], taints: Sequence[Mapping[str, str]] = ()) -> Path:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # cgroup v1 hybrid, no systemd, swap tolerated: the machines this runs on.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        # Pods' cgroups under our own root, not /kubepods: removable by name after a crash.
        "cgroupRoot": layout.cgroup_root,
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        "address": layout.node_ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzPort": 0,
        "tlsCertFile": str(serving[0]),
        "tlsPrivateKeyFile": str(serving[1]),
        # The API server presents its kubelet client certificate (system:masters) for logs and
        # exec; anyone else is checked against RBAC through the API server.
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca_file)}},
        "authorization": {"mode": "Webhook"},
        "podLogsDir": str(paths.pod_logs),
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        # A busy shared test machine must not evict the test's pods or collect its images.
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
        "nodeStatusUpdateFrequency": "5s",
        # A restarted container waits at most 1 s (the default back-off grows 10 s, 20 s, 40 s...
        # up to 5 min): fault tests kill the same container again and again, and each run must
        # find its group whole again within seconds. Alpha in 1.32, hence the gate.
        "featureGates": {"KubeletCrashLoopBackOffMax": True},
        "crashLoopBackOff": {"maxContainerRestartPeriod": "1s"},
    }
    if taints:
        config["registerWithTaints"] = [dict(taint) for taint in taints]
    path = paths.work / "kubelet-config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def write_kube_proxy_config(paths: NodePaths, layout: NodeLayout, *, kubeconfig: Path,
                            healthz_port: int, metrics_port: int) -> Path:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": layout.name,
        "bindAddress": layout.node_ip,
        "clusterCIDR": layout.pod_cidr,
        "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "metricsBindAddress": f"127.0.0.1:{metrics_port}",
        # Zero means "leave the machine's conntrack settings alone": they are global.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        # localhost NodePorts would set the global sysctl route_localnet.
        "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "1s"},
        "nodePortAddresses": [f"{layout.node_ip}/32"],
        "oomScoreAdj": 0,
    }
    path = paths.work / "kube-proxy-config.json"
    path.write_text(json.dumps(config, indent=2))
    return path
