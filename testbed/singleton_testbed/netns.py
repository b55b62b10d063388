"""Pod networking for the stand-in kubelet: one host bridge, a network namespace and a veth
pair per pod, and routes that cut a pod off from one address (partitions).

Called by ``kubelet_pods`` (sandboxes), ``kubelet`` (start-up clean-up, fault hooks), and, for
the addresses pods use to reach the host, by ``controlplane`` and ``postgres``.

Layout with the defaults (``PodNetworkConfig``):

- bridge ``sgltb0`` holds three host addresses: 10.213.0.1/16 (``gateway``: the pods' default
  route, the Node's InternalIP and every pod's ``hostIP``; the host's own traffic to pods,
  probes and tests, comes from it), 10.213.0.2 (``api_ip``: where pods reach the API server,
  ``KUBERNETES_SERVICE_HOST``) and 10.213.0.3 (``postgres_ip``: where pods reach PostgreSQL).
  The servers listen on every host address; the separate addresses only let a test cut a pod
  off from one of them (``partition(pod, api_ip)`` leaves PostgreSQL and probes working).
  Never partition the gateway: the pod's probes would fail too.
- each stand-in claims one /24 (10.213.N.0/24, N ≥ 1) with a claim file, so several stand-ins
  on one host never hand out the same address; pod N.M lives in netns ``sgltb-N-M`` behind
  host veth ``sgltb-N-M``.
- every change to the shared state (bridge, claims) happens under one file lock in
  ``/run/singleton-testbed``; claims of dead processes and their namespaces are removed when
  the next stand-in starts, so a crashed run leaves nothing behind for long.

Everything here is synchronous (``ip`` commands take milliseconds); async callers use
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
DROP_NEXT_HOP = "169.254.255.254"
"""A link-local next hop that nobody answers for: traffic routed to it is silently lost."""
DROP_MAC = "02:00:5e:00:53:fe"
"""A locally administered MAC no interface has: frames sent to it are dropped by the bridge's ports."""


class NetworkError(Exception):
    """An ``ip`` command failed, or the host network is not usable for pods."""


@dataclass(frozen=True)
class PodNetworkConfig:
    """Addresses and names of the pod network; the defaults suit one test machine."""

    cidr: str = "10.213.0.0/16"
    """The whole pod network; must be a private IPv4 range of at least /23. Its first /24
    holds the host's addresses, each stand-in gets one of the others."""
    prefix: str = "sgltb"
    """Names: bridge ``<prefix>0``, namespaces and host veths ``<prefix>-N-M`` (≤ 5 characters,
    since Linux allows 15 per interface name)."""
    state_root: Path = Path("/run/singleton-testbed")
    """Where the lock and the subnet claims live (tmpfs: a reboot forgets them with the netns)."""

    def __post_init__(self) -> None:
        network = ipaddress.IPv4Network(self.cidr)
        if network.prefixlen > 23 or not network.is_private:
            raise ValueError(f"pod network {self.cidr} must be a private IPv4 range of /23 or larger")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,4}", self.prefix):
            raise ValueError(f"network prefix {self.prefix!r} must be 1-5 lowercase letters or digits")

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.cidr)

    @property
    def bridge(self) -> str:
        return f"{self.prefix}0"

    @property
    def gateway(self) -> str:
        """The bridge's first address: pods' default route, the node's InternalIP, source of probes."""
        return str(self.network.network_address + 1)

    @property
    def api_ip(self) -> str:
        """Where pods reach the API server (a separate address, so it can be partitioned alone)."""
        return str(self.network.network_address + 2)

    @property
    def postgres_ip(self) -> str:
        """Where pods reach PostgreSQL (a separate address, so it can be partitioned alone)."""
        return str(self.network.network_address + 3)

    @property
    def host_addresses(self) -> tuple[str, str, str]:
        """All three, the gateway first (the primary address: the host's source address to pods)."""
        return (self.gateway, self.api_ip, self.postgres_ip)

    @property
    def subnet_count(self) -> int:
        return int(2 ** (24 - self.network.prefixlen))

    def subnet(self, index: int) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network((int(self.network.network_address) + index * 256, 24))

    def sandbox_name(self, ip: str) -> str:
        """``<prefix>-N-M`` for pod address ``…N.M``: the netns and its host-side veth."""
        offset = int(ipaddress.IPv4Address(ip)) - int(self.network.network_address)
        return f"{self.prefix}-{offset // 256}-{offset % 256}"

    def sandbox_pattern(self) -> re.Pattern[str]:
        return re.compile(rf"{re.escape(self.prefix)}-(\d+)-(\d+)")


DEFAULT_NETWORK = PodNetworkConfig()


@dataclass(frozen=True)
class Sandbox:
    """One pod's network: its namespace (also the host veth's name) and address."""

    name: str
    ip: str

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.name


