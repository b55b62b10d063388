"""Talking to a stand-in kubelet that runs as a subprocess: its control endpoint (server
side, ``control_app``) and the synchronous wrapper tests use (``StandInKubelet``).

The stand-in serves plain HTTP on 127.0.0.1 (a port of its choosing, announced with its pid in
``<state-dir>/control.json`` once it is ready)::

    GET  /pods        {"node": ..., "pods": [{namespace, name, uid, ip, netns, phase, terminating,
                       containers: [{name, kind, pid, state, restartCount, ready, started, log}]}]}
    POST /signal      {"namespace", "name", "container", "signal": "SIGSTOP" | 19}
    POST /partition   {"namespace", "name", "target": "10.213.0.2", "mode": "drop" | "reject"}
    POST /heal        {"namespace", "name", "target"}

Unknown pods or containers answer 404, bad requests 400, both with ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from aiohttp import web

from singleton_testbed.netns import PodNetworkConfig
from singleton_testbed.procs import Process, wait_until

if TYPE_CHECKING:
    from singleton_testbed.kubelet import StandIn

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _signal_number(value: object) -> int:
    if isinstance(value, int):
        return value
    name = str(value).upper()
    return int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])


def control_app(standin: StandIn) -> web.Application:
    """The control endpoint's routes over a running ``StandIn``."""

    async def pods(_: web.Request) -> web.Response:
        return web.json_response({"node": standin.config.node, "pods": standin.pods()})

    async def send_signal(body: dict[str, Any]) -> None:
        standin.signal(body["namespace"], body["name"], body["container"], _signal_number(body["signal"]))

    async def cut(body: dict[str, Any]) -> None:
        await standin.partition(body["namespace"], body["name"], body["target"], body.get("mode", "drop"))

    async def mend(body: dict[str, Any]) -> None:
        await standin.heal(body["namespace"], body["name"], body["target"])

    app = web.Application()
    app.router.add_get("/pods", pods)
    app.router.add_post("/signal", _action(send_signal))
    app.router.add_post("/partition", _action(cut))
    app.router.add_post("/heal", _action(mend))
    return app


def _action(act: Callable[[dict[str, Any]], Awaitable[None]]) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        try:
            await act(await request.json())
        except LookupError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    return handle


# --- the client side ------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerInfo:
    name: str
    kind: str
    """``init``, ``sidecar`` (init container with restartPolicy Always) or ``regular``."""
    pid: int | None
    """The main process (also its process group); None when not running."""
    state: str
    """``waiting``, ``running`` or ``terminated``."""
    restart_count: int
    ready: bool
    started: bool
    log: Path


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    ip: str
    netns: str | None
    phase: str
    terminating: bool
    containers: tuple[ContainerInfo, ...]

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PodInfo:
        containers = tuple(ContainerInfo(name=c["name"], kind=c["kind"], pid=c["pid"], state=c["state"],
                                         restart_count=c["restartCount"], ready=c["ready"], started=c["started"],
                                         log=Path(c["log"])) for c in doc["containers"])
        return cls(namespace=doc["namespace"], name=doc["name"], uid=doc["uid"], ip=doc["ip"], netns=doc["netns"],
                   phase=doc["phase"], terminating=doc["terminating"], containers=containers)

    def container(self, name: str) -> ContainerInfo:
        for container in self.containers:
            if container.name == name:
                return container
        raise KeyError(f"pod {self.namespace}/{self.name} has no container {name!r}")

    @property
    def running(self) -> bool:
        """Every regular container runs."""
        return all(c.state == "running" for c in self.containers if c.kind == "regular")


