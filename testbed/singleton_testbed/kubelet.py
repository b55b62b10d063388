"""A kubelet stand-in: makes the pods bound to one Node run as local processes.

Who uses it: tests and ``make demo``, through ``StandInKubelet`` (a subprocess with a control
endpoint; see ``kubelet_control``), or in-process as ``StandIn`` (``async start()``/``stop()``;
``ThreadedStandIn`` runs one on a background thread for synchronous code). From a shell::

    python -m singleton_testbed.kubelet --kubeconfig K --node standin-1 --state-dir /tmp/standin-1

What it does (root only: network and mount namespaces):

- registers the Node Ready (capacity, InternalIP = the pod network's gateway), lifts the
  ``not-ready`` taint, renews its Lease in ``kube-node-lease`` every 10 s, re-reports status
  every 30 s; deletes the Node on stop (unless ``--keep-node``), so the scheduler stops using it;
- watches the pods with ``spec.nodeName`` = its node and runs each with a ``PodWorker``
  (``kubelet_pods``): netns + veth + IP (``netns``), volumes, env, service-account token at
  the standard path, init/sidecar/regular containers with probes, hooks, restarts, grace;
- on start, deletes pods that were deleted while it was down, restarts the others (their
  processes died with the previous stand-in), and removes leftovers of crashed runs.

Pods reach the API server at ``KUBERNETES_SERVICE_HOST`` = ``PodNetworkConfig.api_ip``
(10.213.0.2 by default; the control plane binds all addresses and names the bridge's addresses
in its certificate) and PostgreSQL at ``PodNetworkConfig.postgres_ip`` (10.213.0.3); see ``netns``.
Images are ignored: containers run ``command`` + ``args`` from the host's filesystem.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from singleton_sidecar.kube import KubeClient, KubeConfigError, KubeError, KubeGone, KubeNotFound, load_kube_config
from singleton_sidecar.logs import setup_logging
from singleton_testbed.kubelet_api import KubeletApi, NodeSpec, StandInClient
from singleton_testbed.kubelet_containers import NodeContext
from singleton_testbed.kubelet_control import StandInKubelet, control_app
from singleton_testbed.kubelet_pods import PodWorker
from singleton_testbed.kubelet_runtime import TaskSet
from singleton_testbed.netns import DEFAULT_NETWORK, HostNetwork, PodNetworkConfig, heal, netns_supported, partition

__all__ = ["StandIn", "StandInConfig", "StandInKubelet", "ThreadedStandIn", "main"]

log = logging.getLogger(__name__)
T = TypeVar("T")
WATCH_SECONDS = 300.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class StandInConfig:
    """One stand-in kubelet's settings."""

    kubeconfig: Path
    """Admin kubeconfig of the cluster (the stand-in creates tokens and deletes pods)."""
    node: str
    """The Node's name; pods bound to it run here."""
    state_dir: Path
    """Per-pod folders (``pods/<ns>_<name>_<uid>/logs/<container>.log``, volumes) and ``control.json``."""
    network: PodNetworkConfig = DEFAULT_NETWORK
    """Pod network; stand-ins on one host share the bridge and claim distinct /24s."""
    api_host: str | None = None
    """``KUBERNETES_SERVICE_HOST`` for pods; default: the network's ``api_ip`` when the
    kubeconfig's server is on loopback, else the kubeconfig's host."""
    keep_node: bool = False
    """Leave the Node registered on stop (it then looks Ready with nothing behind it)."""
    capacity: Mapping[str, str] = field(default_factory=lambda: {"cpu": "16", "memory": "32Gi", "pods": "110"})
    """Advertised capacity and allocatable (not enforced)."""
    heartbeat_seconds: float = 10.0
    """Lease renewal period; the node status is re-reported every third beat."""