def run_ip(*args: str, netns: str | None = None, batch: list[str] | None = None, check: bool = True) -> str:
    """Run ``ip`` (``-batch -`` when ``batch`` is given); raise ``NetworkError`` with its message."""
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    if batch is not None:
        argv += ["-batch", "-"]
    result = subprocess.run(argv, input="\n".join(batch or []) + "\n", capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise NetworkError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


def netns_supported() -> str | None:
    """None when pods can get network namespaces here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "the stand-in kubelet needs root (network and mount namespaces)"
    try:
        run_ip("netns", "list")
    except (NetworkError, OSError) as exc:
        return f"`ip netns` is not usable: {exc}"
    return None


def _proc_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks: with the pid, it names one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def namespace_id(path: str | Path) -> tuple[int, int] | None:
    """A namespace's identity (device, inode) from its ``/proc/PID/ns/*`` or ``/run/netns`` file."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino)


def kill_namespace_members(kind: str, target: tuple[int, int] | None) -> int:
    """SIGKILL every process whose ``kind`` namespace (``net``, ``mnt``) is ``target``.

    Refuses our own namespace and init's: killing by those would kill the host.
    """
    if target is None or target in (namespace_id(f"/proc/self/ns/{kind}"), namespace_id(f"/proc/1/ns/{kind}")):
        return 0
    killed = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and namespace_id(f"/proc/{entry.name}/ns/{kind}") == target:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


@dataclass
class HostNetwork:
    """This stand-in's share of the host network: the bridge (shared) and its claimed /24."""

    config: PodNetworkConfig
    node: str
    subnet_index: int | None = None
    _next: int = 1
    _used: set[str] = field(default_factory=set)

    @property
    def _lock_path(self) -> Path:
        return self.config.state_root / self.config.prefix / "lock"

    @property
    def _claims(self) -> Path:
        return self.config.state_root / self.config.prefix / "claims"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._claims.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def setup(self) -> ipaddress.IPv4Network:
        """Create the bridge if missing, remove leftovers of dead stand-ins, claim a /24."""
        with self._locked():
            self._ensure_bridge()
            self.subnet_index = self._claim()
            self._remove_stale()
        subnet = self.config.subnet(self.subnet_index)
        log.info("pod network ready node=%s bridge=%s subnet=%s", self.node, self.config.bridge, subnet)
        return subnet

    def teardown(self) -> None:
        """Remove our namespaces and claim; remove the bridge when no live stand-in claims a subnet."""
        with self._locked():
            if self.subnet_index is not None:
                self._remove_sandboxes({self.subnet_index})
                (self._claims / str(self.subnet_index)).unlink(missing_ok=True)
                self.subnet_index = None
            if not self._live_claims() and Path(f"/sys/class/net/{self.config.bridge}").exists():
                run_ip("link", "del", self.config.bridge, check=False)
                log.info("removed bridge %s", self.config.bridge)

    def _ensure_bridge(self) -> None:
        bridge, prefixlen = self.config.bridge, self.config.network.prefixlen
        if not Path(f"/sys/class/net/{bridge}").exists():
            run_ip("link", "add", bridge, "type", "bridge")
        # A fixed address: otherwise a bridge takes the lowest MAC of its ports, which changes
        # as pods come and go, and pods' ARP caches then point at a MAC that is gone (their
        # connections to the API server stall for seconds).
        digest = hashlib.sha256(bridge.encode()).digest()
        run_ip("link", "set", bridge, "address", "02:" + ":".join(f"{b:02x}" for b in digest[:5]))
        for address in self.config.host_addresses:
            run_ip("addr", "replace", f"{address}/{prefixlen}", "dev", bridge)
        run_ip("link", "set", bridge, "up")

    def _read_claim(self, index: int) -> dict[str, str] | None:
        try:
            claim: dict[str, str] = json.loads((self._claims / str(index)).read_text())
        except (OSError, ValueError):
            return None
        return claim

    def _alive(self, claim: dict[str, str]) -> bool:
        pid = int(claim.get("pid", "0"))
        return pid > 0 and _proc_start_time(pid) == claim.get("start")

    def _live_claims(self) -> dict[int, dict[str, str]]:
        claims = {}
        for path in self._claims.iterdir():
            if path.name.isdigit() and (claim := self._read_claim(int(path.name))) and self._alive(claim):
                claims[int(path.name)] = claim
        return claims

    def _claim(self) -> int:
        live = self._live_claims()
        for claim in live.values():
            if claim.get("node") == self.node and int(claim["pid"]) != os.getpid():
                raise NetworkError(f"node {self.node} is already run by stand-in pid {claim['pid']}")
        free = [i for i in range(1, self.config.subnet_count) if i not in live]
        if not free:
            raise NetworkError(f"no free /24 left in {self.config.cidr}")
        # A restarted stand-in takes its old subnet back, so its pods keep their addresses' range.
        previous = [i for i in free if (c := self._read_claim(i)) and c.get("node") == self.node]
        index = (previous or free)[0]
        me = {"node": self.node, "pid": str(os.getpid()), "start": _proc_start_time(os.getpid()) or ""}
        (self._claims / str(index)).write_text(json.dumps(me))
        return index

    def _remove_stale(self) -> None:
        live = set(self._live_claims()) - {self.subnet_index}
        indexes = {i for i in range(1, self.config.subnet_count) if i not in live}
        self._remove_sandboxes(indexes)
        for path in self._claims.iterdir():
            if path.name.isdigit() and int(path.name) in indexes and int(path.name) != self.subnet_index:
                path.unlink(missing_ok=True)

    def _remove_sandboxes(self, indexes: set[int]) -> None:
        """Delete namespaces (killing what still runs in them) and host veths of these subnets."""
        pattern = self.config.sandbox_pattern()
        names = os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else []
        links = [link["ifname"] for link in json.loads(run_ip("-j", "link", "show") or "[]")]
        for name in {*names, *links}:
            match = pattern.fullmatch(name)
            if match and int(match.group(1)) in indexes:
                log.info("removing leftover sandbox %s", name)
                delete_sandbox(Sandbox(name=name, ip=""))

    # --- addresses and sandboxes --------------------------------------------------------

    def allocate_ip(self) -> str:
        """The next free address of our /24, round robin, so a freed address is reused last."""
        if self.subnet_index is None:
            raise NetworkError("the host network is not set up")
        subnet = self.config.subnet(self.subnet_index)
        for _ in range(254):
            candidate = str(subnet.network_address + self._next)
            self._next = self._next % 254 + 1
            if candidate not in self._used:
                self._used.add(candidate)
                return candidate
        raise NetworkError(f"no free pod address left in {subnet}")

    def release_ip(self, ip: str) -> None:
        self._used.discard(ip)

    def create_sandbox(self, ip: str) -> Sandbox:
        """A namespace with ``eth0`` (``ip``) on the bridge, ``lo`` up, default route via the gateway."""
        sandbox = Sandbox(name=self.config.sandbox_name(ip), ip=ip)
        delete_sandbox(sandbox)  # a leftover of a crashed run would make `netns add` fail
        run_ip("netns", "add", sandbox.name)
        try:
            run_ip(batch=[
                f"link add {sandbox.name} type veth peer name eth0 netns {sandbox.name}",
                f"link set {sandbox.name} master {self.config.bridge} up",
            ])
            run_ip(netns=sandbox.name, batch=[
                "link set lo up",
                f"addr add {ip}/{self.config.network.prefixlen} dev eth0",
                "link set eth0 up",
                f"route add default via {self.config.gateway}",
            ])
        except NetworkError:
            delete_sandbox(sandbox)
            raise
        return sandbox


def delete_sandbox(sandbox: Sandbox) -> None:
    """Kill what still runs in the namespace, then delete it (its veth pair goes with it)."""
    if sandbox.netns_path.exists():
        kill_namespace_members("net", namespace_id(sandbox.netns_path))
        run_ip("netns", "del", sandbox.name, check=False)
    if Path(f"/sys/class/net/{sandbox.name}").exists():
        run_ip("link", "del", sandbox.name, check=False)


def partition(sandbox: Sandbox, target: str, *, mode: str = "drop") -> None:
    """Cut the pod's traffic to ``target`` (an IPv4 address).

    ``drop``: route it to a next hop with a MAC nobody has, so packets vanish as in a real
    partition (connects and open connections hang until their timeouts; replies to inbound
    connections are lost too). ``reject``: an ``unreachable`` route, so connects fail at once
    with EHOSTUNREACH.
    """
    address = str(ipaddress.IPv4Address(target))
    if mode == "drop":
        run_ip(netns=sandbox.name, batch=[
            f"neigh replace {DROP_NEXT_HOP} lladdr {DROP_MAC} dev eth0 nud permanent",
            f"route replace {address}/32 via {DROP_NEXT_HOP} dev eth0 onlink",
        ])
    elif mode == "reject":
        run_ip("route", "replace", "unreachable", f"{address}/32", netns=sandbox.name)
    else:
        raise ValueError(f"partition mode must be 'drop' or 'reject', not {mode!r}")
    log.info("partitioned sandbox=%s target=%s mode=%s", sandbox.name, address, mode)


def heal(sandbox: Sandbox, target: str) -> None:
    """Undo ``partition`` for ``target`` (no error when it was not partitioned)."""
    address = str(ipaddress.IPv4Address(target))
    run_ip("route", "del", f"{address}/32", netns=sandbox.name, check=False)
    log.info("healed sandbox=%s target=%s", sandbox.name, address)
