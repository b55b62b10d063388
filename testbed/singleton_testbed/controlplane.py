"""A real Kubernetes control plane on loopback: etcd and kube-apiserver, plus
kube-controller-manager and kube-scheduler on request.

The API server runs with RBAC authorization, service-account token signing, a
static admin token (``system:masters``), and a serving certificate from a CA made
for the session; the written kubeconfig verifies it. Everything lives in one
temporary folder that is removed on stop.

The real node (``singleton_testbed.node``) needs ``advertise_address`` set to its node IP (the
``kubernetes`` Service's endpoint, reached by pods through kube-proxy): the API server then
binds every address instead of loopback only, and its certificate names the node IP. It still
requires TLS and a token. The API server always presents a client certificate
(``system:masters``) to kubelets, for ``kubectl logs``/``exec``.

With a node, the ``kubernetes`` Service's endpoint is written once by the test bed and never
withdrawn (``--endpoint-reconciler-type=none``), as a load-balanced control plane endpoint is.
The API server's own reconciler withdraws it at every graceful stop, and kube-proxy, whose watch
broke with the API server, learns that it is back only when its reconnect back-off (up to 30 s
after repeated restarts) lets it: pods then could not reach a restarted API server for up to a
minute (a fault campaign on 2026-11-27), which measured kube-proxy, not the sidecar.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from singleton_testbed.procs import Process, free_port, wait_until

log = logging.getLogger(__name__)

ADMIN_USER = "singleton-admin"


@dataclass(frozen=True)
class ClusterInfo:
    server: str
    kubeconfig: Path
    token: str
    ca_file: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def issue_cert(pki: Path, ca_dir: Path, name: str, subject: str, sans: str = "") -> tuple[Path, Path]:
    """A key and a certificate signed by the control plane's CA (``ca.crt``/``ca.key``)."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", subject, cwd=pki)
    ext = pki / f"{name}.ext"
    ext.write_text((f"subjectAltName={sans}\n" if sans else "") + "extendedKeyUsage=clientAuth,serverAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca_dir / "ca.crt"), "-CAkey", str(ca_dir / "ca.key"),
             "-CAcreateserial", "-CAserial", str(pki / "ca.srl"), "-out", f"{name}.crt", "-days", "2",
             "-extfile", ext.name, cwd=pki)
    (pki / f"{name}.key").chmod(0o600)
    return pki / f"{name}.crt", pki / f"{name}.key"