class StandIn:
    """The stand-in kubelet of one node, on the running event loop."""

    def __init__(self, config: StandInConfig) -> None:
        self.config = config
        self.network = HostNetwork(config.network, config.node)
        self.tasks = TaskSet(f"stand-in {config.node}")
        self.workers: dict[str, PodWorker] = {}
        self._deleting: set[str] = set()
        self._worker_tasks: dict[str, asyncio.Task[None]] = {}
        self._background: list[asyncio.Task[None]] = []
        self._client: KubeClient | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ctx: NodeContext | None = None
        self._registered = False

    def __repr__(self) -> str:
        return f"<StandIn node={self.config.node} pods={len(self.workers)}>"

    @property
    def ctx(self) -> NodeContext:
        if self._ctx is None:
            raise RuntimeError("the stand-in is not started")
        return self._ctx

    async def start(self) -> None:
        """Register the node, set up the pod network, adopt the node's pods, start watching.
        On failure, whatever was set up is undone before the error propagates."""
        if reason := netns_supported():
            raise RuntimeError(reason)
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        config = self.config
        kube = load_kube_config(str(config.kubeconfig))
        self._client = StandInClient(kube)
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        url = urlsplit(kube.server)
        api_host = config.api_host or (config.network.api_ip if url.hostname in LOOPBACK else str(url.hostname))
        node = NodeSpec(name=config.node, host_ip=config.network.gateway, capacity=config.capacity)
        self._ctx = NodeContext(
            api=KubeletApi(self._client, node), network=self.network, node=node, state_dir=config.state_dir,
            api_host=api_host, api_port=url.port or 443, ca_data=kube.ca_data or b"", http=self._http,
            # Our interpreter's folder first: a venv's console scripts (singleton-sidecar) run by name.
            path_env=os.pathsep.join([str(Path(sys.executable).parent),
                                      os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")]))
        config.state_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.network.setup)
        await self.ctx.api.register_node()
        self._registered = True
        pods, version = await self.ctx.api.list_pods()
        for pod in pods:
            self._on_event("ADDED", pod)
        self._background = [self.tasks.spawn(self._watch(version), "pod watch"),
                            self.tasks.spawn(self._heartbeat(), "heartbeat")]
        log.info("stand-in kubelet started node=%s pods=%d", config.node, len(pods))

    async def stop(self) -> None:
        """Kill every pod's processes (the pods stay in the API), deregister, free the network."""
        for task in self._background:
            task.cancel()
        for worker in list(self.workers.values()):
            worker.shutdown()
        # Workers finish on their own (they kill their processes); cancelling them could skip that.
        await asyncio.gather(*self._worker_tasks.values(), return_exceptions=True)
        await self.tasks.close()
        if self._registered and not self.config.keep_node:
            with contextlib.suppress(KubeError):
                await self.ctx.api.delete_node()
        await asyncio.to_thread(self.network.teardown)
        for closer in (self._http, self._client):
            if closer is not None:
                await closer.close()
        log.info("stand-in kubelet stopped node=%s", self.config.node)

    # --- the pods ---------------------------------------------------------------------------

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        uid, meta = pod["metadata"]["uid"], pod["metadata"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.gone()
        elif worker is not None:
            worker.update(pod)
        elif meta.get("deletionTimestamp"):
            if uid not in self._deleting:  # deleted while we were away, or already finished here
                self._deleting.add(uid)
                self.tasks.spawn(self.ctx.api.delete_pod(pod), f"delete {meta['namespace']}/{meta['name']}")
        elif (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            worker = PodWorker(pod, self.ctx)
            self.workers[uid] = worker
            task = self.tasks.spawn(worker.run(), f"pod {meta['namespace']}/{meta['name']}")
            self._worker_tasks[uid] = task
            task.add_done_callback(lambda _: self._forget(uid))

    def _forget(self, uid: str) -> None:
        self.workers.pop(uid, None)
        self._worker_tasks.pop(uid, None)
        self._deleting.add(uid)  # a later event for it (finalizers) must not start it again

    async def _watch(self, version: str) -> None:
        while True:
            try:
                async with aclosing(self.ctx.api.watch_pods(version, WATCH_SECONDS)) as events:
                    async for kind, pod in events:
                        version = pod["metadata"].get("resourceVersion", version)
                        if kind != "BOOKMARK":
                            self._on_event(kind, pod)
            except KubeGone:
                version = await self._relist()
            except KubeError as exc:
                log.warning("pod watch failed node=%s: %s", self.config.node, exc)
                await asyncio.sleep(1)

    async def _relist(self) -> str:
        pods, version = await self.ctx.api.list_pods()
        present = {p["metadata"]["uid"] for p in pods}
        for uid, worker in list(self.workers.items()):
            if uid not in present:
                worker.gone()
        for pod in pods:
            self._on_event("MODIFIED", pod)
        return version

    async def _heartbeat(self) -> None:
        beat = 0
        while True:
            await asyncio.sleep(self.config.heartbeat_seconds)
            beat += 1
            try:
                if beat % 3 == 0:
                    await self._report_node()
                await self.ctx.api.renew_lease()
            except KubeError as exc:
                log.warning("heartbeat failed node=%s: %s", self.config.node, exc)

    async def _report_node(self) -> None:
        try:
            await self.ctx.api.report_node_status()
        except KubeNotFound:
            log.warning("node %s was deleted; registering it again", self.config.node)
            await self.ctx.api.register_node()
        self._registered = True

    # --- what tests see and do ----------------------------------------------------------------

    def pods(self) -> list[dict[str, Any]]:
        """Every pod this stand-in runs: IP, phase, containers with pid, state, restarts, log."""
        return [worker.info() for worker in self.workers.values()]

    def worker(self, namespace: str, name: str) -> PodWorker:
        """The pod of that name, preferring a running one to one being terminated."""
        matches = [w for w in self.workers.values() if (w.namespace, w.name) == (namespace, name)]
        if not matches:
            raise LookupError(f"pod {namespace}/{name} does not run on {self.config.node}")
        return min(matches, key=lambda w: w.mode is not None)

    def signal(self, namespace: str, name: str, container: str, signum: int) -> None:
        self.worker(namespace, name).signal(container, signum)

    async def partition(self, namespace: str, name: str, target: str, mode: str = "drop") -> None:
        sandbox = self.worker(namespace, name).sandbox
        if sandbox is None:
            raise LookupError(f"pod {namespace}/{name} has no network namespace")
        await asyncio.to_thread(partition, sandbox, target, mode=mode)

    async def heal(self, namespace: str, name: str, target: str) -> None:
        sandbox = self.worker(namespace, name).sandbox
        if sandbox is None:
            raise LookupError(f"pod {namespace}/{name} has no network namespace")
        await asyncio.to_thread(heal, sandbox, target)


class ThreadedStandIn:
    """A ``StandIn`` on its own event loop in a background thread, for synchronous code.

    Container processes die with the thread that started them (PR_SET_PDEATHSIG), so they
    never outlive ``stop()``.
    """

    def __init__(self, config: StandInConfig) -> None:
        self.standin = StandIn(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"stand-in {config.node}", daemon=True)

    def __repr__(self) -> str:
        return f"<ThreadedStandIn {self.standin!r} running={self._thread.is_alive()}>"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the stand-in's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call_soon(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run a plain function on the stand-in's loop (its state belongs to that thread)."""

        async def run() -> T:
            return fn()

        return self.call(run(), timeout)

    def start(self, timeout: float = 30.0) -> StandIn:
        self._thread.start()
        try:
            self.call(self.standin.start(), timeout)
        except BaseException:
            self._end_thread(timeout)  # start() has undone its own set-up
            raise
        return self.standin

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self.call(self.standin.stop(), timeout)
        finally:
            self._end_thread(timeout)

    def _end_thread(self, timeout: float) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._loop.close()


# --- the command ----------------------------------------------------------------------------


async def serve(config: StandInConfig) -> None:
    """Run until SIGTERM or SIGINT, with the control endpoint announced in ``control.json``."""
    standin = StandIn(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    control_file = config.state_dir / "control.json"
    control_file.unlink(missing_ok=True)
    await standin.start()
    runner = web.AppRunner(control_app(standin), access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        tmp = control_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "pid": os.getpid(), "node": config.node}))
        tmp.replace(control_file)
        await stop.wait()
    finally:
        control_file.unlink(missing_ok=True)
        await runner.cleanup()
        await standin.stop()


def parse_args(argv: list[str] | None) -> tuple[StandInConfig, Literal["json", "text"], str]:
    parser = argparse.ArgumentParser(prog="python -m singleton_testbed.kubelet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True, type=Path, help="admin kubeconfig")
    parser.add_argument("--node", required=True, help="the Node's name")
    parser.add_argument("--state-dir", required=True, type=Path, help="pod folders, logs, control.json")
    parser.add_argument("--pod-cidr", default=DEFAULT_NETWORK.cidr, help="pod network (default %(default)s)")
    parser.add_argument("--net-prefix", default=DEFAULT_NETWORK.prefix,
                        help="bridge <prefix>0, namespaces <prefix>-N-M (default %(default)s)")
    parser.add_argument("--api-host", help="KUBERNETES_SERVICE_HOST for pods (default: the network's API address)")
    parser.add_argument("--keep-node", action="store_true", help="do not delete the Node on stop")
    parser.add_argument("--log-format", choices=["json", "text"], default="json")
    parser.add_argument("--log-level", choices=["debug", "info", "warning"], default="info")
    args = parser.parse_args(argv)
    config = StandInConfig(kubeconfig=args.kubeconfig, node=args.node, state_dir=args.state_dir.resolve(),
                           network=PodNetworkConfig(cidr=args.pod_cidr, prefix=args.net_prefix),
                           api_host=args.api_host, keep_node=args.keep_node)
    return config, args.log_format, args.log_level


def main(argv: list[str] | None = None) -> int:
    config, log_format, level = parse_args(argv)
    setup_logging(log_format, getattr(logging, level.upper()))
    try:
        asyncio.run(serve(config))
    except (RuntimeError, OSError, KubeError, KubeConfigError) as exc:
        log.error("stand-in kubelet failed node=%s: %s", config.node, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
