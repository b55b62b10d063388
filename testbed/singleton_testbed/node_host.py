"""Host resources of the real node (``node``): its bridge, mounts, cgroups, processes,
iptables chains and sysctls, found and removed by the node's own names and paths only.

Everything here takes the names to act on as arguments, so a clean-up never touches what
another test bed (a campaign's servers, another session's PostgreSQL) made. The one exception
is iptables: kube-proxy's ``KUBE-*`` chains are machine-global by design, which is why ``node``
allows only one real node per machine (a lock file).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_FS = Path("/sys/fs/cgroup")
KUBELET_SYSCTLS = (
    "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
)
"""What kubelet sets at start-up (``setupKernelTunables``; the alternative,
``protectKernelDefaults``, refuses to start instead): read before and restored after."""


def run(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


# --- links -----------------------------------------------------------------------------------


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def bridge_mac(name: str) -> str:
    """A fixed, locally administered unicast MAC for the bridge ``name``."""
    digest = hashlib.sha256(name.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def make_bridge(name: str, addresses: Sequence[str], netns: str | None = None) -> None:
    """The pods' bridge, made before the CNI plugin sees it so it holds the node IP and the
    pods' gateway: the plugin then runs with ``isGateway: false`` and leaves the global
    ``net.ipv4.ip_forward`` alone (pods only talk to this host, never through it).

    Its MAC address is set, not left to the kernel: a bridge whose address was never set takes
    the lowest MAC of its ports, so it changed whenever a pod's veth with a lower MAC came or
    went, and every other pod's ARP entry for the node IP (PostgreSQL, the API server, the
    gateway) went stale: all pods lost this host for up to ~45 s (a campaign group "did not
    settle" right after a pod was replaced)."""
    ip = ip_command(netns)
    if netns is not None or not link_exists(name):  # a new namespace has no bridge yet
        run(*ip, "link", "add", name, "type", "bridge")
    run(*ip, "link", "set", name, "address", bridge_mac(name))
    for address in addresses:
        run(*ip, "addr", "replace", address, "dev", name)
    run(*ip, "link", "set", name, "up")


def bridge_ports(bridge: str) -> list[str]:
    folder = Path("/sys/class/net", bridge, "brif")
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def delete_bridge(name: str) -> None:
    """The bridge and every veth still plugged into it (pods whose namespace lives on)."""
    for port in bridge_ports(name):
        run("ip", "link", "del", port, check=False)
    if link_exists(name):
        run("ip", "link", "del", name, check=False)


# --- network namespaces ------------------------------------------------------------------------

NETNS_DIR = Path("/run/netns")


def ip_command(netns: str | None) -> tuple[str, ...]:
    return ("ip",) if netns is None else ("ip", "-n", netns)


def in_netns(netns: str | None) -> list[str]:
    """The argv prefix that runs a program in ``netns`` (nothing for the host's). ``nsenter``
    enters the network namespace only: ``ip netns exec`` would also mount a fresh /sys, hiding
    the cgroup file systems kubelet and containerd need."""
    return [] if netns is None else ["nsenter", f"--net={NETNS_DIR / netns}", "--"]


def netns_exists(netns: str) -> bool:
    return (NETNS_DIR / netns).exists()


def make_netns(netns: str, *, host_link: str, host_ip: str, node_link: str, node_ip: str) -> None:
    """A network namespace joined to the host by a veth pair, a /30 between ``host_ip`` (the
    host's end, ``host_link``) and ``node_ip`` (the namespace's, ``node_link``); the
    namespace forwards (its pods reach the host through it) and routes everything to the host."""
    delete_netns(netns, host_link)
    run("ip", "netns", "add", netns)
    run("ip", "link", "add", host_link, "type", "veth", "peer", "name", node_link, "netns", netns)
    run("ip", "addr", "add", f"{host_ip}/30", "dev", host_link)
    run("ip", "-n", netns, "addr", "add", f"{node_ip}/30", "dev", node_link)
    for args in (("ip", "link", "set", host_link, "up"), ("ip", "-n", netns, "link", "set", node_link, "up"),
                 ("ip", "-n", netns, "link", "set", "lo", "up")):
        run(*args)
    run(*in_netns(netns), "sysctl", "-qw", "net.ipv4.ip_forward=1")


def route_netns(netns: str, *, host_link: str, host_ip: str, node_ip: str, pod_cidr: str) -> None:
    """The routes between the host and the namespace's pods (again after a link came back up:
    the kernel drops the routes of a link that goes down)."""
    run("ip", "route", "replace", pod_cidr, "via", node_ip, "dev", host_link)
    run("ip", "-n", netns, "route", "replace", "default", "via", host_ip)


def set_link(name: str, up: bool) -> None:
    run("ip", "link", "set", name, "up" if up else "down")


def delete_netns(netns: str, host_link: str | None) -> None:
    """The namespace (its links, bridge, routes and iptables go with it) and the host's end of
    its veth pair (the host's route to its pods goes with that)."""
    if host_link and link_exists(host_link):
        run("ip", "link", "del", host_link, check=False)
    if netns_exists(netns):
        run("ip", "netns", "del", netns, check=False)


# --- mounts ----------------------------------------------------------------------------------


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(folders: Iterable[Path]) -> list[str]:
    """Mount points at or below any of ``folders``, deepest first."""
    prefixes = [str(folder).rstrip("/") for folder in folders]
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape(line.split()[4])
        if any(point == prefix or point.startswith(prefix + "/") for prefix in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_under(folders: Iterable[Path]) -> None:
    folders = list(folders)
    for _ in range(5):  # a lazy unmount of a parent can reveal nothing new, but stacked mounts need rounds
        points = mounts_under(folders)
        if not points:
            return
        for point in points:
            if run("umount", point, check=False).returncode != 0:
                run("umount", "-l", point, check=False)
    if left := mounts_under(folders):
        log.warning("mounts left under %s: %s", folders, left)


# --- processes -------------------------------------------------------------------------------


NODE_PROGRAMS = frozenset({"kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "containerd-shim",
                           "runc", "ctr"})
"""The programs a node runs itself; container processes are found by cgroup instead."""


def pids_mentioning(text: str, programs: frozenset[str] = NODE_PROGRAMS) -> list[int]:
    """Processes of ``programs`` whose command line contains ``text`` (a path only this node
    uses), so a shell that merely looks at the node's files is never killed."""
    found = []
    needle = text.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            program = Path(os.readlink(entry / "exe")).name.removesuffix(" (deleted)")
        except OSError:
            continue
        if needle in cmdline and program in programs:
            found.append(int(entry.name))
    return found


def kill_and_wait(pids: Iterable[int], timeout: float = 10) -> None:
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
        if not alive:
            return
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


# --- cgroups ---------------------------------------------------------------------------------


def cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones, and the v2 ``unified``)."""
    if not CGROUP_FS.exists():
        return []
    return sorted(p for p in CGROUP_FS.iterdir() if p.is_dir() and not p.is_symlink())


def cgroup_dirs(root: str) -> list[Path]:
    """``root`` (e.g. ``/singleton-node``) in every hierarchy where it exists."""
    return [h / root.strip("/") for h in cgroup_hierarchies() if (h / root.strip("/")).is_dir()]


def make_cgroup_root(root: str) -> None:
    """kubelet refuses a ``cgroupRoot`` that does not exist, in any v1 controller it uses."""
    for hierarchy in cgroup_hierarchies():
        path = hierarchy / root.strip("/")
        path.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":
            # A new v1 cpuset is empty: copy the parent's so tasks can join it.
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not (path / name).read_text().strip():
                    (path / name).write_text((hierarchy / name).read_text())


def cgroup_tree(root: str) -> list[Path]:
    """Every cgroup at or below ``root`` in every hierarchy, deepest first. ``os.walk`` skips
    folders that vanish while it walks (kubelet and runc remove cgroups as pods end)."""
    found: list[Path] = []
    for top in cgroup_dirs(root):
        found.extend(Path(folder) for folder, _, _ in os.walk(top))
    return sorted(found, key=lambda p: -len(p.parts))


def cgroup_pids(root: str) -> set[int]:
    pids: set[int] = set()
    for folder in cgroup_tree(root):
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in (folder / "cgroup.procs").read_text().split())
    return pids


def thaw_cgroups(root: str) -> None:
    """Thaw every v1 freezer cgroup below ``root`` (a pod a test froze, ``node_pods``): a
    frozen process does not die of SIGKILL until it is thawed."""
    top = CGROUP_FS / "freezer" / root.strip("/")
    if not top.is_dir():
        return
    for folder, _, _ in os.walk(top):
        with contextlib.suppress(OSError):
            state = Path(folder, "freezer.state")
            if state.read_text().strip() != "THAWED":
                state.write_text("THAWED")


def set_freezer(root: str, state: str, timeout: float = 10) -> None:
    """Freeze (``FROZEN``) or thaw (``THAWED``) every process below ``root`` at once: a v1
    freezer cgroup's state applies to all cgroups below it."""
    path = CGROUP_FS / "freezer" / root.strip("/") / "freezer.state"
    path.write_text(state)
    deadline = time.monotonic() + timeout
    while path.read_text().strip() != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not reach {state}")
        time.sleep(0.01)


def remove_cgroups(root: str, timeout: float = 10) -> None:
    """Kill what still runs below ``root`` (containers of a killed run), then remove the tree."""
    deadline = time.monotonic() + timeout
    thaw_cgroups(root)
    while (pids := cgroup_pids(root)) and time.monotonic() < deadline:
        kill_and_wait(pids, timeout=2)
    for folder in cgroup_tree(root):
        with contextlib.suppress(OSError):
            folder.rmdir()
    if left := cgroup_dirs(root):
        log.warning("cgroups left: %s", left)


# --- iptables --------------------------------------------------------------------------------

IPTABLES = ("iptables", "ip6tables")


def kube_chains(netns: str | None = None) -> dict[str, list[str]]:
    """``"<command>/<table>"`` → the ``KUBE-*`` chains in it, for IPv4 and IPv6 (of ``netns``,
    or of the host)."""
    found: dict[str, list[str]] = {}
    for command in IPTABLES:
        result = run(*in_netns(netns), f"{command}-save", check=False)
        table = ""
        for line in result.stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KUBE-"):
                found.setdefault(f"{command}/{table}", []).append(line[1:].split()[0])
    return found


def remove_kube_chains() -> None:
    """Remove every ``KUBE-*`` chain (kube-proxy's and kubelet's canaries) and the rules that
    jump to them. ``kube-proxy --cleanup`` runs first; this catches what it does not own."""
    for command in IPTABLES:
        result = run(f"{command}-save", check=False)
        table = ""
        jumps: list[tuple[str, str]] = []
        chains: list[tuple[str, str]] = []
        for line in result.stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KUBE-"):
                chains.append((table, line[1:].split()[0]))
            elif line.startswith("-A ") and " -j KUBE-" in line and not line.split()[1].startswith("KUBE-"):
                jumps.append((table, line[3:]))
        for table, rule in jumps:
            run(command, "-w", "-t", table, "-D", *shlex.split(rule), check=False)
        for table, chain in chains:
            run(command, "-w", "-t", table, "-F", chain, check=False)
        for table, chain in chains:
            run(command, "-w", "-t", table, "-X", chain, check=False)


# --- sysctls ---------------------------------------------------------------------------------


def read_sysctls(names: Sequence[str] = KUBELET_SYSCTLS) -> dict[str, str]:
    values = {}
    for name in names:
        with contextlib.suppress(OSError):
            values[name] = Path("/proc/sys", name).read_text().strip()
    return values


def restore_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        path = Path("/proc/sys", name)
        with contextlib.suppress(OSError):
            if path.read_text().strip() != value:
                path.write_text(value + "\n")