class StandInKubelet:
    """A stand-in kubelet subprocess (``python -m singleton_testbed.kubelet``) and its fault hooks.

    It dies with the process that started it (PR_SET_PDEATHSIG), and its containers die with it.
    ``stop()`` is graceful (pods' processes killed, Node deleted, network removed); ``kill()``
    is a crash (SIGKILL; leftovers are cleaned by the next stand-in that starts).
    """

    def __init__(self, *, kubeconfig: Path, node: str, state_dir: Path, network: PodNetworkConfig | None = None,
                 api_host: str | None = None, keep_node: bool = False, log_format: str = "text") -> None:
        self.node, self.state_dir = node, state_dir
        self.network = network or PodNetworkConfig()
        argv = [sys.executable, "-m", "singleton_testbed.kubelet", "--kubeconfig", str(kubeconfig), "--node", node,
                "--state-dir", str(state_dir), "--pod-cidr", self.network.cidr, "--net-prefix", self.network.prefix,
                "--log-format", log_format]
        argv += ["--api-host", api_host] if api_host else []
        argv += ["--keep-node"] if keep_node else []
        self.process = Process(f"stand-in kubelet {node}", argv, log_path=state_dir / "standin.log")
        self.url = ""

    def __repr__(self) -> str:
        return f"<StandInKubelet node={self.node} url={self.url or '-'} running={self.process.running()}>"

    def __enter__(self) -> StandInKubelet:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> StandInKubelet:
        """Start it and wait until its node is registered and its control endpoint answers."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        control = self.state_dir / "control.json"
        control.unlink(missing_ok=True)
        self.process.start()
        wait_until(lambda: self._announced(control), timeout=timeout, what=f"stand-in kubelet {self.node}",
                   proc=self.process)
        return self

    def _announced(self, control: Path) -> bool:
        try:
            doc = json.loads(control.read_text())
        except (OSError, ValueError):
            return False
        if doc.get("pid") != self.process.pid:
            return False
        self.url = str(doc["url"])
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM and wait: pods' processes are killed, the Node deleted, the network removed."""
        self.process.stop(timeout)
        self.url = ""

    def kill(self) -> None:
        """SIGKILL the stand-in alone, as a crash would (its containers die by PDEATHSIG)."""
        if self.process.popen is not None:
            self.process.signal(signal.SIGKILL)
            self.process.popen.wait()
        self.process.popen = None
        self.url = ""

    # --- requests -------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if not self.url:
            raise RuntimeError(f"stand-in kubelet {self.node} is not running")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            message = json.loads(exc.read() or b"{}").get("error", str(exc))
            raise (LookupError if exc.code == 404 else ValueError)(message) from exc

    def pods(self) -> list[PodInfo]:
        return [PodInfo.from_json(doc) for doc in self._call("GET", "/pods")["pods"]]

    def pod(self, namespace: str, name: str, *, terminating: bool = False) -> PodInfo:
        """The pod of that name that is not being terminated (or, with ``terminating``, also one
        that is); KeyError when there is none."""
        found = [info for info in self.pods() if (info.namespace, info.name) == (namespace, name)
                 and (terminating or not info.terminating)]
        if not found:
            raise KeyError(f"pod {namespace}/{name} does not run on {self.node}")
        return min(found, key=lambda info: info.terminating)

    def wait_for_pod(self, namespace: str, name: str, *, timeout: float = 30.0,
                     until: Callable[[PodInfo], bool] = lambda info: info.running) -> PodInfo:
        """Wait until the pod runs here and ``until`` holds (default: all regular containers run)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.pod(namespace, name)
                if until(info):
                    return info
            except KeyError:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {namespace}/{name} on {self.node}: condition not met in {timeout:g}s")
            time.sleep(0.05)

    def pod_ip(self, namespace: str, name: str) -> str:
        return self.pod(namespace, name).ip

    def log_path(self, namespace: str, name: str, container: str) -> Path:
        """The container's log (stdout and stderr, all restarts); the newest pod of that name,
        also after the pod is gone."""
        logs = sorted(self.state_dir.glob(f"pods/{namespace}_{name}_*/logs/{container}.log"),
                      key=lambda p: p.stat().st_mtime)
        if not logs:
            raise FileNotFoundError(f"no log of {namespace}/{name} container {container!r} in {self.state_dir}")
        return logs[-1]

    def read_log(self, namespace: str, name: str, container: str) -> str:
        return self.log_path(namespace, name, container).read_text(errors="replace")

    def signal(self, namespace: str, name: str, container: str, signum: int | str) -> None:
        """Signal the container's process group: SIGKILL, SIGSTOP, SIGCONT…"""
        self._call("POST", "/signal", {"namespace": namespace, "name": name, "container": container,
                                       "signal": signum})

    def partition(self, namespace: str, name: str, target: str, mode: str = "drop") -> None:
        """Cut the pod's traffic to ``target`` (``drop``: silently; ``reject``: EHOSTUNREACH)."""
        self._call("POST", "/partition", {"namespace": namespace, "name": name, "target": target, "mode": mode})

    def heal(self, namespace: str, name: str, target: str) -> None:
        self._call("POST", "/heal", {"namespace": namespace, "name": name, "target": target})


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and os.path.exists(f"/proc/{pid}")