def make_pki(folder: Path, extra_ips: Sequence[str] = ()) -> None:
    """A CA, an API server serving certificate for 127.0.0.1/localhost (and ``extra_ips``), a service-account key."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=singleton-testbed-ca", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=folder)
    (folder / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
        "DNS:kubernetes.default.svc,IP:10.0.0.1" + "".join(f",IP:{ip}" for ip in extra_ips) + "\n"
    )
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "2", "-extfile", "san.ext", cwd=folder)
    # The API server's client certificate towards kubelets (logs, exec, port-forward): a real
    # kubelet (``node``) accepts it through its client CA; the stand-in serves no kubelet API.
    issue_cert(folder, folder, "kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)


def write_kubeconfig(path: Path, *, server: str, ca_file: Path, token: str, user: str = ADMIN_USER) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": user, "namespace": "default"}}],
        "current-context": "testbed",
    }
    path.write_text(json.dumps(config, indent=2))
    path.chmod(0o600)


NODE_GRACE_PERIOD = 20
"""Seconds without a kubelet's heartbeat before the node lifecycle controller marks its Node
NotReady (Kubernetes' default is 40 s, 50 s from 1.35): shorter, so that tests of whole-node
faults see it sooner; still four of the test bed kubelets' 5 s status updates."""

class ControlPlane:
    def __init__(self, binaries: dict[str, Path], workdir: Path | None = None, *,
                 advertise_address: str | None = None) -> None:
        """``advertise_address``: the endpoint of the ``kubernetes`` Service (default 127.0.0.1:
        no pod can reach it); a real node (``node``) needs its node IP here, so that kube-proxy
        sends pods' ClusterIP traffic somewhere they can reach. Setting it binds the API server on
        every address (``serve_pods``) and names the address in the serving certificate."""
        self.binaries = binaries
        self.advertise_address = advertise_address
        self.serve_pods = advertise_address is not None
        self.pod_addresses: tuple[str, ...] = (advertise_address,) if advertise_address else ()
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="singleton-k8s-"))
        self.pki = self.workdir / "pki"
        self.token = secrets.token_hex(16)
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.api_port = free_port()
        self.etcd: Process | None = None
        self.apiserver: Process | None = None
        self.controller_manager: Process | None = None
        self.scheduler: Process | None = None
        self.node_lifecycle: Process | None = None

    @property
    def info(self) -> ClusterInfo:
        return ClusterInfo(
            server=f"https://127.0.0.1:{self.api_port}",
            kubeconfig=self.workdir / "kubeconfig",
            token=self.token,
            ca_file=self.pki / "ca.crt",
        )

    def start(self) -> ClusterInfo:
        make_pki(self.pki, self.pod_addresses)
        (self.workdir / "tokens.csv").write_text(f'{self.token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        info = self.info
        write_kubeconfig(info.kubeconfig, server=info.server, ca_file=info.ca_file, token=self.token)
        self.start_etcd()
        self.start_apiserver()
        return info

    def start_etcd(self) -> None:
        self.etcd = Process(
            "etcd",
            [
                str(self.binaries["etcd"]), "--name", "testbed", "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.etcd_peer_port}",
                "--initial-cluster", f"testbed=http://127.0.0.1:{self.etcd_peer_port}",
                "--unsafe-no-fsync", "--log-level", "warn",
            ],
            log_path=self.workdir / "etcd.log",
        )
        self.etcd.start()
        wait_until(lambda: self._http_ok(f"http://127.0.0.1:{self.etcd_port}/health"), timeout=30,
                   what="etcd health", proc=self.etcd)

    def start_apiserver(self) -> None:
        pki = self.pki
        self.apiserver = Process(
            "kube-apiserver",
            [
                str(self.binaries["kube-apiserver"]),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                f"--bind-address={'0.0.0.0' if self.serve_pods else '127.0.0.1'}",  # pods: see the module docstring
                f"--secure-port={self.api_port}",
                f"--advertise-address={self.advertise_address or '127.0.0.1'}",
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                # A real node's Hostname address does not resolve; its InternalIP does.
                "--kubelet-preferred-address-types=InternalIP,Hostname,InternalDNS,ExternalDNS,ExternalIP",
                f"--cert-dir={self.workdir / 'certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={self.workdir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--allow-privileged=true",
                *(["--endpoint-reconciler-type=none"] if self.serve_pods else []),  # see the module docstring
                "--enable-priority-and-fairness=false",
                "--audit-log-path=" + str(self.workdir / "audit.log"),
                "--audit-policy-file=" + str(self._audit_policy()),
                "--v=0",
            ],
            log_path=self.workdir / "kube-apiserver.log",
        )
        self.apiserver.start()
        wait_until(self._ready, timeout=90, what="kube-apiserver /readyz", proc=self.apiserver)
        if self.serve_pods:
            self._publish_endpoint()

    def _publish_endpoint(self) -> None:
        """The ``kubernetes`` Service's EndpointSlice: the advertised address and the secure port."""
        assert self.advertise_address is not None
        body = {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "kubernetes",
                                    "endpointslice.kubernetes.io/managed-by": "singleton-testbed"}},
            "addressType": "IPv6" if ":" in self.advertise_address else "IPv4",
            "endpoints": [{"addresses": [self.advertise_address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": self.api_port, "protocol": "TCP"}],
        }
        base = f"{self.info.server}/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
        request = urllib.request.Request(base, data=json.dumps(body).encode(), method="POST", headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10, context=self._ssl_context()):
                pass
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # written at an earlier start: it never changes
                raise

    def _audit_policy(self) -> Path:
        # Metadata for every request: benchmarks count API requests per second from it.
        path = self.workdir / "audit-policy.yaml"
        path.write_text(
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\n"
            "rules:\n- level: Metadata\n"
        )
        return path

    def _ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki / "ca.crt"))

    def _http_ok(self, url: str, *, tls: bool = False) -> bool:
        request = urllib.request.Request(url)
        if tls:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=2, context=self._ssl_context() if tls else None) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _ready(self) -> bool:
        return self._http_ok(f"{self.info.server}/readyz", tls=True)

    def _component(self, binary: str) -> list[str]:
        """A controller-manager's or scheduler's command line: the admin kubeconfig for
        everything, no leader election, its own port on loopback."""
        kubeconfig = str(self.info.kubeconfig)
        return [str(self.binaries[binary]), f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}"]

    def start_controllers(self) -> None:
        """Start kube-controller-manager and kube-scheduler (Deployments, ReplicaSets, GC, binding)."""
        if self.controller_manager is None:
            self.controller_manager = Process(
                "kube-controller-manager",
                [
                    *self._component("kube-controller-manager"),
                    f"--service-account-private-key-file={self.pki / 'sa.key'}",
                    f"--root-ca-file={self.pki / 'ca.crt'}",
                    # Names both pinned versions know (1.37 knows no cloud controllers and no
                    # short aliases); without --cloud-provider those do not run anyway.
                    "--controllers=*,-node-ipam-controller,-node-lifecycle-controller,"
                    "-persistentvolume-binder-controller,-persistentvolume-attach-detach-controller,"
                    "-persistentvolume-expander-controller,-ephemeral-volume-controller",
                    "--concurrent-deployment-syncs=5", "--concurrent-replicaset-syncs=5",
                ],
                log_path=self.workdir / "kube-controller-manager.log",
            )
            self.controller_manager.start()
        if self.scheduler is None:
            self.scheduler = Process("kube-scheduler", self._component("kube-scheduler"),
                                     log_path=self.workdir / "kube-scheduler.log")
            self.scheduler.start()

    def start_node_lifecycle(self, grace_period: int = NODE_GRACE_PERIOD) -> None:
        """The node lifecycle controller, in a kube-controller-manager of its own: it marks a
        Node whose kubelet stopped reporting NotReady (Unknown) after ``grace_period`` seconds,
        its pods not Ready, and taints it (``node.kubernetes.io/unreachable``: pods evicted
        after their 300 s toleration). Not among ``start_controllers``' because tests make Node
        objects with no kubelet behind them (``kubehelpers.ensure_node``), which it would mark
        and whose pods it would evict; tests of whole-node faults start it."""
        if self.node_lifecycle is not None and self.node_lifecycle.running():
            return
        self.node_lifecycle = Process(
            "node-lifecycle-controller",
            [
                *self._component("kube-controller-manager"),
                "--controllers=node-lifecycle-controller",
                f"--node-monitor-grace-period={grace_period}s", f"--node-startup-grace-period={grace_period}s",
                "--node-monitor-period=1s",
            ],
            log_path=self.workdir / "node-lifecycle-controller.log",
        )
        self.node_lifecycle.start()

    def stop_node_lifecycle(self) -> None:
        if self.node_lifecycle is not None:
            self.node_lifecycle.stop()
            self.node_lifecycle = None

    def kubectl(
        self, *args: str, input_text: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.info.kubeconfig)}
        return subprocess.run(
            [str(self.binaries["kubectl"]), *args], input=input_text, capture_output=True, text=True,
            check=check, env=env,
        )

    def restart_apiserver(self) -> None:
        if self.apiserver is not None:
            self.apiserver.stop()
        self.start_apiserver()

    def restart_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
        self.start_etcd()

    def stop(self) -> None:
        for proc in (self.node_lifecycle, self.scheduler, self.controller_manager, self.apiserver, self.etcd):
            if proc is not None:
                proc.stop()
        self.node_lifecycle = self.scheduler = self.controller_manager = self.apiserver = self.etcd = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def wait_established(kubectl: Callable[..., subprocess.CompletedProcess[str]], crd: str, *,
                     timeout: float = 60.0) -> None:
    """``kubectl wait --for=condition=Established`` on ``crd`` (``crd/<name>``), retried while the
    CRD has no conditions yet: kubectl fails at once on a missing ``.status.conditions``
    ("accessor error") instead of waiting, which happens right after a create under load.
    ``kubectl(*args, check=False)`` runs kubectl (``ControlPlane.kubectl`` or the like)."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(1, round(deadline - time.monotonic()))
        result = kubectl("wait", "--for=condition=Established", f"--timeout={left}s", crd, check=False)
        if result.returncode == 0:
            return
        if "accessor error" not in result.stderr or time.monotonic() >= deadline:
            raise RuntimeError(f"kubectl wait --for=condition=Established {crd} failed: {result.stderr.strip()}")
        time.sleep(0.2)
